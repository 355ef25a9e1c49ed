"""Cost of the flatness estimators as multiples of one gradient of the MLM loss at the same batch.

BERT (pre-LN) at d_model 128 and 256, sequence length 32, V = 200 words, float32, deterministic. Rows:
  hvp fwd-over-rev      one H v, `hessian.hvp` (jax.jvp of jax.grad), jitted alone
  hvp rev-over-rev      grad of (grad . v), for reference
  hutchinson / probe    one probe of `hutchinson_trace`, 16 probes: linearized (primal once per batch; chunk 1, 4)
                        or jvp (primal recomputed per probe)
  fisher summed         one batch of `fisher_trace(method="summed")`, 1 draw (forward + sample + 1 backward)
  fisher summed / draw  the same with 16 draws (forward shared), per draw
  fisher per-sample     one batch of per-context squared gradient norms (1 draw; one masked position per row;
                        8 contexts vmapped at a time, the default)
Memory: XLA's compiled temp + output buffers of one Hutchinson batch minus those of a gradient, in parameter copies,
at the benchmark batch and at batch 1 (where activations are negligible: the parameter-sized overhead alone).
Timings: each case alternates with its own reference gradient (`_util.interleave`, samples of >= 0.2 s, --repeats
rounds); a row is the median over rounds of its CPU-seconds over the gradient's in the same round, [min] and [max]
beside it, and [near] / [far] the median over the rounds that followed each cross-core state (`_cores.py`; nan:
no such round, or not measured). (Single back-to-back calls swung 1.0-1.45 between two runs; one round-robin over
all cases ran the gradient at 13 ms between the long Hutchinson cases and 20-23 ms elsewhere.)
Usage: python benchmarks/flatness_cost.py [--json] [--d-models 128,256] [--layers 2] [--batch 32] [--repeats 9].
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from _cores import FAR_NS, by_state, state
from _util import interleave, paired_ratio

from flatlm.flatness import fisher as fi
from flatlm.flatness import hessian as hs
from flatlm.flatness.estimates import param_groups
from flatlm.languages.base import special_ids
from flatlm.models.bert import Bert, BertConfig
from flatlm.models.losses import mlm_loss

V, T = 200, 32


def _batch(rng: np.random.Generator, B: int, one_per_row: bool) -> dict:
    targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
    tokens = targets.copy()
    weights = np.zeros((B, T), np.float32)
    for b in range(B):
        pos = rng.choice(T, size=1 if one_per_row else 5, replace=False)
        weights[b, pos] = 1.0
        tokens[b, pos] = special_ids(V).mask
    return {"tokens": jnp.asarray(tokens), "targets": jnp.asarray(targets), "weights": jnp.asarray(weights)}


def _memory(fn, *args) -> int:
    """XLA's temp + output buffer bytes of the compiled function."""
    m = jax.jit(fn).lower(*args).compile().memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes) if m is not None else -1


