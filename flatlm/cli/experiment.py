"""`flatlm experiment --config configs/experiments/NAME.py[:PRESET] --workdir DIR [--run NAME]`: a whole paper
experiment, or one of its runs (with its evaluation and flatness); `--list` prints the run names."""

from __future__ import annotations

from flatlm.cli.common import OVERRIDES_HELP, add_output_flags, apply_overrides, seed_list
from flatlm.errors import UserError
from flatlm.experiment import load_experiment, run_experiment, seeds_flag, select_runs, with_seeds
from flatlm.experiment_jobs import check_jobs
from flatlm.table import print_json, print_table


def add_parser(sub) -> None:
    """Register `experiment`."""
    p = sub.add_parser("experiment", help="run a whole paper experiment (train, evaluate, flatness), resumably",
                       epilog=OVERRIDES_HELP.replace("--config.train.steps", "--config.base.train.steps"))
    p.add_argument("--config", required=True, help="configs/experiments/NAME.py[:PRESET]: an experiment file and "
                   "an optional preset after the colon (tiny, cpu, paper; ',hmm' or ',pcfg' picks the language)")
    p.add_argument("--workdir", help="the experiment's folder (local or gs://bucket/...); required unless --list")
    p.add_argument("--list", action="store_true", help="print the experiment's run names, one per line, and exit")
    p.add_argument("--seeds", type=seed_list, default=(), metavar="K,K,...",
                   help="repeat the experiment's seed-repeated runs over these pre-training seeds instead of the "
                        "preset's (e.g. 3,4,5 for more seeds in a new --workdir; `flatlm report OLD NEW` pairs all)")
    p.add_argument("--run", action="append", default=[], metavar="NAME",
                   help="run only this run (repeatable), with its evaluation and flatness: one job per run")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="train up to N runs at once, each in a process of its own (default 1; 2 on a 2-core "
                        "laptop: a cpu-preset run keeps about 1.3 cores busy); output per run in runs/NAME/"
                        "experiment.log")
    add_output_flags(p)
    p.set_defaults(func=run, overrides=True)


def run(args) -> int:
    """List the runs, or run (or resume) every run of the experiment (or the --run ones); print each status."""
    exp = apply_overrides(load_experiment(args.config), args.overrides, hint="--config.base.train.steps=200")
    if args.seeds:
        exp = with_seeds(exp, args.seeds)
    if args.list:
        names = [r["name"] for r in select_runs(exp, tuple(args.run))]
        if args.json:
            print_json({"experiment": exp.name, "runs": names})
        else:
            print("\n".join(names))
        return 0
    if not args.workdir:
        raise UserError("--workdir is required (except with --list)")
    check_jobs(args.jobs)
    child_args = ["--config", args.config, *seeds_flag(args.seeds), *args.overrides]
    status = run_experiment(exp, args.workdir, progress=not args.quiet, only=tuple(args.run), jobs=args.jobs,
                            child_args=tuple(child_args))
    if args.json:
        print_json({"workdir": args.workdir, "runs": status})
    else:
        print_table([{"run": k, "status": v} for k, v in status.items()], [("run", "run", "s"),
                                                                         ("status", "status", "s")])
        print(f"report: flatlm report {args.workdir}")
    return 0
