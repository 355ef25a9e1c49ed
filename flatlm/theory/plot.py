"""Plots of the Section 6 check: the training run from a random init against the constructed solutions."""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure  # no pyplot: no global backend or figure state


def plot_training(results: dict[str, Any], path: str) -> str:
    """2x2 panels over steps (pre-training loss, Tr(H), alignment with +-1_T, downstream loss); returns path."""
    runs = list(results["training"].values())
    exact = all(v is not None for run in runs for v in run["history"]["trace"])
    trace_key, trace_title = ("trace", "Tr(H)") if exact else ("trace_gauss_newton", "Tr(H), Gauss-Newton part")
    panels = [("pretrain_loss", "pre-training loss", True), (trace_key, trace_title, True),
              ("alignment", "|cos(v_i, 1_T)| (weighted)", False), ("downstream_loss", "downstream loss", True)]
    refs = {name: [r for r in results["solutions"] if r["solution"] == name]
            for name in ("transferable", "random_features")}
    fig = Figure(figsize=(10, 7), constrained_layout=True)
    axes = fig.subplots(2, 2)
    for ax, (key, title, log) in zip(axes.flat, panels):
        log = log and all(v > 0 for run in runs for v in run["history"][key])
        for run in runs:
            label = "SGD" if run["penalty"] == 0 else f"SGD + {run['penalty']:g} Tr(H)"
            ax.plot(run["history"]["step"], run["history"][key], label=label)
        for name, color, style in (("transferable", "k", "--"), ("random_features", "r", ":")):
            vals = [r[key] for r in refs[name] if r.get(key) is not None]
            mean = sum(vals) / len(vals) if vals else None
            if mean is not None and (mean > 1e-12 or not log):  # exact zeros have no place on a log axis
                ax.axhline(mean, color=color, linestyle=style, linewidth=1, label=name.replace("_", " "))
        ax.set_title(title)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
    axes.flat[1].legend(fontsize=8)
    fig.suptitle(f"Dyck T={results['T']}, m={results['m']}: training from random init")
    fig.savefig(path, dpi=100)
    return path
