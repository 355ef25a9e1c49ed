"""The figures of `flatlm report` (flatlm.report): each written as PNG and PDF, with error bars wherever a standard
deviation or error was measured, and runs that differ only by pre-training seed (`<name>-seed<k>`) drawn as one
line, the mean ± std over seeds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure  # no pyplot: no global backend or figure state
from matplotlib.ticker import NullFormatter

from flatlm.claims import t_half_width
from flatlm.config import SEED_SUFFIX
from flatlm.flatness.spectrum import Density

FORMATS = ("png", "pdf")


def subplots(ncols: int = 1, figsize=(5.5, 4)):
    """A pyplot-free figure and its axes (a 1-D array when ncols > 1, else one Axes)."""
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(1, ncols)


def save(fig, path_png: Path) -> None:
    """Write `fig` as `path_png` and the same name with .pdf."""
    fig.tight_layout()
    for fmt in FORMATS:
        fig.savefig(Path(path_png).with_suffix(f".{fmt}"), dpi=110)


def split_seed(run_name: str) -> tuple[str, int | None]:
    """(method, pre-training seed) of a run named `<method>-seed<k>`; (the name, None) without the suffix."""
    m = SEED_SUFFIX.match(run_name)
    return (m.group(1), int(m.group(2))) if m else (run_name, None)


def method_name(run_name: str) -> str:
    """The run's name without its `-seed<k>` suffix: the method (configuration) it is a seed of."""
    return split_seed(run_name)[0]


def by_seed(runs) -> dict[str, dict[int, object]]:
    """{method: {seed: run}} in the runs' order; a run without a seed suffix is seed 0 of its own method."""
    out: dict[str, dict[int, object]] = {}
    for r in runs:
        name, seed = split_seed(r.name)
        out.setdefault(name, {})[seed or 0] = r
    return out


def loss_vs_steps(runs) -> Figure:
    """Exact loss ± its std over evaluation subsets, and ln KL ± the std of ln KL to first order (kl_std / kl)."""
    fig, (a, b) = subplots(2, figsize=(11, 4))
    for r in runs:
        ev = [m for m in r.evals if isinstance(m.get("eval/loss"), float)]
        s = [m["step"] for m in ev]
        a.errorbar(s, [m["eval/loss"] for m in ev], [m.get("eval/loss_std", 0.0) for m in ev], fmt="o-", ms=3,
                   capsize=2, label=r.name)
        kl = np.array([m["eval/kl"] if isinstance(m.get("eval/kl"), float) else np.nan for m in ev])
        kl_std = np.array([m.get("eval/kl_std", 0.0) if isinstance(m.get("eval/kl_std"), float) else 0.0 for m in ev])
        with np.errstate(divide="ignore", invalid="ignore"):
            b.errorbar(s, np.log(kl), np.where(kl > 0, kl_std / kl, np.nan), fmt="o-", ms=3, capsize=2, label=r.name)
    if runs and runs[0].evals:
        a.axhline(runs[0].evals[-1]["eval/entropy"], color="k", ls="--", lw=1, label="entropy (optimum)")
    a.set(xlabel="step", ylabel="exact pre-training loss (nats)", title="loss = entropy + KL")
    b.set(xlabel="step", ylabel="ln KL (natural log, KL in nats)", title="ln KL(true || model)")
    a.legend(fontsize=7)
    return fig


def seed_groups(runs) -> dict[str, list]:
    """{method name: its runs}, in the runs' order."""
    groups: dict[str, list] = {}
    for r in runs:
        groups.setdefault(method_name(r.name), []).append(r)
    return groups


def mean_std_over_seeds(members, task: str) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(steps, mean, std) of probe accuracy per step over the runs `members` (seeds of one method) that have it;
    std over seeds (ddof 1) where 2 or more have the step, else that run's std over probe seeds."""
    per_step: dict[int, list[tuple[float, float]]] = {}
    for r in members:
        for step, e in r.probe(task).items():
            per_step.setdefault(step, []).append((e["accuracy"], e.get("accuracy_std", 0.0)))
    steps = sorted(per_step)
    mean = np.array([np.mean([a for a, _ in per_step[s]]) for s in steps])
    std = np.array([np.std([a for a, _ in per_step[s]], ddof=1) if len(per_step[s]) > 1 else per_step[s][0][1]
                    for s in steps])
    return steps, mean, std


