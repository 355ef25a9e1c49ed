"""`flatlm flatness` and `flatlm grow` verbs. Thin: argument parsing and printing around flatlm.flatness.report
and flatlm.flatness.grow. Tables go to stdout (or one JSON object with --json); progress goes to stderr.

LEAD: the workdir-loading hooks are `_load_run`, `_eval_batches` and `_save_grown` below; they are written
against `flatlm.checkpoint.load_run(workdir) -> Run` (.config, .steps, .load_params(step), .model, .language,
.eval_batches(...)) and are the only places to adjust.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from flatlm.errors import UserError
from flatlm.flatness import grow, report
from flatlm.models.bert import TABLE3, BertConfig


# ---------------------------------------------------------------------------------------------------------------
# Hooks into flatlm.checkpoint (LEAD: wire these; nothing else in this file touches workdirs).
def _load_run(workdir: str):
    """The run stored in `workdir` (flatlm.checkpoint.load_run)."""
    try:
        from flatlm.checkpoint import load_run  # provided by the lead
    except ImportError as e:
        raise UserError("flatlm.checkpoint.load_run is not available in this build") from e
    return load_run(workdir)


def _eval_batches(run, num_batches: int, batch_size: int, seed: int) -> list[dict]:
    """Evaluation MLM batches (tokens/targets/weights) of the run's language."""
    return run.mlm_batches(num_batches, batch_size, seed=seed)


def _save_grown(path: str, params, config: BertConfig) -> None:
    """Write grown parameters. Stopgap: an .npz of '/'-joined parameter paths plus the config as JSON under
    '__config__'; LEAD: swap for the checkpoint writer so the result is a workdir."""
    flat = {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    np.savez(path, __config__=np.array(json.dumps(dataclasses.asdict(config))), **flat)
# ---------------------------------------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _steps(run, spec: str) -> list[int]:
    available = list(run.steps)
    if not available:
        raise UserError("the workdir has no checkpoints")
    if spec == "last":
        return [available[-1]]
    if spec == "all":
        return available
    try:
        wanted = [int(s) for s in spec.split(",") if s]
    except ValueError as e:
        raise UserError(f"--steps must be 'last', 'all' or comma-separated integers, got {spec!r}") from e
    missing = [s for s in wanted if s not in available]
    if missing:
        raise UserError(f"no checkpoint for steps {missing}; available: {available}")
    return wanted


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """Fixed-width text table; floats with 5 significant digits."""
    fmt = lambda v: f"{v:.5g}" if isinstance(v, float) else ("-" if v is None else str(v))
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))
    return "\n".join([line(columns), *(line(r) for r in cells)])


def add_parser(subparsers) -> None:
    """Register the `flatness` and `grow` verbs on an argparse subparsers object (handlers in `func`)."""
    p = subparsers.add_parser("flatness", help="trace of the Hessian / Fisher of a run's checkpoints")
    p.add_argument("--workdir", required=True)
    p.add_argument("--method", choices=report.METHODS, default="fisher")
    p.add_argument("--steps", default="last", help="'last', 'all' or comma-separated checkpoint steps")
    p.add_argument("--gap", action="store_true", help="Hessian vs Fisher vs empirical Fisher report instead")
    p.add_argument("--num-probes", type=int, default=100, help="Hutchinson probes per batch / Hutch++ matvecs")
    p.add_argument("--num-draws", type=int, default=50, help="labels drawn per context (Fisher)")
    p.add_argument("--fisher-form", choices=("per_sample", "summed"), default="per_sample")
    p.add_argument("--num-batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=1, help="probes vmapped at once")
    p.add_argument("--groups", choices=("top", "leaf"), default="top")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_flatness)

    g = subparsers.add_parser("grow", help="embed a run's small BERT into a larger one, same function")
    g.add_argument("--workdir", required=True)
    g.add_argument("--step", default="last")
    g.add_argument("--to", help=f"target shape: {', '.join([*grow.TABLE4, *TABLE3])}")
    g.add_argument("--d-model", type=int)
    g.add_argument("--num-layers", type=int)
    g.add_argument("--init", choices=("zeros", "random"), default="zeros", help="new blocks' input-side weights")
    g.add_argument("--out", help="where to write the grown parameters (.npz)")
    g.add_argument("--check", action="store_true", help="compare small and grown logits/loss on eval batches")
    g.add_argument("--num-batches", type=int, default=2)
    g.add_argument("--batch-size", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=run_grow)


