"""`flatlm reproduce --preset cpu --workdir DIR`: run the experiments behind the paper's claims (resumably) and
write one report with a verdict per claim (see `flatlm.reproduce`, `flatlm.reproduce_run`)."""

from __future__ import annotations

import sys

from flatlm import reproduce, reproduce_report, reproduce_run
from flatlm.cli.common import add_output_flags, seed_list
from flatlm.experiment import seeds_flag
from flatlm.experiment_jobs import check_jobs
from flatlm.table import print_json, print_table


def add_parser(sub) -> None:
    """Register `reproduce`."""
    p = sub.add_parser("reproduce", help="the paper's claims C1-C5: experiments, effects with CIs, verdicts")
    p.add_argument("--preset", default=None,
                   help="experiment preset: cpu (laptop, converged), tiny (smoke), paper; default: the workdir's, "
                        "else cpu")
    p.add_argument("--workdir", required=True)
    p.add_argument("--claims", default="", help=f"comma-separated subset of {','.join(reproduce.SUITE)}")
    p.add_argument("--seeds", type=seed_list, default=(), metavar="K,K,...",
                   help="pre-training seeds of every experiment instead of the preset's (e.g. 0,1,2,3,4: narrower "
                        "intervals for more runs), in a new --workdir; a rerun on the workdir keeps its seeds")
    p.add_argument("--report-only", action="store_true",
                   help="no training: judge what the workdir holds (--preset / --seeds, when given, must be its own)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="train up to N runs at once, the runs of every experiment in one queue, longest first "
                        "(each in a `flatlm experiment --run` process; 2 on a 2-core laptop)")
    add_output_flags(p)
    p.set_defaults(func=run, overrides=False)


def run(args) -> int:
    """Run the suite (unless --report-only), then print the verdicts and write the report."""
    ids = tuple(c.strip().upper() for c in args.claims.split(",") if c.strip())
    reproduce_run.check_claims(ids)
    check_jobs(args.jobs)
    if args.report_only:
        preset = reproduce_run.check_report(args.workdir, args.preset, args.seeds, ids)
        timings = reproduce_run.load_timings(args.workdir)
    else:
        timings = reproduce_run.run_suite(args.preset, args.workdir, ids, progress=not args.quiet, jobs=args.jobs,
                                          seeds=args.seeds)
        preset = reproduce_run.load_preset(args.workdir)
    results = reproduce.evaluate_claims(args.workdir, ids, preset)
    for cid in sorted(set(ids or reproduce.SUITE) - {r.claim for r in results}):
        print(f"{cid}: not run in {args.workdir} (no {', '.join(reproduce_run.missing(args.workdir, cid, preset))}): "
              f"`flatlm reproduce --workdir {args.workdir} --claims {cid}` runs it", file=sys.stderr)
    seeds = reproduce_run.load_seeds(args.workdir)
    command = f"flatlm reproduce --preset {preset} --workdir {args.workdir}" + \
        (f" --claims {','.join(ids)}" if ids else "") + "".join(f" {a}" for a in seeds_flag(seeds)) + \
        (f" --jobs {args.jobs}" if args.jobs > 1 else "")
    path = reproduce_report.write_report(args.workdir, results, timings, command)
    rows = [{"claim": r.claim, "paper": r.figures, "verdict": r.verdict, "title": r.title} for r in results]
    if args.json:
        print_json({"workdir": args.workdir, "report": str(path), "claims": rows,
                    "minutes": reproduce_run.load_wall(args.workdir) / 60})
    else:
        print_table(rows, [("claim", "claim", "s"), ("paper", "paper", "s"), ("verdict", "verdict", "s"),
                           ("title", "claim", "s")])
        print(f"report: {path}")
    return 0
