"""The `flatlm` command line. Each verb is a thin layer over importable functions (so a Colab can do the same).

User mistakes print one line `flatlm: error: ...` on stderr and exit with code 2. Verbs that print a table
accept `--json` and then print the same results as one JSON object on stdout (progress goes to stderr).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from flatlm.errors import UserError  # noqa: E402

# Modules that register more verbs with `add_parser(subparsers)`.
VERB_MODULES: tuple[str, ...] = (
    "flatlm.evaluate.runner", "flatlm.experiment", "flatlm.report", "flatlm.theory.cli", "flatlm.flatness.cli",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's own convention), no usage dump
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _config_from_args(args, extra: list[str]):
    from flatlm import config as config_lib

    bad = [a for a in extra if not a.startswith("--config.")]
    if bad:
        raise UserError(f"unrecognised argument {bad[0]!r}; config overrides look like --config.train.steps=200")
    config = config_lib.load_config(args.config)
    return config_lib.apply_overrides(config, extra)


def print_table(rows: list[dict], columns: list[tuple[str, str, str]], file=None) -> None:
    """columns: (key, header, format spec). Prints to `file` (default: the current sys.stdout)."""
    file = file or sys.stdout
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([_fmt(row.get(k), f) for k, _, f in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)), file=file)
        if i == 0:
            print("  ".join("-" * w for w in widths), file=file)


def _fmt(v, spec: str) -> str:
    if v is None:
        return "-"
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


# ------------------------------------------------------------------ train


def cmd_train(args, extra) -> int:
    from flatlm.train.loop import train_and_evaluate

    config = _config_from_args(args, extra)
    result = train_and_evaluate(config, args.workdir, progress=not args.quiet)
    if args.json:
        print(json.dumps({"workdir": args.workdir, **result}))
    else:
        print(f"done: {args.workdir}  " + "  ".join(f"{k}={v:.4g}" for k, v in result.items()
                                                    if isinstance(v, float)))
    return 0


# ------------------------------------------------------------------ data


def cmd_data(args, extra) -> int:
    from flatlm import config as config_lib
    from flatlm.data.tasks import build_task
    from flatlm.evaluate.runner import task_names
    from flatlm.languages import make_language
    from flatlm.train.loop import data_dir, prepare_data

    config = _config_from_args(args, extra)
    config_lib.validate(config)
    if args.data_dir:
        config.data.data_dir = args.data_dir
    if not config.data.data_dir and not args.workdir:
        raise UserError("say where to write the data: --data-dir DIR (or --workdir DIR for <workdir>/data)")
    target = data_dir(config, args.workdir or ".")
    sources = prepare_data(config, args.workdir or ".", quiet=args.quiet)
    rows = [{"dataset": "corpus", "split": k, "examples": len(v)} for k, v in sources.items()]
    if not args.no_tasks:
        language = make_language(config.language)
        sizes = (config.eval.task_train_size, config.eval.task_eval_size, config.eval.task_eval_size)
        for task in task_names(config, language):
            splits = build_task(config.language.to_dict(), task, target, sizes, seed=config.seed,
                                definition=config.eval.task_definition, quiet=args.quiet)
            rows += [{"dataset": f"task {task}", "split": k, "examples": len(v["label"])} for k, v in splits.items()]
    if args.json:
        print(json.dumps({"data_dir": target, "datasets": rows}))
    else:
        print_table(rows, [("dataset", "dataset", "s"), ("split", "split", "s"), ("examples", "examples", "d")])
        print(f"data dir: {target}")
    return 0


# ------------------------------------------------------------------ demo


def cmd_demo(args, extra) -> int:
    from flatlm import demo

    if extra:
        raise UserError(f"unrecognised argument {extra[0]!r}; flatlm demo takes --workdir, --steps and --json")
    result = demo.run(args.workdir, steps=args.steps, progress=not args.quiet)
    if args.json:
        print(json.dumps(result))
    else:
        demo.print_report(result)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="flatlm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="pre-train a model from a config (resumes from the workdir)")
    t.add_argument("--config", required=True, help="configs/FILE.py[:PRESET]")
    t.add_argument("--workdir", required=True)
    t.add_argument("--json", action="store_true", help="print the final metrics as JSON")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_train)

    d = sub.add_parser("data", help="materialise a config's corpus (tfds array_record)")
    d.add_argument("--config", required=True, help="configs/FILE.py[:PRESET]")
    d.add_argument("--data-dir", default="", help="where to write (default: the config's data.data_dir)")
    d.add_argument("--workdir", default="", help="use <workdir>/data when no data dir is given")
    d.add_argument("--no-tasks", action="store_true", help="only the pre-training corpus, no downstream tasks")
    d.add_argument("--json", action="store_true")
    d.add_argument("--quiet", action="store_true")
    d.set_defaults(func=cmd_data)

    m = sub.add_parser("demo", help="the paper's story on a small language, on CPU, in minutes")
    m.add_argument("--workdir", default="demo_workdir")
    m.add_argument("--steps", type=int, default=0, help="training steps (0: the demo's default)")
    m.add_argument("--json", action="store_true")
    m.add_argument("--quiet", action="store_true")
    m.set_defaults(func=cmd_demo)

    for name in VERB_MODULES:
        importlib.import_module(name).add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax/tfds chatter; our own progress goes to stderr
    from flatlm.train.loop import NonFiniteLoss

    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra and args.verb not in ("train", "data", "demo", "experiment"):
            raise UserError(f"unrecognised argument {extra[0]!r} (see `flatlm {args.verb} --help`)")
        return args.func(args, extra) if args.verb in ("train", "data", "demo", "experiment") else args.func(args)
    except UserError as e:
        print(f"flatlm: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLoss as e:
        print(f"flatlm: training stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("flatlm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
