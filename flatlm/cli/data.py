"""`flatlm data --config FILE[:PRESET] --data-dir DIR`: materialise a config's corpus and downstream tasks."""

from __future__ import annotations

from flatlm.cli.common import OVERRIDES_HELP, add_output_flags, load_config
from flatlm.data.tasks import build_task
from flatlm.errors import UserError
from flatlm.languages import make_language
from flatlm.run import data_dir, prepare_data, task_names
from flatlm.table import print_json, print_table
from flatlm.train.loop import validate


def add_parser(sub) -> None:
    """Register `data`."""
    p = sub.add_parser("data", help="materialise a config's corpus (tfds array_record)", epilog=OVERRIDES_HELP)
    p.add_argument("--config", required=True, help="configs/FILE.py[:PRESET] (a config file and an optional preset)")
    p.add_argument("--data-dir", default="", help="where to write (default: the config's data.data_dir)")
    p.add_argument("--workdir", default="", help="use <workdir>/data when no data dir is given")
    p.add_argument("--no-tasks", action="store_true", help="only the pre-training corpus, no downstream tasks")
    add_output_flags(p)
    p.set_defaults(func=run, overrides=True)


def run(args) -> int:
    """Build the corpus splits and (unless --no-tasks) every downstream task's splits; print their sizes."""
    config = load_config(args.config, args.overrides)
    validate(config)
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
        print_json({"data_dir": target, "datasets": rows})
    else:
        print_table(rows, [("dataset", "dataset", "s"), ("split", "split", "s"), ("examples", "examples", "d")])
        print(f"data dir: {target}")
    return 0
