"""Exploratory, not pre-registered: Spearman's rho of each curvature figure against the probe accuracy over every
run of the given experiment workdirs (last checkpoint), with a paired percentile bootstrap 95 % interval.

    python docs/experiments/flatness_seeking-cpu/curvature/spearman.py WORKDIR [WORKDIR ...]
"""

import json
import sys
from pathlib import Path

import numpy as np
from scipy import stats


def figures(run: Path) -> tuple[float, ...]:
    """(probe, Tr(F), top eigenvalue, Tr(H^2), P^-1 H top) at the run's last measured checkpoint."""
    res = json.loads((run / "results.json").read_text())["results"]
    step = max(e["step"] for e in res if e["kind"] == "exact_loss")
    last = {e["kind"]: e for e in res if e.get("step") == step}  # the latest entry of each kind at that step
    moments = {m["p"]: m["value"] for m in last["spectrum"]["density"]["moments"]}
    return (last["probe"]["accuracy"], last["flatness"]["trace"], last["spectrum"]["top"]["values"][0], moments[2],
            last["preconditioned_sharpness"]["value"])


def main(workdirs: list[str]) -> None:
    table = np.array([figures(run) for wd in workdirs for run in sorted(Path(wd, "runs").iterdir())])
    for j, name in enumerate(["Tr(F)", "top eigenvalue", "Tr(H^2)", "P^-1 H top (Adam)"], start=1):
        rho = stats.spearmanr(table[:, j], table[:, 0]).statistic
        ci = stats.bootstrap((table[:, j], table[:, 0]), lambda x, y: stats.spearmanr(x, y).statistic, paired=True,
                             vectorized=False, n_resamples=2000, random_state=0, method="percentile")
        low, high = ci.confidence_interval
        print(f"{name}: rho {rho:+.3f} [{low:+.3f}, {high:+.3f}] over {len(table)} runs")


if __name__ == "__main__":
    main(sys.argv[1:])
