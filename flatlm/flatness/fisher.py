"""Fisher-information traces of the MLM loss: the paper's Appendix B.1 flatness measure.

For a batch in the MLM format (tokens, targets, weights marking the masked positions) the loss is
L = (1/W) sum_i w_i CE_i over positions i, W = sum_i w_i. Its Fisher (Gauss-Newton) matrix under the model is
  F = (1/W) sum_i w_i E_{y ~ p(.|x_-i)} [g_i(y) g_i(y)^T],   g_i(y) = grad log p(y | x_-i),
so Tr F = (1/W) sum_i w_i E ||g_i(y)||^2: sample contexts, draw labels from the model's own prediction and average
squared gradient norms. At the population optimum (model = true conditionals) E[Hessian] = F, the Bartlett
identity the paper relies on; `flatlm.flatness.compare.gap_report` shows how close a model is to it.

Two estimators, both unbiased, each with a standard error:
- per-sample ("exact per-sample form"): one gradient per (context, draw), vmapped per-example gradients. Each row
  of the batch is first split so that it carries one masked position (the context x_-i keeps the row's other
  masks), so the squared norms are exactly ||g_i(y)||^2.
- summed: one backward pass per draw of labels for the whole batch, ||sum_i sqrt(w_i) g_i||^2 / W. Unbiased
  because sampled-label gradients have zero mean (sum_y p(y) grad log p(y) = 0) and are independent across i, so
  E||sum_i a_i||^2 = sum_i E||a_i||^2. Cheaper, noisier (cross terms), and wrong for true labels.
The empirical Fisher (true labels, `empirical_fisher_trace`) uses the per-sample form.
Population over several batches = mean of per-batch values, as in `hutchinson_trace`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flatlm.flatness.estimates import (
    GroupFn,
    TraceEstimate,
    acc_dtype,
    batch_list,
    group_dots,
    hashable,
    param_groups,
    summarize,
)
from flatlm.models.losses import sample_labels

ApplyFn = Callable[..., jax.Array]  # apply_fn({"params": params}, tokens, deterministic=True) -> logits[B, T, V]
Batch = dict[str, Any]


def _logits_fn(apply_fn: ApplyFn, tokens_BT) -> Callable:
    return lambda p: apply_fn({"params": p}, tokens_BT, deterministic=True)


def fisher_surrogate_loss(params, batch: Batch, apply_fn: ApplyFn) -> jax.Array:
    """(1/W) sum_i w_i sum_y sg(p_y) (-log p_y): its Hessian is exactly the model Fisher F at `params`.

    The Hessian of -log p_y is J^T (diag p - p p^T) J + sum_k (p_k - [k = y]) grad^2 logit_k; averaging over
    y ~ sg(p) removes the second term, leaving the Gauss-Newton / Fisher matrix.
    """
    logits_BTV = _logits_fn(apply_fn, batch["tokens"])(params)
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(acc_dtype(logits_BTV)), axis=-1)
    q_BTV = jax.lax.stop_gradient(jnp.exp(logp_BTV))
    w_BT = batch["weights"].astype(logp_BTV.dtype)
    return -jnp.sum(w_BT[..., None] * q_BTV * logp_BTV) / jnp.maximum(jnp.sum(w_BT), 1.0)


def fisher_vp(apply_fn: ApplyFn, params, batch: Batch, v):
    """F v, F the model Fisher (= Gauss-Newton matrix) of the batch's weighted MLM loss; PSD, for `hutchpp_trace`.

    One forward, one Jacobian-vector product, one transposed (backward) product.
    """
    logits_BTV, jvp_fn = jax.linearize(_logits_fn(apply_fn, batch["tokens"]), params)
    v = jax.tree.map(lambda p, t: jnp.asarray(t, p.dtype), params, v)
    acc = acc_dtype(logits_BTV)
    jv_BTV = jvp_fn(v).astype(acc)
    p_BTV = jax.nn.softmax(logits_BTV.astype(acc), axis=-1)
    w_BT = batch["weights"].astype(acc)
    w_BT = w_BT / jnp.maximum(jnp.sum(w_BT), 1.0)
    ct_BTV = w_BT[..., None] * p_BTV * (jv_BTV - jnp.sum(p_BTV * jv_BTV, axis=-1, keepdims=True))
    (fv,) = jax.linear_transpose(jvp_fn, params)(ct_BTV.astype(logits_BTV.dtype))
    return fv


def exact_fisher_trace(
    apply_fn: ApplyFn, params, batches, *, labels: str = "model", groups: GroupFn | str | None = None
) -> TraceEstimate:
    """Tr F by enumerating every label: (1/W) sum_i w_i sum_y p_i(y) ||grad log p_i(y)||^2 (stderr 0).

    labels="true" gives the empirical Fisher (1/W) sum_i w_i ||grad log p_i(target_i)||^2. Builds the full
    Jacobian of the log-probabilities [B, T, V, P]: tiny models only.
    """
    if labels not in ("model", "true"):
        raise ValueError(f"labels must be 'model' or 'true', got {labels!r}")
    names, ids = param_groups(params, groups)

    @jax.jit
    def per_group(p, batch):
        f = lambda q: jax.nn.log_softmax(_logits_fn(apply_fn, batch["tokens"])(q), axis=-1)
        logp_BTV = f(p)
        jac = jax.jacrev(f)(p)
        sq = [jnp.sum(jnp.square(j), axis=tuple(range(3, j.ndim))) for j in jax.tree.leaves(jac)]
        V = logp_BTV.shape[-1]
        if labels == "model":
            pw_BTV = jnp.exp(logp_BTV)
        else:
            pw_BTV = jax.nn.one_hot(batch["targets"], V, dtype=logp_BTV.dtype)
        w_BT = batch["weights"].astype(logp_BTV.dtype)
        coef_BTV = w_BT[..., None] * pw_BTV / jnp.maximum(jnp.sum(w_BT), 1.0)
        out = [jnp.zeros((), logp_BTV.dtype)] * len(names)
        for s, g in zip(sq, ids):
            out[g] = out[g] + jnp.sum(coef_BTV * s)
        return jnp.stack(out)

    bs = batch_list(batches)
    per = np.mean([np.asarray(per_group(params, b)) for b in bs], axis=0)
    return TraceEstimate(
        mean=float(per.sum()), stderr=0.0, num_samples=0, method=f"exact_fisher_{labels}", num_batches=len(bs),
        per_group=dict(zip(names, map(float, per))), per_group_stderr=dict.fromkeys(names, 0.0),
    )


def split_positions(batch: Batch, pad_multiple: int | None = None) -> Batch:
    """One row per weighted position (host-side numpy): row r keeps its source row's tokens and targets and
    weights only position r. Padded with zero-weight rows to a multiple of `pad_multiple` (default: the batch size)
    to bound recompilation."""
    w_BT = np.asarray(batch["weights"])
    B, T = w_BT.shape
    rows, cols = np.nonzero(w_BT > 0)
    n = rows.size
    mult = pad_multiple or B
    N = max(1, -(-n // mult)) * mult
    src = np.zeros(N, np.int64)
    src[:n] = rows
    w_NT = np.zeros((N, T), w_BT.dtype)
    w_NT[np.arange(n), cols] = w_BT[rows, cols]
    return {"tokens": np.asarray(batch["tokens"])[src], "targets": np.asarray(batch["targets"])[src], "weights": w_NT}


def _score_cotangent(logits_TV, coef_T, y_T):
    """d/dlogits of sum_t coef_t log softmax(logits_t)[y_t] = coef_t (onehot(y_t) - p_t)."""
    acc = acc_dtype(logits_TV)
    p_TV = jax.nn.softmax(logits_TV.astype(acc), axis=-1)
    ct = coef_T[..., None].astype(acc) * (jax.nn.one_hot(y_T, logits_TV.shape[-1], dtype=acc) - p_TV)
    return ct.astype(logits_TV.dtype)


def fisher_trace(
    apply_fn: ApplyFn,
    params,
    batches: Batch | Iterable[Batch],
    key: jax.Array,
    *,
    num_draws: int = 50,
    method: str = "per_sample",
    labels: str = "model",
    chunk_size: int = 8,
    draw_chunk_size: int = 1,
    groups: GroupFn | str | None = None,
) -> TraceEstimate:
    """Tr of the Fisher of the MLM loss (paper Appendix B.1), with standard error and per-group traces.

    batches: MLM batches (weights mark the contexts' masked positions); `num_draws` labels per context are drawn
      from the model (paper: 10000 contexts x 50 draws). method: "per_sample" (per-(context, draw) gradients) or
      "summed" (one backward per draw for the whole batch). labels="true": empirical Fisher (per-sample only,
      no draws). chunk_size: contexts vmapped at once in the per-sample form (memory ~ chunk_size parameter
      copies for their per-example gradients; 8 is also about the fastest on CPU); draw_chunk_size: draws vmapped
      at once (the rest scanned).
    Within a batch the samples are the draws (contexts for the empirical Fisher), so `probe_stderr` is the
    label-sampling error and `data_std` the spread across batches; see TraceEstimate.
    """
    if method not in ("per_sample", "summed"):
        raise ValueError(f"method must be 'per_sample' or 'summed', got {method!r}")
    if labels not in ("model", "true"):
        raise ValueError(f"labels must be 'model' or 'true', got {labels!r}")
    if labels == "true" and method == "summed":
        raise ValueError("the summed form is biased for true labels (their gradients do not have zero mean); "
                         "use method='per_sample' for the empirical Fisher")
    names, ids = param_groups(params, groups)
    S = 1 if labels == "true" else int(num_draws)
    static = dict(apply_fn=hashable(apply_fn), num_draws=S, draw_chunk=max(1, min(draw_chunk_size, S)),
                  leaf_ids=tuple(ids))
    samples = []
    for b, batch in enumerate(batch_list(batches)):
        W = float(np.sum(np.asarray(batch["weights"], np.float64)))
        if W <= 0:
            continue
        kb = jax.random.fold_in(key, b)
        if method == "summed":
            coef = jnp.sqrt(jnp.asarray(batch["weights"]))
            samples.append(np.asarray(_summed_stats(params, batch["tokens"], coef, kb, **static)) / W)
            continue
        ctx = split_positions(batch)
        coef = np.sqrt(ctx["weights"])
        B = ctx["tokens"].shape[0]
        sq_BSG = np.asarray(_per_sample_stats(params, ctx["tokens"], coef, ctx["targets"], kb, **static,
                                              labels=labels, chunk=max(1, min(chunk_size, B))))
        if labels == "model":
            samples.append(sq_BSG.sum(axis=0) / W)  # one sample per draw
        else:
            real = ctx["weights"].sum(axis=1) > 0  # one sample per context, scaled so the mean is the batch value
            samples.append(sq_BSG[real, 0] * (real.sum() / W))
    if not samples:
        raise ValueError("no weighted (masked) positions in any batch")
    kind = "empirical_fisher" if labels == "true" else f"fisher_{method}"
    return summarize(samples, names, method=kind)


@functools.partial(jax.jit, static_argnames=("apply_fn", "num_draws", "draw_chunk", "leaf_ids", "labels", "chunk"))
def _per_sample_stats(params, tokens_BT, coef_BT, targets_BT, key, *, apply_fn, num_draws, draw_chunk, leaf_ids,
                      labels, chunk):
    """[B, S, G] squared norms per group of g_{row, draw} = sum_t coef_t grad log p(y_t | row)."""
    G = max(leaf_ids) + 1

    def row(args):
        tokens_T, coef_T, target_T, i = args
        logits_TV, vjp_fn = jax.vjp(lambda q: _logits_fn(apply_fn, tokens_T[None])(q)[0], params)
        rk = jax.random.fold_in(key, i)

        def draw(s):
            y_T = target_T if labels == "true" else sample_labels(jax.random.fold_in(rk, s), logits_TV)
            (g,) = vjp_fn(_score_cotangent(logits_TV, coef_T, y_T))
            return group_dots(g, g, leaf_ids, G)

        return jax.lax.map(draw, jnp.arange(num_draws), batch_size=draw_chunk)

    xs = (tokens_BT, coef_BT, targets_BT, jnp.arange(tokens_BT.shape[0]))
    return jax.lax.map(row, xs, batch_size=chunk)


@functools.partial(jax.jit, static_argnames=("apply_fn", "num_draws", "draw_chunk", "leaf_ids"))
def _summed_stats(params, tokens_BT, coef_BT, key, *, apply_fn, num_draws, draw_chunk, leaf_ids):
    """[S, G] squared norms per group of G_s = sum_i coef_i grad log p(y_i^(s)), one backward per draw s."""
    G = max(leaf_ids) + 1
    logits_BTV, vjp_fn = jax.vjp(_logits_fn(apply_fn, tokens_BT), params)

    def draw(s):
        y_BT = sample_labels(jax.random.fold_in(key, s), logits_BTV)
        (g,) = vjp_fn(_score_cotangent(logits_BTV, coef_BT, y_BT))
        return group_dots(g, g, leaf_ids, G)

    return jax.lax.map(draw, jnp.arange(num_draws), batch_size=draw_chunk)


def empirical_fisher_trace(
    apply_fn: ApplyFn, params, batches, *, chunk_size: int = 8, groups: GroupFn | str | None = None
) -> TraceEstimate:
    """(1/W) sum_i w_i ||grad CE_i||^2 with the true labels; samples are contexts (stderr over contexts)."""
    return fisher_trace(apply_fn, params, batches, jax.random.key(0), method="per_sample", labels="true",
                        chunk_size=chunk_size, groups=groups)
