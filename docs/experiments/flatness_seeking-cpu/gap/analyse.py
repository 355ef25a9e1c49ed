"""Tr(H) - Tr(F) at the last checkpoint of each flatness_seeking.py:cpu run (seeds 0-2), as pre-registered in
plan.md; reads the `flatlm flatness --gap --json` outputs beside this file. The per-run error is recomputed with the
floor that `estimates.paired_difference` gained after these were measured (the probes' error of the difference)."""

import glob
import json
import math
import os
import re

import numpy as np
from scipy import stats

HERE = os.path.dirname(os.path.abspath(__file__))
rows = []
for f in sorted(glob.glob(os.path.join(HERE, "*-seed*.json"))):
    name = os.path.basename(f)[:-5]
    r = json.load(open(f))["results"][0]
    h, F = r["hessian"], r["fisher"]
    se = max(r["hessian_minus_fisher_stderr"], math.hypot(h["probe_stderr"], F["probe_stderr"]))
    z = r["hessian_minus_fisher"] / se
    rows.append(dict(run=name, arm=re.sub(r"-seed\d+$", "", name), loss=r["loss"], h=h["mean"], se_h=h["stderr"],
                     f=F["mean"], se_f=F["stderr"], gap=r["hessian_minus_fisher"], se=se, z=z, batches=r["num_batches"],
                     p=2 * stats.t.sf(abs(z), r["num_batches"] - 1)))
print("| run | MLM loss (nats) | Tr(H), Hutchinson | Tr(F) | H - F | its se (paired) | z | p (t, 1 dof) |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['run']} | {r['loss']:.4f} | {r['h']:.2f} ± {r['se_h']:.2f} | {r['f']:.2f} ± {r['se_f']:.2f} | "
          f"{r['gap']:+.2f} | {r['se']:.2f} | {r['z']:+.1f} | {r['p']:.2f} |")
print()
print("| arm | mean H - F over 3 seeds [95 % t-interval] | mean (H - F) / Tr(F) |")
print("|---|---|---|")
for arm in dict.fromkeys(r["arm"] for r in rows):
    g = np.array([r["gap"] for r in rows if r["arm"] == arm])
    rel = np.array([r["gap"] / r["f"] for r in rows if r["arm"] == arm])
    m, s = g.mean(), g.std(ddof=1) / math.sqrt(len(g))
    q = stats.t.ppf(0.975, len(g) - 1)
    print(f"| {arm} | {m:+.2f} [{m - q * s:+.2f}, {m + q * s:+.2f}] | {rel.mean():+.3f} |")
g = np.array([r["gap"] for r in rows])
m, s = g.mean(), g.std(ddof=1) / math.sqrt(len(g))
q = stats.t.ppf(0.975, len(g) - 1)
print(f"\nall 12 runs (exploratory): {m:+.2f} [{m - q * s:+.2f}, {m + q * s:+.2f}], positive in {(g > 0).sum()} of 12")
