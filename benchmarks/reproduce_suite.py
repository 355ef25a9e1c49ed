"""Where the reproduction suite's time goes: wall time of `flatlm reproduce` and of each experiment and claim,
read from a finished (or partly finished) suite's `suite.json` and `timings.json`, and within the experiments the phases
(training, exact loss while training, exact loss / probe features + probe / fine-tuning / lookup table after it,
Tr(H) and spectra), read from each run's DONE marker, metrics.jsonl (`time/exact_loss_s`) and the `seconds` of
its results.json entries, so speed work is aimed where it pays. Goal (issue 17): the cpu suite < 60 min.

    .venv/bin/python benchmarks/reproduce_suite.py [--workdir runs/reproduce-cpu]

Running the suite itself is `make reproduce` (tens of minutes); this script only reads what it recorded and says
"not measured" for experiments it has not run yet.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import load_line  # noqa: E402

from flatlm import reproduce_run  # noqa: E402
from flatlm import results as results_lib  # noqa: E402

PHASES = ("training", "exact loss (training)", "exact_loss", "probe", "finetune", "lookup_table", "flatness",
          "spectrum", "other")


def phase_times(exp_dir: Path) -> Counter:
    """Seconds per phase summed over an experiment's finished runs (runs without a DONE marker are skipped)."""
    total = Counter()
    for run in sorted(exp_dir.glob("runs/*")):
        done = run / "DONE"
        if not done.exists():
            continue
        seconds = json.loads(done.read_text() or "{}").get("seconds", 0.0)
        metrics = run / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        during = sum(r.get("time/exact_loss_s", 0.0) for r in rows)
        after = Counter()
        for e in results_lib.load(str(run)):
            if "seconds" in e:
                after[e["kind"] if e["kind"] in PHASES else "other"] += e["seconds"]
        total["exact loss (training)"] += during
        total["training"] += max(seconds - during - sum(after.values()), 0.0)
        total.update(after)
    return total


def main() -> int:
    """Print one row per claim and experiment: minutes and share of the suite's total."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="runs/reproduce-cpu")
    p.add_argument("--preset", default=None, help="the suite's preset (default: the one the workdir records)")
    args = p.parse_args()
    timings = reproduce_run.load_timings(args.workdir)
    total = reproduce_run.load_wall(args.workdir)
    preset = args.preset or reproduce_run.load_preset(args.workdir)
    print(f"reproduction suite in {args.workdir}: {total / 60:.1f} min of wall measured; machine now: {load_line()}")
    print("per experiment, from its first run's start to its last one's end, and as a share of the wall time (with "
          "--jobs the experiments overlap: the shares add up to more than 100%):")
    for cid, exps in reproduce_run.plan(preset).items():
        for name, language in exps:
            key = reproduce_run.experiment_dir(args.workdir, name, language).name
            if key in timings:
                print(f"  {cid} {key:32s} {timings[key] / 60:7.1f} min  {100 * timings[key] / total:5.1f}%")
            else:
                print(f"  {cid} {key:32s}  not measured")
    phases = Counter()
    for d in sorted(Path(args.workdir).glob("*")):
        if d.is_dir():
            phases.update(phase_times(d))
    measured = sum(phases.values())
    if measured:
        print(f"phases over the finished runs ({measured / 60:.1f} min; runs made before flatlm recorded phase "
              "times count as training):")
        for name, sec in phases.most_common():
            print(f"  {name:24s} {sec / 60:7.1f} min  {100 * sec / measured:5.1f}%")
    print(f"goal: the cpu suite < 60 min: {'met' if 0 < total < 3600 else 'MISSED' if total else 'not measured'}"
          f" ({total / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
