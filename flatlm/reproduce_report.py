"""The reproduction report (`flatlm reproduce`): `<workdir>/report/reproduction.md`, one verdict per claim with its
effects, intervals and per-seed differences, the "same loss" checks, notes, the paper's values beside flatlm's,
and each experiment's figures."""

from __future__ import annotations

import os
import platform
import time

from flatlm import claims, paths
from flatlm.report import make_report
from flatlm.reproduce import ClaimResult, Finding
from flatlm.reproduce_paper import PAPER_VALUES
from flatlm.reproduce_run import load_wall


def _line(f: Finding) -> str:
    """The finding's effect, the paper's direction and the verdict; under it every seed's difference."""
    effect = "not measured" if f.effect is None else f.effect.describe(f.scale, f.unit)
    direction = "higher" if f.expected_sign > 0 else "lower"
    seeds = list(zip(f.effect.seeds, f.effect.differences, strict=True)) if f.effect and f.effect.seeds else []
    return (f"- {f.name}: {effect}; the paper: {direction}. **{f.verdict}**"
            + ("\n  - per seed: " + ", ".join(f"{s}: {f.scale * d:+.3g}" for s, d in seeds) if seeds else ""))


def write_report(workdir: str, results: list[ClaimResult], timings: dict, command: str) -> paths.Path:
    """`<workdir>/report/reproduction.md`: a verdict line per claim, its effects with CIs, every "same loss"
    check, notes, and per-experiment figures (`flatlm.report.make_report`) under `<workdir>/report/<exp>/`.
    `timings`: `load_timings`; the suite's wall time is read from the workdir (`load_wall`)."""
    out = paths.path(workdir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# flatlm reproduction\n\nCommand: `{command}`; {time.strftime('%Y-%m-%d %H:%M %Z')}; machine: "
          f"{platform.machine()}, {os.cpu_count()} CPU cores; wall time of the experiments: "
          f"{load_wall(workdir) / 60:.1f} min (each, from its first run's start to its last one's end: "
          f"{', '.join(f'{k} {v / 60:.1f}' for k, v in sorted(timings.items()))}).\n",
          f'"Same loss": every compared model has exact KL <= {claims.MAX_KL} nats and compared exact losses differ '
          f"by less than max({claims.MIN_LOSS_GAP} nats, 2 x the larger 5-subset std); against the lookup table "
          f"(the optimal loss, C5) the model's KL <= {claims.MAX_KL} alone. Effects are per-seed "
          f"differences with a {int(claims.CONFIDENCE * 100)}% t-interval; a claim is reproduced when every "
          "interval lies on the paper's side, not reproduced when one lies on the other side, otherwise "
          "inconclusive (also whenever a compared pair is not at the same loss).\n",
          "| claim | paper | verdict |", "|---|---|---|"]
    md += [f"| {r.claim}: {r.title} | {r.figures} | **{r.verdict}** |" for r in results]
    for r in results:
        md.append(f"\n## {r.claim} ({r.figures}): {r.title} -- {r.verdict}\n")
        md += ["The paper:"] + [f"- {v}" for v in PAPER_VALUES.get(r.claim, ["not given"])] + ["", "flatlm:"]
        md += [_line(f) for f in r.findings] or ["- no effect could be measured"]
        md += ["", "Same-loss checks:"] + [f"- {name}: {c.describe()}" for name, c in r.same_loss]
        md += ["", "Notes:"] + [f"- {n}" for n in r.notes] if r.notes else []
    for name in sorted(timings):
        exp = paths.path(workdir) / name
        if exp.exists():
            make_report([str(exp)], str(out / name))
            md.append(f"\n## Figures: {name}\n\n[report]({name}/report.md)\n")
            md += [f"![{p.stem}]({name}/{p.name})" for p in sorted((out / name).glob("*.png"))]
    path = out / "reproduction.md"
    paths.write_text(path, "\n".join(md) + "\n")
    return path
