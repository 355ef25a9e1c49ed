"""`flatlm theory dyck`: the numerical check of Theorem 6.1 (Section 6) as a table, a JSON object and a PNG of
the training run. All the work is in `flatlm.theory.dyck.run_check`; the plot in `flatlm.theory.plot`.
`flatlm theory scb`: issue 19's transfer experiment on the sparse contextual bigram (`flatlm.theory.scb_transfer`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
from tqdm.auto import tqdm

from flatlm.cli.common import add_output_flags
from flatlm.errors import UserError
from flatlm.table import json_ready, print_json, print_table
from flatlm.theory import dyck, dyck_noise, dyck_search, scb_transfer
from flatlm.theory.plot import plot_search, plot_training

PLOT_NAME = "dyck_training.png"
SEARCH_STEM = "dyck_search"  # .png and .pdf
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
    """Register `theory` with its sub-verbs `dyck` and `scb`."""
    p = subparsers.add_parser("theory", help="numerical checks of the paper's theory (Section 6: Dyck) and issue 19's "
                              "sparse contextual bigram")
    sub = p.add_subparsers(dest="theory_verb", metavar="{dyck,scb}", required=True)
    _add_scb(sub)
    d = sub.add_parser("dyck", help="Theorem 6.1: the flattest zero-loss transformer transfers; random features don't",
                       description="Both constructed zero-loss solutions (transferable +-1_T neurons; random "
                       "features), their exact Tr(H) and downstream loss, and SGD runs with and without a Tr(H) "
                       "penalty from a random init.")
    d.add_argument("--T", type=int, default=6, help="string length, even (default 6)")
    d.add_argument("--m", type=int, default=0,
                   help="width (number of neurons), >= 2 (Theorem 6.1); random features need more (gaussian: "
                   "T C(T, T/2) + 2T, 132 at T=6; mirrored: even and >= 4T); default: the random features' minimum")
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
    d.add_argument("--draw", default="gaussian", choices=list(dyck.RF_DRAWS),
                   help="random features: gaussian (default, the paper's V_i ~ N(0, T I)) or mirrored ([W; -W])")
    d.add_argument("--no-balance", dest="balance", action="store_false",
                   help="keep the min-norm head as fitted instead of rescaling each random-feature neuron to its "
                   "own Tr(H) minimum (same function; unbalanced overstates the random features' Tr(H))")
    d.add_argument("--search", type=int, default=0, metavar="STARTS",
                   help="also minimise Tr(H) subject to zero pre-training loss from STARTS random inits (width --m; "
                   "Theorem 6.1's search) and report each solution's Tr(H) against 4/(m sqrt T) and its downstream "
                   "loss; 0 (default) skips it")
    d.add_argument("--search-n", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                   help="downstream sample sizes for the search's solutions (default 1 2 4 8 16 32)")
    d.add_argument("--search-rounds", type=int, default=12, help="augmented-Lagrangian rounds per start")
    d.add_argument("--search-steps", type=int, default=300, help="L-BFGS steps per round")
    d.add_argument("--label-noise", type=float, default=0.0, metavar="SIGMA",
                   help="also run SGD with and without N(0, SIGMA^2) label noise for --steps steps from the "
                   "balanced random-feature solution (zero loss) and report Tr(H) at the zero-loss projection: "
                   "Section 4's mechanism, which the deterministic Dyck target cannot show (0 skips it)")
    d.add_argument("--float32", action="store_true", help="compute in float32 (default float64)")
    d.add_argument("--out", default="theory_dyck", help="directory for the PNG plot and results.json")
    add_output_flags(d, quiet=False)
    p.set_defaults(func=run, overrides=False)


def run(args: argparse.Namespace) -> int:
    """Run `flatlm theory <verb>`; returns the exit code."""
    verb = getattr(args, "theory_verb", None)
    if verb == "scb":
        return _run_scb(args)
    if verb != "dyck":
        raise UserError("unknown theory check; use `flatlm theory dyck` or `flatlm theory scb`")
    return _run_dyck(args)


SCB_COLUMNS = [("seed", "seed", "d"), ("method", "method", ""), ("start", "start", ""),
               ("samples_to_target", "samples to target", "d"), ("start_distance", "start dist", ".3f"),
               ("min_distance", "min dist", ".3f"), ("final_distance", "end dist", ".3f"),
               ("final_dist_V", "|V-P|", ".3f"), ("final_dist_A", "|A-Q^T|", ".3f"),
               ("source_distance", "source dist (pre-trained)", ".3f")]


def _add_scb(sub) -> None:
    d = sub.add_parser("scb", help="issue 19: SCB linear transformer, scratch vs fine-tuned, SGD vs l1-proximal",
                       description=scb_transfer.__doc__.split("\n\n")[0])
    d.add_argument("--preset", default="tiny", choices=list(scb_transfer.PRESETS),
                   help="tiny (N=8, T=6, 3 seeds, ~20 s) or cpu (N=10, T=20, 5 seeds, ~1.5 min on 2 CPU cores)")
    d.add_argument("--seeds", type=int, nargs="+", help="override the preset's seeds")
    d.add_argument("--target", type=float, help="override the preset's target distance")
    d.add_argument("--lam", type=float, help="override the l1 weight of the proximal step on A")
    d.add_argument("--prox-samples", type=int, help="override when prox+sgd switches to plain SGD (sentences)")
    d.add_argument("--keep", choices=["patterns", "transition"],
                   help="what the source SCB shares with the target (default patterns: the same Q)")
    d.add_argument("--mix", type=float, help="weight of the fresh draw in the source's other factor (default 0.5)")
    add_output_flags(d, quiet=False)
    d.set_defaults(func=run, overrides=False)


def _run_scb(args: argparse.Namespace) -> int:
    fields = {"seeds": tuple(args.seeds) if args.seeds else None, "target": args.target, "lam": args.lam,
              "prox_samples": args.prox_samples, "keep": args.keep, "mix": args.mix}
    try:
        given = {k: v for k, v in fields.items() if v is not None}
        cfg = dataclasses.replace(scb_transfer.PRESETS[args.preset], **given)
        scb_transfer.check_config(cfg)
    except ValueError as e:
        raise UserError(f"flatlm theory scb: {e}") from None
    arms = len(cfg.seeds) * len(cfg.methods) * 2
    with tqdm(total=arms, desc="theory scb", unit="arm", file=sys.stderr, disable=args.json) as bar:
        rows = scb_transfer.run_transfer(cfg, progress=bar.update)
    if args.json:
        print_json({"config": dataclasses.asdict(cfg), "rows": rows, "summary": scb_transfer.summary(rows)})
        return 0
    print(f"SCB N={cfg.num_words} T={cfg.context_length} sparsity={cfg.sparsity}; source keeps the {cfg.keep} "
          f"(mix {cfg.mix}); target distance {cfg.target}, budget {cfg.max_samples:,} samples per arm; lam {cfg.lam}, "
          f"prox+sgd switches after {cfg.prox_samples:,}; fine-tuned arms pre-trained on the source for "
          f"{cfg.pretrain_samples:,} samples (not counted)")
    print_table(rows, SCB_COLUMNS)
    print()
    print_table(scb_transfer.summary(rows), [("method", "method", ""), ("start", "start", ""),
                                             ("reached", "reached", ""), ("median_samples", "median samples", "d")])
    return 0


def _run_dyck(args: argparse.Namespace) -> int:
    cfg = dyck.TrainConfig(lr=args.lr, batch_size=args.batch_size, penalty=args.penalty,
                           penalty_method=args.penalty_method, d_attn=args.d_attn,
                           log_every=max(1, min(100, args.steps // 20 or 1)))
    if args.probes == 1 or args.probes < 0:
        raise UserError(f"--probes {args.probes}: pass 0 (no Hutchinson estimate) or >= 2 (for a standard error)")
    search_cfg = dyck_search.SearchConfig(starts=max(args.search, 1), d_attn=args.d_attn, rounds=args.search_rounds,
                                          inner_steps=args.search_steps, ns=tuple(args.search_n),
                                          down_seeds=tuple(args.seeds))
    if args.search < 0:
        raise UserError(f"--search {args.search}: pass the number of random starts (0 skips the search)")
    if (args.search or args.label_noise > 0) and args.T > dyck.lang.MAX_ENUM_T:
        raise UserError(f"--search and --label-noise need the enumerated population (T <= {dyck.lang.MAX_ENUM_T}); "
                        f"pass a smaller --T")
    dyck_search.check_config(search_cfg)
    dyck.lang.check_length(args.T)  # before the progress bar: a bad --T gets its one line alone
    num_runs = 1 + (args.penalty > 0)
    bar = tqdm(total=num_runs * max(args.steps, 0), desc="theory dyck: training", unit="step", file=sys.stderr,
               disable=args.steps <= 0)
    try:
        with jax.enable_x64(not args.float32):
            results = dyck.run_check(T=args.T, m=args.m, seeds=args.seeds, steps=args.steps,
                                     n_downstream=args.n_downstream, samples=args.samples, train_cfg=cfg,
                                     num_probes=args.probes, balance=args.balance, draw=args.draw,
                                     progress=bar.update)
            results["search"] = _search(args, results["m"], search_cfg) if args.search else None
            results["label_noise"] = _label_noise(args, results, cfg) if args.label_noise > 0 else None
    except FloatingPointError as e:
        raise UserError(f"{e} (pass a smaller --lr)") from None
    finally:
        bar.close()
    for row in results["solutions"]:
        h = row.get("trace_hutchinson")
        row["trace_hutchinson_str"] = f"{h['mean']:.4g} ± {h['stderr']:.2g}" if h else None
    os.makedirs(args.out, exist_ok=True)
    results["plot"] = plot_training(results, os.path.join(args.out, PLOT_NAME)) if results["training"] else None
    if results["search"]:
        results["search"]["plots"] = plot_search(results["search"], os.path.join(args.out, SEARCH_STEM))
    results = json_ready(results)
    with open(os.path.join(args.out, RESULTS_NAME), "w") as f:
        json.dump(results, f, indent=1)
    if args.json:
        print_json(results)
    else:
        source = "exact enumeration" if results["enumerated"] else f"{results['samples']} Monte-Carlo samples"
        print(f"Dyck T={results['T']}, width m={results['m']}, {source}; downstream head fitted on "
              f"{results['n_downstream']} samples. Flattest possible Tr(H) = 4/(m sqrt T) = "
              f"{results['flattest_trace']:.4g}")
        print_table(results["solutions"], COLUMNS)
        unfit = [r for r in results["solutions"] if r["solution"].startswith("sgd") and r["pretrain_loss"] > 1e-2]
        for r in unfit:  # Section 6 compares zero-loss solutions; a trained row short of that is not one
            print(f"note: {r['solution']} did not reach zero pre-training loss in {results['steps']} steps (loss "
                  f"{r['pretrain_loss']:.2g}): its Tr(H) and downstream loss are not those of a zero-loss solution; "
                  f"train longer (--steps) or at a smaller width (e.g. --m 24 --draw mirrored)")
        if results["random_features_note"]:
            print(results["random_features_note"])
        if results["search"]:
            _print_search(results["search"])
        if results["label_noise"]:
            _print_label_noise(results["label_noise"])
        print(f"wrote {os.path.join(args.out, RESULTS_NAME)}"
              + (f" and {results['plot']}" if results["plot"] else ""), file=sys.stderr)
    return 0


def _search(args: argparse.Namespace, m: int, cfg) -> dict:
    """The Tr(H)-minimisation search at width m, with its own progress bar (one tick per start)."""
    with tqdm(total=cfg.starts, desc="theory dyck: search", unit="start", file=sys.stderr) as bar:
        return dyck_search.search(args.T, m, cfg, seed=args.seeds[0], progress=bar.update)


def _print_search(search: dict) -> None:
    ns = [str(n) for n in search["config"]["ns"]]
    rows = [{**r, **{f"down_{n}": r["downstream_mean"][n] for n in ns}} for r in search["rows"]]
    if search["reference"]:
        rows.append({"start": "transferable", **search["reference"],
                     **{f"down_{n}": search["reference"]["downstream_mean"][n] for n in ns}})
    cols = [("start", "start", ""), ("pretrain_loss", "pre-train loss", ".1e"), ("trace", "Tr(H)", ".6g"),
            ("trace_gap", "Tr(H)/min - 1", ".1e"), ("alignment", "|cos(v, 1_T)|", ".3f"),
            ("attention_spread", "max|a - 1/T|", ".1e")] + [(f"down_{n}", f"down n={n}", ".2e") for n in ns]
    print(f"\nSearch: minimise Tr(H) s.t. zero pre-training loss, {len(search['rows'])} starts, width "
          f"m={search['m']}; downstream loss = mean over {len(search['config']['down_seeds'])} seeds")
    print_table(rows, cols)
    found = "none zero-loss" if search["min_trace"] is None else \
        f"{search['min_trace']:.10g} (gap {search['min_gap']:.1e})"
    print(f"min Tr(H) found: {found}; closed-form minimum 4/(m sqrt T) = {search['bound']:.10g}; "
          f"{search['n_feasible']} of {len(search['rows'])} starts reached zero loss, {search['n_at_bound']} the "
          f"minimum (gap <= 1e-3)")


def _label_noise(args: argparse.Namespace, results: dict, cfg) -> dict:
    """SGD with and without label noise from the random-feature solution (needs the random features' width)."""
    if results["random_features_note"]:
        raise UserError(f"--label-noise starts from the random-feature solution: {results['random_features_note']}; "
                        f"pass a larger --m or drop --label-noise")
    if args.steps <= 0:
        raise UserError("--label-noise needs --steps > 0")
    noisy = dataclasses.replace(cfg, label_noise=args.label_noise)
    with tqdm(total=2 * args.steps, desc="theory dyck: label noise", unit="step", file=sys.stderr) as bar:
        return dyck_noise.label_noise_check(args.T, results["m"], noisy, args.steps, seed=args.seeds[0],
                                            draw=args.draw, progress=bar.update)


def _print_label_noise(res: dict) -> None:
    sgd, noisy = res["runs"]["sgd"], res["runs"]["label_noise_sgd"]
    rows = [{"step": s, "sgd": a, "noisy": b, "loss": c} for s, a, b, c in
            zip(sgd["step"], sgd["trace_projected"], noisy["trace_projected"], noisy["loss"])]
    print(f"\nLabel noise (sigma={res['label_noise']:g}, lr={res['lr']:g}, batch {res['batch_size']}) from the "
          f"random-feature solution; Tr(H) at the zero-loss projection (minimum {res['flattest_trace']:.4g})")
    print_table(rows, [("step", "step", "d"), ("sgd", "Tr(H) plain SGD", ".5g"),
                       ("noisy", "Tr(H) label-noise SGD", ".5g"), ("loss", "loss at noisy iterate", ".2e")])