# (results kind, name, line style) of the once-per-run baselines: the probe on the exact conditionals (the paper's
# lookup table) and on the conditionals with the one-hot words appended (`eval.lookup_words`, C5's control)
LOOKUPS = (("lookup_table", "lookup table", ":"), ("lookup_words", "lookup table + words", "-."))


def lookup_accuracies(runs, task: str, kind: str = "lookup_table") -> list[float]:
    """The lookup-table probe accuracy on `task` of every run that has one (each run's last entry); `kind`
    "lookup_words": the table with the words appended (`eval.lookup_words`)."""
    out = []
    for r in runs:
        look = [e for e in r.results if e["kind"] == kind and e.get("task") == task]
        if look:
            out.append(float(look[-1]["accuracy"]))
    return out


def accuracy_vs_steps(runs, tasks: list[str]) -> Figure:
    """Probe accuracy vs steps, one line per method (mean ± std over its pre-training seeds), per task."""
    fig, axes = subplots(len(tasks), figsize=(5 * len(tasks), 3.8))
    for ax, t in zip(np.atleast_1d(axes), tasks):
        for name, members in seed_groups(runs).items():
            steps, mean, std = mean_std_over_seeds(members, t)
            if steps:
                label = f"{name} ({len(members)} seeds)" if len(members) > 1 else name
                ax.errorbar(steps, 100 * mean, 100 * std, fmt="o-", ms=3, capsize=2, label=label)
        for kind, name, ls in LOOKUPS:  # one probe per run (its own probe seeds): their mean, range in the label
            look = lookup_accuracies(runs, t, kind)
            if look:
                spread = f" (mean of {len(look)}: {100 * min(look):.1f}-{100 * max(look):.1f})" if len(look) > 1 else ""
                ax.axhline(100 * np.mean(look), color="k", ls=ls, label=name + spread)
        ax.set(xlabel="step", ylabel="probe accuracy (%), mean ± std", title=f"task {t}")
        if ax.get_legend_handles_labels()[0]:  # runs without probe results draw nothing to label
            ax.legend(fontsize=7)
    return fig


def _params_label(n: int) -> str:
    return f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n / 1e3:.3g}k" if n >= 1e3 else str(n)


def accuracy_vs_size(sized, tasks: list[str]) -> Figure:
    """Final probe accuracy vs parameter count (log axis ticked at the measured sizes only, labels rotated:
    matplotlib's minor log ticks overlapped within a decade). A run of its own: accuracy ± its std over probe seeds,
    labelled with its exact loss. Runs repeated over pre-training seeds (`<arm>-seed<k>`): each seed a faint dot,
    the arm's mean with its 95 % t-interval over seeds, labelled with the arm and its mean exact loss; the line
    joins the arms' means in order of size."""
    fig, ax = subplots()
    arms = by_seed(sized)
    for t in tasks:
        pts = []  # (size, accuracy %, half-width, label) per arm
        for arm, members in arms.items():
            done = [r for r in members.values() if r.probe(t)]
            if not done:
                continue
            finals = [r.probe(t)[max(r.probe(t))] for r in done]
            acc = np.array([100 * e["accuracy"] for e in finals])
            losses = [r.evals[-1]["eval/loss"] for r in done if r.evals]
            loss = f"L={np.mean(losses):.3f}" if losses else ""
            if len(done) == 1:
                pts.append((done[0].num_params, acc[0], 100 * finals[0].get("accuracy_std", 0.0), loss))
                continue
            half = t_half_width(acc)  # flatlm.claims' interval, as the paired tables use
            ax.scatter([done[0].num_params] * len(acc), acc, s=9, alpha=0.3, color="grey", zorder=1)
            pts.append((done[0].num_params, acc.mean(), half, f"{arm} ({len(acc)} seeds) {loss}"))
        pts.sort(key=lambda p: p[0])  # arms of one size tie on the size: never compare the rest
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts], fmt="o-", capsize=3, zorder=2,
                    label=f"task {t}")
        for size, acc, _, label in pts:
            ax.annotate(label, (size, acc), fontsize=7, xytext=(4, 4), textcoords="offset points")
    sizes = sorted({r.num_params for r in sized})
    ax.set(xscale="log", xlabel="parameters", ylabel="probe accuracy (%)", title="accuracy vs size")
    ax.set_xticks(sizes, [_params_label(n) for n in sizes], rotation=45, ha="right", fontsize=8)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize=7)
    return fig


