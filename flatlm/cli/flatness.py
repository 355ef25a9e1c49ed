"""`flatlm flatness --workdir DIR`: Tr(H) of a run's checkpoints by one estimator, or the Hessian/Fisher gap."""

from __future__ import annotations

from flatlm.cli.common import add_output_flags, non_negative_int, parse_steps, positive_int
from flatlm.flatness.compare import METHODS
from flatlm.flatness.runner import measure_run
from flatlm.results import SPLITS
from flatlm.run import load_run
from flatlm.table import print_json, print_table


def add_parser(sub) -> None:
    """Register `flatness`."""
    p = sub.add_parser("flatness", help="trace of the Hessian / Fisher of a run's checkpoints")
    p.add_argument("--workdir", required=True)
    p.add_argument("--method", choices=METHODS, default="fisher")
    p.add_argument("--steps", default="last", help="'last', 'all' or comma-separated checkpoint steps")
    p.add_argument("--gap", action="store_true", help="Hessian vs Fisher vs empirical Fisher report instead")
    p.add_argument("--num-probes", type=positive_int, default=100,
                   help="Hutchinson probes per batch / Hutch++, XTrace matvecs")
    p.add_argument("--num-draws", type=positive_int, default=50, help="labels drawn per context (Fisher)")
    p.add_argument("--fisher-form", choices=("per_sample", "summed"), default="per_sample")
    p.add_argument("--num-batches", type=positive_int, default=8)
    p.add_argument("--batch-size", type=positive_int, default=256)
    p.add_argument("--chunk-size", type=positive_int, default=1, help="probes vmapped at once")
    p.add_argument("--groups", choices=("top", "leaf", "growth", "block"), default="top",
                   help="per-group traces: top-level keys, every tensor, growth-invariant vs rescaled tensors, or "
                        "blocks (embeddings, each layer's attention and MLP, head)")
    p.add_argument("--spectrum-k", type=non_negative_int, default=0,
                   help="also the Hessian's k largest eigenvalues (Lanczos, k + 5 HVPs, with Ritz error bounds)")
    p.add_argument("--density-probes", type=non_negative_int, default=0,
                   help="also the Hessian's spectral density by stochastic Lanczos quadrature over this many probes")
    p.add_argument("--density-iters", type=positive_int, default=30, help="Lanczos steps per density probe")
    p.add_argument("--preconditioned", action="store_true",
                   help="also an AdamW run's preconditioned sharpness (top eigenvalue of P^-1 H, P from the "
                        "checkpoint's Adam state) beside its edge-of-stability value 2 (1 + b1) / ((1 - b1) lr)")
    p.add_argument("--split", choices=SPLITS, default="validation",
                   help="measure on masked validation sentences (one mask each, the paper's B.1) or on the training "
                        "objective (training sentences masked as training masks them; data.fixed_masks: every step's)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    add_output_flags(p)
    p.set_defaults(func=run, overrides=False)


def run(args) -> int:
    """Measure (appending to results.json unless --gap) and print one row per checkpoint (then, with a spectrum,
    its top eigenvalues and SLQ trace per checkpoint)."""
    run_ = load_run(args.workdir)
    entries = measure_run(run_, parse_steps(args.steps, run_.steps), args.method, num_probes=args.num_probes,
                          num_batches=args.num_batches, batch_size=args.batch_size, draws=args.num_draws,
                          seed=args.seed, fisher_form=args.fisher_form, chunk_size=args.chunk_size,
                          groups=args.groups, gap=args.gap, progress=not args.quiet, spectrum_k=args.spectrum_k,
                          density_probes=args.density_probes, density_iters=args.density_iters,
                          preconditioned=args.preconditioned, split=args.split)
    spectra = [e for e in entries if e["kind"] == "spectrum"]
    sharp = [e for e in entries if e["kind"] == "preconditioned_sharpness"]
    entries = [e for e in entries if e["kind"] not in ("spectrum", "preconditioned_sharpness")]
    rows = [{"step": e["step"], **{k: v for k, v in e.items() if k != "kind"}} if args.gap else
            {"step": e["step"], **e["detail"]} for e in entries]
    if args.json:
        print_json({"workdir": args.workdir, "method": "gap" if args.gap else args.method, "results": rows,
                    **({"spectrum": spectra} if spectra else {}),
                    **({"preconditioned_sharpness": sharp} if sharp else {})})
        return 0
    if args.gap:
        print_table([{"step": r["step"], "loss": r["loss"], "tr_hessian": r["hessian"]["mean"],
                      "se_h": r["hessian"]["stderr"], "tr_fisher": r["fisher"]["mean"], "se_f": r["fisher"]["stderr"],
                      "tr_emp_fisher": r["empirical_fisher"]["mean"], "h_minus_f": r["hessian_minus_fisher"],
                      "se_gap": r["hessian_minus_fisher_stderr"], "h_minus_f_z": r["hessian_minus_fisher_z"]}
                     for r in rows], ["step", "loss", "tr_hessian", "se_h", "tr_fisher", "se_f", "tr_emp_fisher",
                                      "h_minus_f", "se_gap", "h_minus_f_z"])
    else:
        print_table(rows, ["step", "method", "mean", "stderr", "probe_stderr", "data_std", "num_samples"])
    if spectra:
        print_table([{"step": e["step"], "top_eigenvalues": ", ".join(f"{v:.4g}" for v in e.get("top", {}).get(
            "values", [])[:5]) or "-", "tr_slq": e["density"]["moments"][0]["value"] if "density" in e else None}
                     for e in spectra], ["step", "top_eigenvalues", "tr_slq"])
    if sharp:
        print_table([{"step": e["step"], "p_inv_h_top": e["value"], "residual": e["residual"], "lr": e["lr"],
                      "edge_of_stability": e["edge_of_stability"], "ratio": e["ratio"]} for e in sharp],
                    ["step", "p_inv_h_top", "residual", "lr", "edge_of_stability", "ratio"])
    return 0
