"""`flatlm theory dyck`: the numerical check of Theorem 6.1, as a table, a JSON object and a PNG of the training run.

Registered by `flatlm.cli` through `add_parser(subparsers)`; all the work is in `flatlm.theory.dyck.run_check`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from flatlm.errors import UserError

PLOT_NAME = "dyck_training.png"
RESULTS_NAME = "results.json"

COLUMNS = [  # (key, header, format)
    ("solution", "solution", ""),
    ("seed", "seed", "d"),
    ("pretrain_loss", "pre-train loss", ".2e"),
    ("trace", "Tr(H)", ".4g"),
    ("trace_hutchinson_str", "Tr(H) Hutchinson", ""),
    ("downstream_loss", "downstream loss", ".3e"),
    ("alignment", "|cos(v, 1_T)|", ".3f"),
]


def add_parser(subparsers) -> None:
    """Register `theory` with its sub-verb `dyck`."""
    p = subparsers.add_parser("theory", help="numerical checks of the paper's theory (Section 6: Dyck)")
    sub = p.add_subparsers(dest="theory_verb", metavar="{dyck}", required=True)
    d = sub.add_parser("dyck", help="Theorem 6.1: the flattest zero-loss transformer transfers; random features don't",
                       description="Both constructed zero-loss solutions (transferable +-1_T neurons; random "
                       "features), their exact Tr(H) and downstream loss, and SGD runs with and without a Tr(H) "
                       "penalty from a random init.")
    d.add_argument("--T", type=int, default=6, help="string length, even (default 6)")
    d.add_argument("--m", type=int, default=0, help="width (number of neurons), even and >= 4T (default 4T)")
    d.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="seeds for random features and downstream samples (default 0 1 2; training uses the first)")
    d.add_argument("--steps", type=int, default=3000, help="SGD steps per training run; 0 skips training")
    d.add_argument("--n-downstream", type=int, default=16, help="downstream samples the head is fitted on")
    d.add_argument("--samples", type=int, default=0,
                   help="Monte-Carlo samples instead of exact enumeration (needed for T > 14)")
    d.add_argument("--lr", type=float, default=0.02, help="SGD step per unit of width (the step is lr * m * grad)")
    d.add_argument("--batch-size", type=int, default=64, help="SGD mini-batch size")
    d.add_argument("--penalty", type=float, default=0.1, help="weight of the Tr(H) penalty run (0 skips it)")
    d.add_argument("--penalty-method", default="gauss_newton", choices=["gauss_newton", "hutchinson", "exact"],
                   help="how the penalty computes Tr(H) of the mini-batch loss (default: Gauss-Newton part)")
    d.add_argument("--d-attn", type=int, default=0, help="rows of Q and K (default 2T)")
    d.add_argument("--probes", type=int, default=32,
                   help="Hutchinson probes per trace estimate (shared flatness estimator); 0 skips it")
    d.add_argument("--balance", action="store_true",
                   help="rescale each random-feature neuron to its own Tr(H) minimum (same function)")
    d.add_argument("--float32", action="store_true", help="compute in float32 (default float64)")
    d.add_argument("--out", default="theory_dyck", help="directory for the PNG plot and results.json")
    d.add_argument("--json", action="store_true", help="print the results as one JSON object on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run `flatlm theory <verb>`; returns the exit code."""
    if getattr(args, "theory_verb", None) != "dyck":
        raise UserError("unknown theory check; use `flatlm theory dyck`")
    return _run_dyck(args)


def _run_dyck(args: argparse.Namespace) -> int:
    import jax
    from tqdm import tqdm

    from flatlm.theory import dyck

    cfg = dyck.TrainConfig(lr=args.lr, batch_size=args.batch_size, penalty=args.penalty,
                           penalty_method=args.penalty_method, d_attn=args.d_attn,
                           log_every=max(1, min(100, args.steps // 20 or 1)))
    if args.probes == 1 or args.probes < 0:
        raise UserError(f"--probes {args.probes}: pass 0 (no Hutchinson estimate) or >= 2 (for a standard error)")
    num_runs = 1 + (args.penalty > 0)
    bar = tqdm(total=num_runs * max(args.steps, 0), desc="theory dyck: training", unit="step", file=sys.stderr,
               disable=args.steps <= 0)
    try:
        with jax.enable_x64(not args.float32):
            results = dyck.run_check(T=args.T, m=args.m, seeds=args.seeds, steps=args.steps,
                                     n_downstream=args.n_downstream, samples=args.samples, train_cfg=cfg,
                                     num_probes=args.probes, balance=args.balance, progress=bar.update)
    except FloatingPointError as e:
        raise UserError(f"{e} (pass a smaller --lr)") from None
    finally:
        bar.close()
    for row in results["solutions"]:
        h = row.get("trace_hutchinson")
        row["trace_hutchinson_str"] = f"{h['mean']:.4g} ± {h['stderr']:.2g}" if h else None
    os.makedirs(args.out, exist_ok=True)
    results["plot"] = plot_training(results, os.path.join(args.out, PLOT_NAME)) if results["training"] else None
    results = _json_ready(results)
    with open(os.path.join(args.out, RESULTS_NAME), "w") as f:
        json.dump(results, f, indent=1)
    if args.json:
        print(json.dumps(results))
    else:
        from flatlm.cli import print_table

        source = "exact enumeration" if results["enumerated"] else f"{results['samples']} Monte-Carlo samples"
        print(f"Dyck T={results['T']}, width m={results['m']}, {source}; downstream head fitted on "
              f"{results['n_downstream']} samples. Flattest possible Tr(H) = 4/(m sqrt T) = "
              f"{results['flattest_trace']:.4g}")
        print_table(results["solutions"], COLUMNS)
        print(f"wrote {os.path.join(args.out, RESULTS_NAME)}"
              + (f" and {results['plot']}" if results["plot"] else ""), file=sys.stderr)
    return 0


def plot_training(results: dict[str, Any], path: str) -> str:
    """2x2 panels over steps (pre-training loss, Tr(H), alignment with +-1_T, downstream loss); returns path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(results["training"].values())
    exact = all(v is not None for run in runs for v in run["history"]["trace"])
    trace_key, trace_title = ("trace", "Tr(H)") if exact else ("trace_gauss_newton", "Tr(H), Gauss-Newton part")
    panels = [("pretrain_loss", "pre-training loss", True), (trace_key, trace_title, True),
              ("alignment", "|cos(v_i, 1_T)| (weighted)", False), ("downstream_loss", "downstream loss", True)]
    refs = {name: [r for r in results["solutions"] if r["solution"] == name]
            for name in ("transferable", "random_features")}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
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
    plt.close(fig)
    return path


def _json_ready(obj: Any) -> Any:
    """Plain JSON types; NaN and infinities become None."""
    if isinstance(obj, dict):
        return {str(k): _json_ready(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_ready(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, str | bytes):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
