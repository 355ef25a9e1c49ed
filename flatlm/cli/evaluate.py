"""`flatlm evaluate --workdir DIR`: exact loss, linear probe and fine-tuning of a run's checkpoints."""

from __future__ import annotations

from flatlm import checkpoint as ckpt
from flatlm import paths
from flatlm import run as run_lib
from flatlm.cli.common import add_output_flags, parse_steps
from flatlm.config import load_workdir_config
from flatlm.errors import UserError
from flatlm.evaluate.runner import evaluate_run, table_rows, with_eval_overrides
from flatlm.models import stacking
from flatlm.table import print_json, print_table


def add_parser(sub) -> None:
    """Register `evaluate`."""
    p = sub.add_parser("evaluate", help="exact loss, linear probe and fine-tuning of a run's checkpoints")
    p.add_argument("--workdir", required=True)
    p.add_argument("--steps", default="all", help="all | last | comma-separated steps")
    p.add_argument("--task", action="append", default=[], help="a downstream task (repeatable); default: config's")
    p.add_argument("--no-probe", action="store_true")
    p.add_argument("--no-finetune", action="store_true")
    p.add_argument("--no-lookup", action="store_true")
    add_output_flags(p)
    p.epilog = ("the run's eval section can be overridden after the other flags, e.g. a new fine-tuning protocol "
                "without retraining: --config.eval.finetune.lr_grid=[1e-4,1e-3,1e-2] "
                "--config.eval.finetune.from_init=true (results.json keeps both protocols' entries)")
    p.set_defaults(func=run, overrides=True)


def run(args) -> int:
    """Evaluate, append to results.json, print one row per checkpoint."""
    config = load_workdir_config(args.workdir)  # one line if DIR is not a run
    bad = [a for a in args.overrides if not a.startswith("--config.")]
    if bad:
        raise UserError(f"unrecognised argument {bad[0]!r} (see `flatlm evaluate --help`)")
    run_lib.validate(with_eval_overrides(config, args.overrides))  # a bad override fails here, before any work
    first = stacking.final_shape_from(stacking.stages_of(config))  # train.stacking: final-depth checkpoints only
    steps = parse_steps(args.steps, [s for s in ckpt.all_steps(args.workdir) if s >= first])
    entries = evaluate_run(args.workdir, steps, tuple(args.task), probe=not args.no_probe,
                           finetune_=False if args.no_finetune else None, lookup=False if args.no_lookup else None,
                           progress=not args.quiet, overrides=tuple(args.overrides))
    rows = table_rows(entries)
    if args.json:
        print_json({"workdir": args.workdir, "rows": rows,
                    "entries": [{k: v for k, v in e.items() if k != "detail"} for e in entries]})
        return 0
    cols = [("step", "step", "")] + [(k, k, ".4f") for k in ("loss", "entropy", "kl")]
    extra = sorted({k for r in rows for k in r if ":" in k})
    print_table(rows, cols + [(k, k + " %", "s") for k in extra])
    print(f"appended {len(entries)} results to {paths.path(args.workdir, 'results.json')}")
    return 0
