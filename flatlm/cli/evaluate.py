"""`flatlm evaluate --workdir DIR`: exact loss, linear probe and fine-tuning of a run's checkpoints (or of every run of
the experiment in DIR)."""

from __future__ import annotations

from flatlm import checkpoint as ckpt
from flatlm import paths
from flatlm import run as run_lib
from flatlm.cli.common import add_output_flags, parse_steps
from flatlm.config import load_workdir_config, run_dirs
from flatlm.errors import UserError
from flatlm.evaluate.runner import evaluate_run, table_rows, with_eval_overrides
from flatlm.models import stacking
from flatlm.table import print_json, print_table


def add_parser(sub) -> None:
    """Register `evaluate`."""
    p = sub.add_parser("evaluate", help="exact loss, linear probe and fine-tuning of a run's checkpoints")
    p.add_argument("--workdir", required=True, help="a run's folder, or an experiment's (then every run in it)")
    p.add_argument("--steps", default="all", help="all | last | none (only the lookup tables) | comma-separated steps")
    p.add_argument("--task", action="append", default=[], help="a downstream task (repeatable); default: config's")
    p.add_argument("--no-exact", action="store_true", help="skip the exact pre-training loss")
    p.add_argument("--no-probe", action="store_true",
                   help="skip the last layer's linear probe (the paper's; eval.probe.layers still run)")
    p.add_argument("--no-finetune", action="store_true")
    p.add_argument("--no-lookup", action="store_true")
    add_output_flags(p)
    p.epilog = ("the run's eval section can be overridden after the other flags, e.g. a new fine-tuning protocol "
                "without retraining: --config.eval.finetune.lr_grid=[1e-4,1e-3,1e-2] "
                "--config.eval.finetune.from_init=true (results.json keeps both protocols' entries)")
    p.set_defaults(func=run, overrides=True)


def run(args) -> int:
    """Evaluate the run (or every run of the experiment) in --workdir, append to results.json, print one row per
    checkpoint. Every run's config, overrides and steps are checked before any is evaluated."""
    bad = [a for a in args.overrides if not a.startswith("--config.")]
    if bad:
        raise UserError(f"unrecognised argument {bad[0]!r} (see `flatlm evaluate --help`)")
    dirs = [str(d) for d in run_dirs(args.workdir)]
    if not dirs:
        load_workdir_config(args.workdir)  # says in one line that DIR is not a run
    plans = []
    for d in dirs:
        config = load_workdir_config(d)
        run_lib.validate(with_eval_overrides(config, args.overrides))  # a bad override fails here, before any work
        first = stacking.final_shape_from(stacking.stages_of(config))  # train.stacking: final-depth checkpoints
        plans.append((d, parse_steps(args.steps, [s for s in ckpt.all_steps(d) if s >= first])))
    out = {}
    for d, steps in plans:
        if len(plans) > 1 and not args.json:
            print(f"== {paths.path(d).name}", flush=True)
        entries = evaluate_run(d, steps, tuple(args.task), probe=not args.no_probe, exact=not args.no_exact,
                               finetune_=False if args.no_finetune else None,
                               lookup=False if args.no_lookup else None, progress=not args.quiet,
                               overrides=tuple(args.overrides))
        run_lib.release_compiled()  # an experiment's runs one after the other: drop each run's programs
        rows = table_rows(entries)
        out[paths.path(d).name] = {"rows": rows, "entries": [{k: v for k, v in e.items() if k != "detail"}
                                                             for e in entries]}
        if not args.json:
            cols = [("step", "step", "")] + [(k, k, ".4f") for k in ("loss", "entropy", "kl")]
            extra = sorted({k for r in rows for k in r if ":" in k})
            print_table(rows, cols + [(k, k + " %", "s") for k in extra])
            print(f"appended {len(entries)} results to {paths.path(d, 'results.json')}")
    if args.json:  # one run: {"workdir", "rows", "entries"}; an experiment: {"workdir", "runs": {name: ...}}
        single = (paths.path(args.workdir) / "config.json").exists()
        print_json({"workdir": args.workdir, **(next(iter(out.values())) if single else {"runs": out})})
    return 0
