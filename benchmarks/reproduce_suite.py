"""Where the reproduction suite's time goes: wall time of each experiment of `flatlm reproduce` and each claim's
share, read from a finished (or partly finished) suite's `timings.json`, so speed work is aimed where it pays.

    .venv/bin/python benchmarks/reproduce_suite.py [--workdir runs/reproduce-cpu]

Running the suite itself is `make reproduce` (tens of minutes); this script only reads what it recorded and says
"not measured" for experiments it has not run yet.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import load_line  # noqa: E402

from flatlm import reproduce  # noqa: E402


def main() -> int:
    """Print one row per claim and experiment: minutes and share of the suite's total."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="runs/reproduce-cpu")
    p.add_argument("--preset", default="cpu")
    args = p.parse_args()
    timings = reproduce.load_timings(args.workdir)
    total = sum(timings.values())
    print(f"reproduction suite in {args.workdir}: {total / 60:.1f} min measured; machine now: {load_line()}")
    for cid, exps in reproduce.plan(args.preset).items():
        for name, language in exps:
            key = reproduce.experiment_dir(args.workdir, name, language).name
            if key in timings:
                print(f"  {cid} {key:32s} {timings[key] / 60:7.1f} min  {100 * timings[key] / total:5.1f}%")
            else:
                print(f"  {cid} {key:32s}  not measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