def rank_vs_steps(runs) -> Figure:
    """Per run (<= 6 panels), the numerical rank of W - W0 of every weight matrix against the step."""
    fig, axes = subplots(len(runs), figsize=(5 * len(runs), 4))
    for ax, r in zip(np.atleast_1d(axes), runs, strict=True):
        rows = r.extra["ranks"]
        names = sorted({k[len("rank/"):] for m in rows for k in m if k.startswith("rank/")})
        for name in names:
            pts = [(m["step"], m[f"rank/{name}"]) for m in rows if f"rank/{name}" in m]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=name)
        ax.set(xlabel="step", ylabel="numerical rank of W - W0", title=r.name)
        ax.legend(fontsize=6)
    return fig


def tick_labels_overlap(fig: Figure, axis: str = "x") -> bool:
    """Whether any two visible tick labels of an axes of `fig` overlap once drawn (used by the tests)."""
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    for ax in fig.axes:
        labels = [lab for lab in getattr(ax, f"get_{axis}ticklabels")(minor=False) + getattr(
            ax, f"get_{axis}ticklabels")(minor=True) if lab.get_visible() and lab.get_text()]
        boxes = [lab.get_window_extent(renderer) for lab in labels]
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                if boxes[i].overlaps(boxes[j]):
                    return True
    return False


def per_group_bars(rows: list[tuple[str, dict, dict]], ylabel: str) -> Figure:
    """Per-block (per-group) traces as grouped bars ± their standard errors: one bar per run in `rows` (run name,
    {group: trace}, {group: stderr}) at every group, groups in first-seen order (at most 6 runs). A log scale when
    every trace is positive and they span more than 100x, so small blocks stay visible."""
    groups = list(dict.fromkeys(g for _, per, _ in rows for g in per))
    fig, ax = subplots(figsize=(max(5.5, 0.6 * len(groups) * max(1, len(rows)) + 2), 4))
    width = 0.8 / max(1, len(rows))
    x = np.arange(len(groups))
    for i, (name, per, se) in enumerate(rows):
        vals = [per.get(g, np.nan) for g in groups]
        errs = [se.get(g) or 0.0 for g in groups]
        ax.bar(x + (i - (len(rows) - 1) / 2) * width, vals, width, yerr=errs, capsize=2, label=name)
    ax.set_xticks(x, groups, rotation=45, ha="right", fontsize=8)
    finite = np.array([v for _, per, _ in rows for v in per.values() if np.isfinite(v)])
    if finite.size and finite.min() > 0 and finite.max() > 100 * finite.min():  # e.g. a head 100x the encoder's
        ax.set_yscale("log")
    else:
        ax.axhline(0.0, color="k", lw=0.5)
    ax.set(ylabel=ylabel, title="per-block traces (last checkpoint; ± standard error, or std over seeds for a mean)")
    ax.legend(fontsize=7)
    return fig


def spectrum_panels(rows: list[tuple[str, dict]]) -> Figure:
    """Per run (name, its "spectrum" results entry): left, the SLQ density of the Hessian's eigenvalues (log
    scale, Gaussian-smoothed nodes, `Density.curve`); right, the top eigenvalues in order, ± their Ritz bounds."""
    fig, (a, b) = subplots(2, figsize=(11, 4))
    for name, e in rows:
        d = e.get("density")
        if d:
            dens = Density(np.asarray(d["nodes"]), np.asarray(d["weights"]), int(d["dim"]))
            lo, hi = float(dens.nodes.min()), float(dens.nodes.max())
            pad = 0.05 * (hi - lo or 1.0)
            grid = np.linspace(lo - pad, hi + pad, 2000)
            tr = d["moments"][0]["value"] if d.get("moments") else float("nan")
            a.plot(grid, np.maximum(dens.curve(grid), 1e-12), label=f"{name} (SLQ Tr(H) = {tr:.4g})")
        top = e.get("top")
        if top:
            b.errorbar(np.arange(1, len(top["values"]) + 1), top["values"], top["residual"], fmt="o", ms=3,
                       capsize=2, label=name)
    a.set(yscale="log", xlabel="eigenvalue of H", ylabel="spectral density", title="Hessian spectrum (SLQ)")
    b.set(xlabel="index (largest first)", ylabel="eigenvalue of H (± Ritz bound)", title="top eigenvalues (Lanczos)")
    for ax in (a, b):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return fig
