"""Plots of the Section 6 check: the training run from a random init against the constructed solutions, and the
Tr(H)-minimisation search against the closed-form minimum."""

from __future__ import annotations

from typing import Any

import numpy as np
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


def plot_search(search: dict[str, Any], stem: str) -> list[str]:
    """Three panels of the Tr(H)-minimisation search (`flatlm.theory.dyck_search`): Tr(H) / closed-form minimum per
    start; downstream loss against n per start (mean over downstream seeds) with the transferable reference; the
    fraction of (start at the bound, seed) pairs transferring with zero loss against n, with the exact probability
    and Theorem 6.1's 1 - 2^-n. Writes stem.png and stem.pdf; returns both paths."""
    rows, bound, tol = search["rows"], search["bound"], search["success_tol"]
    ns = [int(n) for n in search["config"]["ns"]]
    floor = 1e-16  # exact zeros drawn at the floor of the log axis
    fig = Figure(figsize=(14, 4.2), constrained_layout=True)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    order = sorted(rows, key=lambda r: r["trace"])
    for k, r in enumerate(order):
        ok = r["feasible"]
        ax1.plot(k, r["trace"] / bound, "o" if ok else "x", color="tab:green" if ok else "tab:gray")
    ax1.axhline(1.0, color="k", linestyle="--", linewidth=1, label="closed-form minimum 4/(m sqrt T)")
    ax1.set_xlabel("start (sorted by Tr(H))")
    ax1.set_ylabel("Tr(H) / minimum")
    ax1.set_title(f"found Tr(H) (x: not zero-loss), {search['n_feasible']}/{len(rows)} zero-loss")
    ax1.legend(fontsize=8)
    for r in rows:
        at = r["feasible"] and r["trace_gap"] <= 1e-3
        color = "tab:green" if at else ("tab:red" if r["feasible"] else "tab:gray")
        ax2.plot(ns, [max(r["downstream_mean"][str(n)], floor) for n in ns], color=color, alpha=0.5, marker=".")
    if search["reference"] is not None:
        ax2.plot(ns, [max(search["reference"]["downstream_mean"][str(n)], floor) for n in ns], "k--",
                 label="transferable (constructed)")
        ax2.legend(fontsize=8)
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("downstream samples n")
    ax2.set_ylabel("downstream loss (mean over seeds)")
    ax2.set_title("green: at the minimum, red: above, gray: not zero-loss")
    at_bound = [r for r in rows if r["feasible"] and r["trace_gap"] <= 1e-3]
    if at_bound:
        frac = [np.mean([v < tol for r in at_bound for v in r["downstream"][str(n)]]) for n in ns]
        ax3.plot(ns, frac, "o-", color="tab:green", label="found at the minimum")
    ax3.plot(ns, [search["success_probability"][str(n)] for n in ns], "k--", label="exact 1 - 2q^n + z^n")
    ax3.plot(ns, [search["theorem_success_probability"][str(n)] for n in ns], ":", color="tab:blue",
             label="Theorem 6.1: 1 - 2^-n")
    ax3.set_xscale("log", base=2)
    ax3.set_xlabel("downstream samples n")
    ax3.set_ylabel(f"P(downstream loss < {tol:g})")
    ax3.set_ylim(-0.02, 1.02)
    ax3.legend(fontsize=8)
    fig.suptitle(f"Dyck T={search['T']}, m={search['m']}: minimise Tr(H) subject to zero pre-training loss")
    paths = [f"{stem}.png", f"{stem}.pdf"]
    for path in paths:
        fig.savefig(path, dpi=100)
    return paths