def measure(d_model: int, layers: int, B: int, repeats: int) -> dict:
    cfg = BertConfig(num_words=V, max_len=T, d_model=d_model, num_layers=layers, dropout=0.0, attention_dropout=0.0)
    model = Bert(cfg)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, T), jnp.int32))["params"])
    rng = np.random.default_rng(0)
    batch, ctx = _batch(rng, B, False), _batch(rng, B, True)
    loss = functools.partial(_loss, apply_fn=model.apply)
    v = hs.probe_like(jax.random.key(1), params)
    key = jax.random.key(2)
    ids = tuple(param_groups(params)[1])
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))

    grad = jax.jit(jax.grad(loss))
    hvp = jax.jit(lambda p, w, b: hs.hvp(lambda q: loss(q, b), p, w))
    rr = jax.jit(lambda p, w, b: jax.grad(lambda q: hs.group_dots(jax.grad(loss)(q, b), w, ids, max(ids) + 1).sum())(p))
    hutch = lambda n, c, lin=True: functools.partial(hs._hutchinson_stats, loss_fn=loss, num_probes=n,
                                                     kind="rademacher", chunk=c, leaf_ids=ids, shard=None,
                                                     linearize=lin)
    summed = lambda n: functools.partial(fi._summed_stats, apply_fn=model.apply, num_draws=n, draw_chunk=1,
                                         leaf_ids=ids)
    per_sample = functools.partial(fi._per_sample_stats, apply_fn=model.apply, num_draws=1, draw_chunk=1,
                                   leaf_ids=ids, labels="model", chunk=min(8, B))
    coef, coef_ctx = jnp.sqrt(batch["weights"]), jnp.sqrt(ctx["weights"])

    n = 16
    cases = {  # name: (function, args, products per call)
        "gradient": (grad, (params, batch), 1),
        "gradient, one masked position per row": (grad, (params, ctx), 1),
        "hvp fwd-over-rev": (hvp, (params, v, batch), 1),
        "hvp rev-over-rev": (rr, (params, v, batch), 1),
        "hutchinson / probe (linearized, chunk 1)": (jax.jit(hutch(n, 1)), (params, batch, key), n),
        "hutchinson / probe (linearized, chunk 4)": (jax.jit(hutch(n, 4)), (params, batch, key), n),
        "hutchinson / probe (jvp, chunk 1)": (jax.jit(hutch(n, 1, False)), (params, batch, key), n),
        "fisher summed, 1 draw": (jax.jit(summed(1)), (params, batch["tokens"], coef, key), 1),
        "fisher summed / draw (16 draws)": (jax.jit(summed(n)), (params, batch["tokens"], coef, key), n),
        "fisher per-sample, 1 draw": (jax.jit(per_sample), (params, ctx["tokens"], coef_ctx, ctx["targets"], key), 1),
    }
    calls = {name: functools.partial(lambda f, a: jax.block_until_ready(f(*a)), f, a) for name, (f, a, _) in
             cases.items()}
    for call in calls.values():
        call()
    rows, grad_cpu_s, ns_all = {}, [], []
    for name, (_, _, per) in cases.items():
        if name.startswith("gradient"):
            continue
        ref = "gradient, one masked position per row" if "per-sample" in name else "gradient"
        ns = []  # the cross-core state before each round (_cores.py)
        samples = interleave({ref: calls[ref], name: calls[name]}, repeats, states=ns)  # the case and its reference
        med, lo, hi = paired_ratio(samples[name], samples[ref], 1)
        rows[name], rows[f"{name} [min]"], rows[f"{name} [max]"] = med / per, lo / per, hi / per
        groups = by_state(samples[name][:, 1] / samples[ref][:, 1], ns)
        for where in ("near", "far"):
            rows[f"{name} [{where}]"] = groups[where]["median"] / per if where in groups else float("nan")
        ns_all += ns
        grad_cpu_s.extend(samples["gradient"][:, 1] if ref == "gradient" else [])
    states = [state(x) for x in ns_all]
    rows = {"gradient (cpu s)": float(np.median(grad_cpu_s)), "rounds": float(len(ns_all)),
            f"rounds after a far cross-core state (> {FAR_NS:.0f} ns)":
                float(states.count("far")) if any(states) else float("nan"), **rows}
    for b in (B, 1):
        small = {k: x[:b] for k, x in batch.items()}
        g = _memory(jax.grad(loss), params, small)
        rows[f"memory gradient, batch {b} (param copies)"] = g / param_bytes
        for lin in (True, False):
            h = _memory(hutch(n, 1, lin), params, small, key)
            rows[f"memory hutchinson - gradient, batch {b}, {'linearized' if lin else 'jvp'}"] = (h - g) / param_bytes
    rows["num_params"] = param_bytes // 4
    return rows


def _loss(params, batch, apply_fn):
    return mlm_loss(params, batch, apply_fn)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-models", default="128,256")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    results = {}
    for d in (int(x) for x in args.d_models.split(",")):
        print(f"measuring d_model={d} ...", file=sys.stderr, flush=True)
        results[d] = measure(d, args.layers, args.batch, args.repeats)
    if args.json:
        print(json.dumps({"layers": args.layers, "batch": args.batch, "seq": T, "results": results}))
        return 0
    names = list(next(iter(results.values())))
    width = max(map(len, names))
    print(f"{'x one gradient (same batch)':{width}}  " + "  ".join(f"{'d=' + str(d):>9}" for d in results))
    for name in names:
        cells = "  ".join(f"{results[d][name]:9.3g}" for d in results)
        print(f"{name:{width}}  {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
