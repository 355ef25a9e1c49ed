"""Hessian-vector products and trace estimators for any `loss_fn(params) -> scalar` over a parameter pytree.

- `hvp` is forward-over-reverse (`jax.jvp` of `jax.grad`): pytree in, pytree out, jit- and sharding-friendly.
- `hutchinson_trace` streams data batches and probe chunks, so memory stays at a few parameter copies, and reports
  mean, standard error (probe and data noise apart), per-group traces and Tr(H^2), all from the same products.
- `hutchpp_trace` (Hutch++) for positive semi-definite operators such as the Fisher / Gauss-Newton matrix.
- `exact_trace` from the Hessian's columns (HVPs on unit vectors, chunked by the parameter count; refused above
  `EXACT_MAX_PARAMS`), `exact_hessian` via `jax.hessian` on the raveled parameters (tiny models and tests).
- `fisher_trace` (re-exported from `flatlm.flatness.fisher`): the paper's Appendix B.1 estimator.

Probes: probe i of data batch b uses key fold_in(fold_in(key, b), i), and each parameter tensor folds in its own
leaf index (`probe_like`), so tensors get independent probes; each device generates only its own shard of every
probe, and the values do not depend on the mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from flatlm.errors import UserError
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
from flatlm.flatness.fisher import (  # noqa: F401  (public re-exports: flatlm.flatness.hessian.fisher_trace)
    empirical_fisher_trace,
    exact_fisher_trace,
    fisher_trace,
    fisher_vp,
)
from flatlm.sharding import keep_layout, layout, one_at_a_time, place_like, stacked_shardings

Params = Any  # a pytree of float arrays (plain nested dict for flatlm models)
LossFn = Callable[..., jax.Array]  # loss_fn(params) or loss_fn(params, batch) -> scalar
MatvecFn = Callable[..., Params]  # matvec(params, v) or matvec(params, v, batch) -> A v


def _mix32(x: jax.Array) -> jax.Array:
    """lowbias32 (C. Wellons): a bijective avalanche mixer on uint32."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _hash_bits(seed_2: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32[shape] keyed by seed_2 (2 x uint32) at every element's linear index.

    Elementwise in broadcasted iotas, so a sharded consumer makes each device hash only its own shard.
    """
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
        stride *= shape[d]
    x = _mix32(idx ^ seed_2[0])
    x = _mix32(x + seed_2[1])
    return _mix32(x ^ (seed_2[0] * jnp.uint32(0x9E3779B9)))


def _leaf_seeds(key: jax.Array, num_leaves: int) -> jax.Array:
    """uint32[num_leaves, 2]: fold_in(key, i) for every leaf index i, in one vectorised threefry call."""
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(num_leaves, dtype=jnp.uint32))
    return jax.random.key_data(keys).reshape(num_leaves, -1)[:, :2].astype(jnp.uint32)


def probe_like(key: jax.Array, params: Params, kind: str = "rademacher", shardings: Any = None) -> Params:
    """A random probe with the structure, shapes and dtypes of `params`; E[v] = 0, E[v v^T] = I.

    kind: "rademacher" (+-1, the minimum-variance Hutchinson probe) or "gaussian" (N(0, 1), as in the released
    code; 24-bit inverse-CDF, so |v| < 5.4). Leaf i is keyed by fold_in(key, i), so tensors get independent
    probes; within a leaf, element j is a keyed hash of (leaf key, j). (Not jax.random's per-tensor threefry: one
    threefry kernel per tensor costs ~0.5 s of XLA compile on CPU, ~100 s for a 12-layer BERT; the hash fuses
    into the consumer.) The values do not depend on the mesh, and each device generates only its own shard.
    `shardings` (optional pytree of shardings matching params) pins each probe to its parameter's layout.
    """
    return _probe_jit(key, params, kind, _shard_leaves(params, shardings))


def _shard_leaves(params: Params, shardings: Any) -> tuple | None:
    """Per-leaf shardings as a hashable tuple (a static jit argument), or None."""
    if shardings is None:
        return None
    return tuple(jax.tree.structure(params).flatten_up_to(shardings))


def _probe(key: jax.Array, params: Params, kind: str, shard: tuple | None) -> Params:
    if kind not in ("rademacher", "gaussian"):
        raise ValueError(f"kind must be 'rademacher' or 'gaussian', got {kind!r}")
    leaves, treedef = jax.tree.flatten(params)
    shard = shard if shard is not None else (None,) * len(leaves)
    seeds = _leaf_seeds(key, len(leaves))
    out = []
    for i, (x, s) in enumerate(zip(leaves, shard)):
        bits = _hash_bits(seeds[i], tuple(x.shape))
        acc = jnp.promote_types(x.dtype, jnp.float32)
        if kind == "rademacher":
            v = (1 - 2 * (bits >> 31).astype(jnp.int32)).astype(acc)
        else:
            u = ((bits >> 8).astype(acc) + 0.5) * (2.0**-24)
            v = jnp.sqrt(2.0).astype(acc) * jax.lax.erf_inv(2 * u - 1)
        v = v.astype(x.dtype)
        out.append(v if s is None else jax.lax.with_sharding_constraint(v, s))
    return treedef.unflatten(out)


_probe_jit = jax.jit(_probe, static_argnames=("kind", "shard"))


def _like(params: Params, v: Params) -> Params:
    return jax.tree.map(lambda p, t: jnp.asarray(t, p.dtype), params, v)


def hvp(loss_fn: Callable[[Params], jax.Array], params: Params, v: Params) -> Params:
    """H v for H the Hessian of `loss_fn` at `params` (forward-over-reverse; costs ~2-3 gradients)."""
    return jax.jvp(jax.grad(loss_fn), (params,), (_like(params, v),))[1]


def hvp_fn(loss_fn: Callable[[Params], jax.Array], params: Params) -> Callable[[Params], Params]:
    """v -> H v with the gradient's primal pass done once (`jax.linearize`), for many products at one point.

    Each product then costs only the tangent pass; the residuals (activations of forward and backward) are kept.
    On a mesh the product is laid out as `params` (traced inside a jit: its layout is otherwise XLA's choice).
    """
    _, lin = jax.linearize(jax.grad(loss_fn), params)
    kept = layout(params)
    return lambda v: keep_layout(lin(_like(params, v)), kept)


def _as_loss(loss_fn: LossFn, batch) -> Callable[[Params], jax.Array]:
    return (lambda p: loss_fn(p)) if batch is None else (lambda p: loss_fn(p, batch))


def exact_hessian(loss_fn: LossFn, params: Params, batches: Iterable | None = None):
    """(H [P, P], unravel) for the mean over batches of loss_fn, via `jax.hessian` on the raveled parameters.

    P is the total parameter count: only for tiny models.
    """
    flat, unravel = ravel_pytree(params)

    @jax.jit
    def hess(x, batch):
        return jax.hessian(lambda y: _as_loss(loss_fn, batch)(unravel(y)))(x)

    bs = batch_list(batches)
    H = sum(hess(flat, b) for b in bs) / len(bs)
    return H, unravel


EXACT_MAX_PARAMS = 200_000  # `exact_trace` refuses more parameters: P Hessian-vector products per batch
EXACT_CHUNK_BYTES = 2**28  # `exact_trace` sizes its chunk of Hessian columns to ~this many bytes of columns


def exact_chunk_size(num_params: int, max_bytes: int = EXACT_CHUNK_BYTES) -> int:
    """How many Hessian columns `exact_trace` computes at once for `num_params` parameters: about `max_bytes` of
    float32 columns counting 4 parameter-sized buffers per column (column, tangent, gradient, cotangent), 1..256.
    (`jax.hessian` computes all P at once: P x (activations + P) floats, 904 GB for a 475k-parameter model.)"""
    return int(max(1, min(256, num_params, max_bytes // (16 * num_params))))


def exact_trace(
    loss_fn: LossFn, params: Params, *, batches: Iterable | None = None, groups: GroupFn | str | None = None,
    chunk_size: int | None = None, max_params: int = EXACT_MAX_PARAMS,
) -> TraceEstimate:
    """Exact Tr(H) (stderr 0) with per-group traces and Tr(H^2) = ||H||_F^2, from the Hessian's columns H e_i
    (Hessian-vector products on unit vectors), `chunk_size` columns at a time (default `exact_chunk_size(P)`), so
    memory stays at a chunk of columns whatever P. P products per batch: more than `max_params` parameters is
    refused (UserError naming the limit; `hutchinson_trace` estimates the same trace from a few products)."""
    flat, unravel = ravel_pytree(params)
    P = int(flat.size)
    if P > max_params:
        raise UserError(f"the exact Hessian trace takes one Hessian-vector product per parameter and this model has "
                         f"{P:,} (limit {max_params:,}); use --method hutchinson (the same trace, estimated) or a "
                         "smaller model")
    c = chunk_size or exact_chunk_size(P)
    bs = batch_list(batches)
    names, ids = param_groups(params, groups)
    group_of = np.concatenate([np.full(np.size(x), g) for x, g in zip(jax.tree.leaves(params), ids)])
    diag, sq = np.zeros(P), 0.0
    for start in range(0, P, c):  # a chunk of columns of H = the mean over batches of their Hessians
        cols = sum(_exact_block(flat, b, start, loss_fn=loss_fn, unravel=unravel, chunk=c) for b in bs) / len(bs)
        n = min(c, P - start)
        diag[start:start + n] = np.asarray(cols[jnp.arange(n), start + jnp.arange(n)])
        sq += float(jnp.sum(cols * cols))
    per = np.bincount(group_of, weights=diag, minlength=len(names))
    return TraceEstimate(
        mean=float(per.sum()), stderr=0.0, num_samples=0, method="exact", num_batches=len(bs),
        per_group=dict(zip(names, map(float, per))), per_group_stderr=dict.fromkeys(names, 0.0),
        trace_sq=sq, trace_sq_stderr=0.0,
    )


@functools.partial(jax.jit, static_argnames=("loss_fn", "unravel", "chunk"))
def _exact_block(flat, batch, start, *, loss_fn, unravel, chunk):
    """Columns start..start+chunk of the batch's Hessian ([chunk, P]; rows past P are zero)."""
    E = jax.nn.one_hot(start + jnp.arange(chunk), flat.size, dtype=flat.dtype)
    g = jax.grad(lambda y: _as_loss(loss_fn, batch)(unravel(y)))
    return jax.vmap(lambda e: jax.jvp(g, (flat,), (e,))[1])(E)


def hutchinson_trace(
    loss_fn: LossFn,
    params: Params,
    key: jax.Array,
    num_probes: int,
    *,
    batches: Iterable | None = None,
    kind: str = "rademacher",
    chunk_size: int = 1,
    groups: GroupFn | str | None = None,
    shardings: Any = None,
    linearize: bool = True,
) -> TraceEstimate:
    """Hutchinson estimate of Tr(H), H the Hessian of the population loss, with Tr(H^2) and per-group traces.

    loss_fn: `loss_fn(params)` (batches=None) or `loss_fn(params, batch)` with `batches` an iterable of batches
      (streamed once); the population loss is the mean over batches, and every batch gets `num_probes` fresh probes.
    Samples are v.Hv (per group v_g.(Hv)_g, which sum to v.Hv) and ||Hv||^2 (E = Tr(H^2)), all from the same
    products. Probes are processed `chunk_size` at a time (vmapped), the chunks scanned. linearize=True runs the
    gradient's primal pass once per batch and keeps its residuals (forward and backward intermediates), so each
    probe costs only the tangent pass (~2 gradients instead of ~2.7); linearize=False recomputes it per chunk and
    keeps only one chunk's activations. Parameter-sized buffers: the gradient, and probe and product per probe in
    the chunk. Units: those of the loss per unit parameter squared.
    """
    if num_probes < 1:
        raise ValueError(f"num_probes must be >= 1, got {num_probes}")
    names, ids = param_groups(params, groups)
    static = dict(loss_fn=hashable(loss_fn), num_probes=int(num_probes), kind=kind,
                  chunk=max(1, min(chunk_size, num_probes)), leaf_ids=tuple(ids),
                  shard=_shard_leaves(params, shardings), linearize=bool(linearize))
    outs = [one_at_a_time(_hutchinson_stats(params, b, jax.random.fold_in(key, i), **static))
            for i, b in enumerate(batch_list(batches))]
    z = [np.asarray(z) for z, _ in outs]
    return summarize(z, names, method=f"hutchinson_{kind}", sq_samples=[np.asarray(s) for _, s in outs])


@functools.partial(
    jax.jit, static_argnames=("loss_fn", "num_probes", "kind", "chunk", "leaf_ids", "shard", "linearize"))
def _hutchinson_stats(params, batch, key, *, loss_fn, num_probes, kind, chunk, leaf_ids, shard, linearize=True):
    """(v.Hv per group [P, G], ||Hv||^2 [P]) for probes 0..P-1 of one batch (module-level: compiled once)."""
    f = _as_loss(loss_fn, batch)
    lin = hvp_fn(f, params) if linearize else functools.partial(hvp, f, params)
    G = max(leaf_ids) + 1

    def one(i):
        v = _probe(jax.random.fold_in(key, i), params, kind, shard)
        hv = lin(v)
        return group_dots(v, hv, leaf_ids, G), group_dots(hv, hv, leaf_ids, G).sum()

    return jax.lax.map(one, jnp.arange(num_probes), batch_size=chunk)


def _tree_gram(a: Params, b: Params) -> jax.Array:
    """[k, l] matrix of dot products between stacked pytrees a [k, ...] and b [l, ...]."""
    terms = [
        jnp.einsum("i...,j...->ij", x.astype(acc_dtype(x)), y.astype(acc_dtype(x)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    ]
    return functools.reduce(jnp.add, terms)


def _tree_combine(coef_KL: jax.Array, a: Params) -> Params:
    """Stacked pytree with entry j = sum_i coef[i, j] a_i."""
    return jax.tree.map(lambda x: jnp.einsum("ij,i...->j...", coef_KL.astype(x.dtype), x), a)


def _orthonormalize(y: Params) -> Params:
    """Orthonormal basis (stacked, same count; directions below the rounding level become zero) of span(y).

    Gram-matrix eigendecomposition done twice, so it stays in pytree form (and sharded) instead of raveling.
    """
    for _ in range(2):
        gram = _tree_gram(y, y)
        lam, U = jnp.linalg.eigh(gram)
        tol = jnp.max(lam) * jnp.finfo(lam.dtype).eps * 10 * gram.shape[0]
        inv = jnp.where(lam > tol, 1.0 / jnp.sqrt(jnp.where(lam > tol, lam, 1.0)), 0.0)
        y = _tree_combine(U * inv[None, :], y)
    return y


@functools.partial(jax.jit, static_argnames=("k", "kind", "kept"))
def _probe_stack(key: jax.Array, params: Params, k: int, kind: str, kept: tuple | None) -> Params:
    """k probes (`probe_like` with keys fold_in(key, i)) stacked [k, ...] per leaf, made in the layout `kept`
    (`flatlm.sharding.layout` form; None: XLA's): each device draws only its part of the stack."""
    stack = jax.vmap(lambda i: probe_like(jax.random.fold_in(key, i), params, kind))(jnp.arange(k))
    return keep_layout(stack, kept)


@jax.jit
def mean_of_trees(trees: list):
    """Leafwise mean of pytrees of one structure (per-batch products) in one dispatch: eager, it compiled an add
    and a divide per leaf shape on first use (~2 s of a small model's first Lanczos or Hutch++ call on CPU)."""
    return jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)


def mean_over_batches(product: Callable, batches: Sequence):
    """Mean over `batches` of `product(batch)` (a pytree or an array): one batch's product itself, else
    `mean_of_trees`. Each product is waited for on several CPU devices or processes, where programs with
    collectives in flight at once deadlocked (`flatlm.sharding.one_at_a_time`)."""
    out = [one_at_a_time(product(b)) for b in batches]
    return out[0] if len(out) == 1 else mean_of_trees(out)


def hutchpp_trace(
    matvec: MatvecFn,
    params: Params,
    key: jax.Array,
    num_matvecs: int,
    *,
    batches: Sequence | None = None,
    kind: str = "rademacher",
    chunk_size: int = 1,
    groups: GroupFn | str | None = None,
) -> TraceEstimate:
    """Hutch++ (Meyer et al. 2021) estimate of Tr(A), A = mean over batches of a symmetric PSD operator.

    matvec: `matvec(params, v)` (batches=None) or `matvec(params, v, batch)` -> A v, e.g.
      `lambda p, v, b: fisher_vp(apply_fn, p, b, v)`. k = num_matvecs // 3 probes: Tr(Q^T A Q) exactly on an
    orthonormal basis Q of A S, plus Hutchinson on the rest, samples g.A(I - QQ^T)g with fresh probes g; the
    standard error is that of the rest given Q. (Projecting only on the right keeps every per-group trace
    v_g.(Av)_g unbiased for Tr(A_gg), so the groups still sum to the total.) Makes 3 passes over `batches` (k
    products each) and keeps about 4k stacked parameter copies, split over the params' mesh
    (`flatlm.sharding.stacked_spec`).
    """
    k = max(1, num_matvecs // 3)
    names, ids = param_groups(params, groups)
    G = len(names)
    bs = batch_list(batches)
    chunk = max(1, min(chunk_size, k))

    @jax.jit
    def apply_batch(p, vs, batch):
        f = (lambda v: matvec(p, v)) if batch is None else (lambda v: matvec(p, v, batch))
        return jax.lax.map(f, vs, batch_size=chunk)

    def apply(vs):
        vs = place_like(params, vs, stacked=True)  # deflate's output too
        return mean_over_batches(lambda b: apply_batch(params, vs, b), bs)

    # every stack made or placed in one layout (`flatlm.sharding.stacked_spec`: split over the whole mesh, so each
    # device holds 1/D of the copies even for replicated data-parallel params): each program compiles once
    sh = stacked_shardings(params)
    kept = None if sh is None else (jax.tree.structure(params), tuple(jax.tree.leaves(sh)))
    S, Gp = (place_like(params, _probe_stack(jax.random.fold_in(key, i), params, k=k, kind=kind, kept=kept),
                        stacked=True) for i in (0, 1))
    Q = place_like(params, jax.jit(_orthonormalize)(apply(S)), stacked=True)

    @jax.jit
    def deflate(q, g):
        return jax.tree.map(jnp.subtract, g, _tree_combine(_tree_gram(q, g), q))

    AQ, AG = apply(Q), apply(deflate(Q, Gp))  # same stack shape as S: one compilation

    @jax.jit
    def per_sample_dots(a, b):
        return jax.vmap(lambda x, y: group_dots(x, y, ids, G))(a, b)

    low = np.asarray(per_sample_dots(Q, AQ)).sum(axis=0)
    return summarize([np.asarray(per_sample_dots(Gp, AG))], names, method="hutchpp", offset_per_group=low,
                     num_batches=len(bs))