def run_flatness(args: argparse.Namespace) -> int:
    run = _load_run(args.workdir)
    batches = _eval_batches(run, args.num_batches, args.batch_size, args.seed)
    apply_fn = run.model.apply
    key = jax.random.key(args.seed)
    rows = []
    for step in _steps(run, args.steps):
        _log(f"flatness: step {step} ({'gap' if args.gap else args.method})")
        params = run.load_params(step)
        kw = dict(num_probes=args.num_probes, num_draws=args.num_draws, fisher_form=args.fisher_form,
                  chunk_size=args.chunk_size, groups=args.groups)
        if args.gap:
            rows.append({"step": step, **report.gap_report(apply_fn, params, batches, key, **kw)})
        else:
            est = report.measure(args.method, apply_fn, params, batches, key, **kw)
            rows.append({"step": step, **est.to_dict()})
            from flatlm import results as results_lib

            results_lib.append(args.workdir, [{"kind": "flatness", "step": step, "method": args.method,
                                               "grown_to": None, "trace": est.mean, "trace_stderr": est.stderr,
                                               "detail": est.to_dict()}])
    if args.json:
        print(json.dumps({"workdir": args.workdir, "method": "gap" if args.gap else args.method, "results": rows}))
    elif args.gap:
        flat = [{"step": r["step"], "loss": r["loss"], "tr_hessian": r["hessian"]["mean"],
                 "se_h": r["hessian"]["stderr"], "tr_fisher": r["fisher"]["mean"], "se_f": r["fisher"]["stderr"],
                 "tr_emp_fisher": r["empirical_fisher"]["mean"], "h_minus_f_z": r["hessian_minus_fisher_z"]}
                for r in rows]
        print(format_table(flat, list(flat[0])))
    else:
        print(format_table(rows, ["step", "method", "mean", "stderr", "probe_stderr", "data_std", "num_samples"]))
    return 0


def _target_shape(args: argparse.Namespace) -> tuple[int, int]:
    if args.to:
        shapes = {**TABLE3, **grow.TABLE4}
        if args.to not in shapes:
            raise UserError(f"unknown --to {args.to!r}; choose one of {', '.join(shapes)}")
        return shapes[args.to]
    if args.d_model is None or args.num_layers is None:
        raise UserError("give --to NAME or both --d-model and --num-layers")
    return args.num_layers, args.d_model


def run_grow(args: argparse.Namespace) -> int:
    run = _load_run(args.workdir)
    small_cfg = getattr(run.model, "cfg", None)
    if not isinstance(small_cfg, BertConfig):
        raise UserError("grow supports BERT runs only")
    step = _steps(run, args.step)[-1]
    num_layers, d_model = _target_shape(args)
    try:
        big_cfg = grow.grown_config(small_cfg, d_model=d_model, num_layers=num_layers)
        key = jax.random.key(args.seed) if args.init == "random" else None
        params = grow.embed(run.load_params(step), small_cfg, big_cfg, key=key)
    except ValueError as e:
        shape = f"{small_cfg.num_layers}x{small_cfg.d_model} to {num_layers}x{d_model}"
        raise UserError(f"cannot grow {shape}: {e}") from e
    result: dict[str, Any] = {"workdir": args.workdir, "step": step, "small": dataclasses.asdict(small_cfg),
                              "big": dataclasses.asdict(big_cfg)}
    if args.check:
        result.update(check_embedding(run.model.apply, run.load_params(step), type(run.model)(big_cfg).apply,
                                      params, _eval_batches(run, args.num_batches, args.batch_size, args.seed)))
    if args.out:
        _save_grown(args.out, params, big_cfg)
        result["out"] = args.out
        _log(f"grow: wrote {args.out}")
    if args.json:
        print(json.dumps(result))
    else:
        rows = [{"from": f"L{small_cfg.num_layers}-H{small_cfg.d_model}", "to": f"L{num_layers}-H{d_model}",
                 "max_abs_logit_diff": result.get("max_abs_logit_diff"), "loss_small": result.get("loss_small"),
                 "loss_big": result.get("loss_big")}]
        print(format_table(rows, list(rows[0])))
    return 0


def check_embedding(small_apply, small_params, big_apply, big_params, batches) -> dict[str, float]:
    """Max |logit difference| and mean MLM loss of the small and grown models on `batches`."""
    from flatlm.train.losses import mlm_loss

    diff, ls, lb = 0.0, [], []
    for b in batches:
        a = small_apply({"params": small_params}, b["tokens"])
        c = big_apply({"params": big_params}, b["tokens"])
        diff = max(diff, float(np.max(np.abs(np.asarray(a) - np.asarray(c)))))
        ls.append(float(mlm_loss(small_params, b, small_apply)))
        lb.append(float(mlm_loss(big_params, b, big_apply)))
    return {"max_abs_logit_diff": diff, "loss_small": float(np.mean(ls)), "loss_big": float(np.mean(lb))}
