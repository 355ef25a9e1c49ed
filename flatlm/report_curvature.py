"""The curvature parts of `flatlm report` (flatlm.report): what names a flatness estimator, and the sections for
per-block traces, the Hessian's spectrum and Adam's preconditioned sharpness."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flatlm import report_plots as plots
from flatlm import results as results_lib

ESTIMATOR_LABELS = {
    "exact": "Tr(H) exact",
    "hutchinson": "Tr(H) Hutchinson",
    "fisher": "Tr(F) Fisher, sampled labels",
    "hutchpp": "Tr(F) Fisher, Hutch++",
    "xtrace": "Tr(H) XTrace",
    "empirical_fisher": "Tr(empirical Fisher), true labels",
}


def _one_per_arm(named: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """The first run of each arm (`<arm>-seed<k>` runs share an arm; any other name is its own), in order."""
    first = {}
    for name, entry in named:
        first.setdefault(plots.method_name(name), (name, entry))
    return list(first.values())


def estimator_key(entry: dict) -> tuple:
    """(method, grown_to) of a flatness entry: what makes two traces comparable. A trace measured on another split
    than validation (`flatlm flatness --split train`) is another quantity: its method reads "<method>@<split>"."""
    grown = entry.get("grown_to")
    split = results_lib.split_of(entry)
    method = entry.get("method", "?") + ("" if split == "validation" else f"@{split}")
    return method, tuple(grown) if grown else None


def estimator_label(key: tuple) -> str:
    """A column / axis name for an estimator, e.g. "Tr(H) Hutchinson" or "Tr(F) Fisher, sampled labels (grown to
    4x256)"."""
    method, grown = key
    method, _, split = method.partition("@")
    label = ESTIMATOR_LABELS.get(method, f"trace ({method})") + (f", {split} objective" if split else "")
    return f"{label} (grown to {grown[0]}x{grown[1]})" if grown else label


def plot_name(stem: str, i: int) -> str:
    """The file stem of the i-th estimator's plot: `stem` for the first (the name earlier reports used)."""
    return stem if i == 0 else f"{stem}_{i + 1}"


def block_rows_over_seeds(rows: list[tuple[str, dict, dict]], runs) -> list[tuple[str, dict, dict]]:
    """Per-block rows (run, per_group, per_group_stderr) -> one row per method of `<name>-seed<k>` runs: the mean
    over its seeds, with the std over seeds as the error bar (one seed: its own rows, unchanged)."""
    by_run = {name: (pg, se) for name, pg, se in rows}
    out = []
    for method, members in plots.seed_groups(runs).items():
        have = [by_run[r.name] for r in members if r.name in by_run]
        if len(have) < 2:
            out += [(r.name, *by_run[r.name]) for r in members if r.name in by_run]
            continue
        blocks = list(have[0][0])
        vals = np.array([[pg.get(b, np.nan) for b in blocks] for pg, _ in have])
        out.append((f"{method} (mean of {len(have)} seeds)", dict(zip(blocks, np.nanmean(vals, 0).tolist())),
                    dict(zip(blocks, np.nanstd(vals, 0, ddof=1).tolist()))))
    return out


def sections(runs, ests: list[tuple], out_dir: Path) -> list[str]:
    """Markdown sections (plots saved into `out_dir`) for `runs` (flatlm.report.RunData) and their estimators."""
    md: list[str] = []
    # 4a'. per-block traces of each estimator's last checkpoint (`flatlm flatness --groups block`)
    for i, key in enumerate(ests):
        rows = [(r.name, e["detail"]["per_group"], e["detail"].get("per_group_stderr") or {})
                for r in runs for e in [r.flatness(key).get(max(r.flatness(key), default=None))]
                if e and len((e.get("detail") or {}).get("per_group") or {}) > 1]
        rows = block_rows_over_seeds(rows, runs)[:8]
        if rows:
            name = plot_name("trace_per_block", i)
            plots.save(plots.per_group_bars(rows, estimator_label(key)), out_dir / f"{name}.png")
            sums = "; ".join(f"{n}: {sum(p.values()):.4g}" for n, p, _ in rows)
            md.append(f"## {estimator_label(key)} per block\n\nSums over blocks (= the total): {sums}.\n\n"
                      f"![blocks]({name}.png) ([pdf]({name}.pdf))\n")

    # 4a''. the Hessian's spectrum at each run's last measured checkpoint (`flatlm flatness --spectrum-k/--density-*`)
    spec = [(r.name, r.by_kind("spectrum")[max(r.by_kind("spectrum"))]) for r in runs if r.by_kind("spectrum")]
    if spec:
        shown = _one_per_arm(spec) if len(spec) > 6 else spec
        plots.save(plots.spectrum_panels(shown[:6]), out_dir / "spectrum.png")  # every run listed, <= 6 plotted
        lines = [f"- {n} (step {e['step']}): top eigenvalues {', '.join(f'{v:.4g}' for v in e['top']['values'][:5])}"
                 if "top" in e else f"- {n} (step {e['step']})" for n, e in spec]
        lines = [ln + "".join(f"; Tr(H^{m['p']}) = {m['value']:.4g} ± {m['stderr'] or 0:.2g}"
                              for m in e.get("density", {}).get("moments", [])[:2]) for ln, (_, e) in zip(lines, spec)]
        panels = f" (plotted: {', '.join(n for n, _ in shown[:6])})" if len(spec) > 6 else ""
        md.append("## Hessian spectrum (Lanczos top eigenvalues ± Ritz bounds; SLQ density and moments)\n\n"
                  + "\n".join(lines) + f"\n\n![spectrum](spectrum.png) ([pdf](spectrum.pdf)){panels}\n")

    # 4a'''. AdamW runs' preconditioned sharpness against the edge of stability (`flatlm flatness --preconditioned`)
    sharp = [(r.name + ("" if sp == "validation" else f", {sp} objective"), e) for r in runs
             for sp in results_lib.SPLITS for _, e in sorted(r.by_kind("preconditioned_sharpness", sp).items())]
    if sharp:
        md.append("## Preconditioned sharpness (top eigenvalue of P^-1 H, P Adam's; edge of stability 2 (1 + b1) / "
                  "((1 - b1) lr))\n\n" + "\n".join(
                      f"- {n} (step {e['step']}): {e['value']:.4g} ± {e['residual']:.2g} at lr {e['lr']:.3g}; edge "
                      f"{e['edge_of_stability']:.4g}, ratio {e['ratio']:.3f}" for n, e in sharp[:30]) + "\n")
    return md
