"""`flatlm experiment --config configs/experiments/NAME.py[:PRESET] --workdir DIR`: a whole paper experiment."""

from __future__ import annotations

from flatlm.cli.common import add_config_and_workdir, add_output_flags, apply_overrides
from flatlm.experiment import load_experiment, run_experiment
from flatlm.table import print_json, print_table


def add_parser(sub) -> None:
    """Register `experiment`."""
    p = sub.add_parser("experiment", help="run a whole paper experiment (train, evaluate, flatness), resumably")
    add_config_and_workdir(p, "configs/experiments/NAME.py[:PRESET]")
    add_output_flags(p)
    p.set_defaults(func=run, overrides=True)


def run(args) -> int:
    """Run (or resume) every run of the experiment; print each run's status."""
    exp = apply_overrides(load_experiment(args.config), args.overrides, hint="--config.base.train.steps=200")
    status = run_experiment(exp, args.workdir, progress=not args.quiet)
    if args.json:
        print_json({"workdir": args.workdir, "runs": status})
    else:
        print_table([{"run": k, "status": v} for k, v in status.items()], [("run", "run", "s"),
                                                                         ("status", "status", "s")])
        print(f"report: flatlm report {args.workdir}")
    return 0
