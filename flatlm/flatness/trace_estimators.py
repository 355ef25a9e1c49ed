"""Trace estimators at a fixed budget of matrix-vector products, for comparing their errors at equal cost.

Each takes `loss_fn(params) -> scalar` and `params` (the operator is the Hessian), or `loss_fn(params, batch)`
with `batches` (the Hessian of the mean loss over the batches; the standard error is then the estimator's own,
these batches held fixed), or any symmetric `matvec(v) -> A v` over parameter pytrees; a budget `num_matvecs`
and a PRNG key. Each returns a `TraceEstimate` (mean, standard error, `num_samples` = the products used):

- `hutchinson`: m Rademacher probes, samples v.Av; also Tr(A^2) = E ||Av||^2 from the same products
  (`trace_sq`, with its standard error).
- `hutchpp`: Hutch++ (Meyer, Musco, Musco & Woodruff, "Hutch++: Optimal Stochastic Trace Estimation", SOSA 2021,
  Algorithm 1): Q = orth(A S) from m/3 sign vectors S, then Tr(Q^T A Q) exactly (m/3 products) plus Hutchinson
  on the deflated P A P, P = I - Q Q^T, with m/3 fresh sign vectors. The standard error is that of the deflated
  part given Q. (`flatlm.flatness.hessian.hutchpp_trace` is the streamed, per-group variant that projects on one
  side only; this one is the paper's symmetric form.)
- `xtrace`: XTrace (Epperly, Tropp & Webber, "XTrace: Making the most of every sample in stochastic trace
  estimation", SIAM J. Matrix Anal. Appl., 2024): m/2 test vectors omega_i; for each i, Q_(i) =
  orth(A Omega_{-i}) from the other vectors and the exchangeable estimate
  tr_i = Tr(Q_(i)^T A Q_(i)) + omega_i^T (I - Q_(i) Q_(i)^T) A (I - Q_(i) Q_(i)^T) omega_i; XTrace is the mean of
  the tr_i and its standard error their std / sqrt(m/2), as in the paper. All m/2 leave-one-out bases come from one
  QR of Y = A Omega by rank-one downdating: Q_(i) Q_(i)^T = Q (I - s_i s_i^T) Q^T, s_i the normalised i-th row of
  R^-1 (Q s_i is the unit vector of range(Y) orthogonal to the other columns), so the cost is m products and
  O(n m^2) flops. Test vectors: "sphere" (default, the paper's improved estimator: uniform on the sphere of
  radius sqrt(n), and the Hutchinson term rescaled by (n - m/2 + 1) / ||(I - Q_(i)Q_(i)^T) omega_i||^2, which
  keeps it unbiased since the projected direction is uniform on the complement's sphere) or "rademacher" (plain).
  XTrace needs A Omega of full column rank: a budget above twice the operator's rank is refused.

Vectors are raveled to [n] and stacked as rows ([m, n]), so memory is m parameter copies: for Hessians of models
that fit a few dozen copies of their parameters. Products are computed `chunk_size` at a time (vmapped); a Hessian
product is forward-over-reverse (`hessian.hvp`, the primal recomputed per chunk). The compiled product is cached
on the `loss_fn` / `matvec` object, so pass the same one for repeated estimates.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flatlm.flatness.estimates import TraceEstimate, hashable
from flatlm.flatness.hessian import hvp, mean_over_batches
from flatlm.sharding import replicate_like

Params = Any
MatVec = Callable[[Params], Params]


@functools.lru_cache(maxsize=16)
def _matmat(fn: Callable, is_loss: bool, treedef, shapes: tuple, chunk: int) -> Callable:
    """Jitted (params, X[m, n], batch) -> (A x_j)_j [m, n] on the structure (treedef, shapes): A the Hessian of
    `fn(params)` (batch None) or `fn(params, batch)` (is_loss; forward-over-reverse `hvp`) or the pytree operator
    `fn(v)`. Cached on `fn`'s identity, so
    repeated estimates with one loss or operator compile once per stack shape; params are an argument (no
    constants baked into the program)."""
    sizes = [math.prod(s) for _, s in shapes]
    offsets = np.cumsum([0, *sizes])

    def unravel(x_N):
        return treedef.unflatten([x_N[a:b].reshape(s).astype(d) for (d, s), a, b in zip(shapes, offsets, offsets[1:])])

    def apply(p, X_MN, batch):
        loss = fn if batch is None else (lambda q: fn(q, batch))

        def one(x_N):
            y = hvp(loss, p, unravel(x_N)) if is_loss else fn(unravel(x_N))
            return jnp.concatenate([jnp.ravel(t).astype(x_N.dtype) for t in jax.tree.leaves(y)])

        return jax.lax.map(one, X_MN, batch_size=chunk)

    return jax.jit(apply)


def operator(loss_fn: Callable[..., jax.Array] | None, params: Params, matvec: MatVec | None = None,
             chunk_size: int = 8, batches=None) -> tuple[Callable[[jax.Array], jax.Array], int, jnp.dtype]:
    """(matmat over stacked raveled vectors [m, n] -> [m, n], n, dtype) for the Hessian at `params` of
    `loss_fn(params)`, or with `batches` (a batch or a sequence) of the mean over batches of `loss_fn(params,
    batch)` (one pass over the batches per matmat); or for `matvec` when given (then `loss_fn` may be None)."""
    leaves, treedef = jax.tree.flatten(params)
    shapes = tuple((jnp.dtype(x.dtype), tuple(x.shape)) for x in leaves)
    n = int(sum(math.prod(s) for _, s in shapes))
    dtype = jnp.result_type(*(jnp.promote_types(d, jnp.float32) for d, _ in shapes))
    if matvec is None and loss_fn is None:
        raise ValueError("give loss_fn or matvec")
    if matvec is not None and batches is not None:
        raise ValueError("batches go with loss_fn(params, batch), not with a matvec")
    mm = _matmat(hashable(matvec or loss_fn), matvec is None, treedef, shapes, max(1, int(chunk_size)))
    bs = [None] if batches is None else [batches] if isinstance(batches, dict) else list(batches)

    def matmat(X_MN):
        X_MN = replicate_like(params, X_MN)  # a fresh stack on the params' mesh, as the products are: one compile
        return mean_over_batches(lambda b: mm(params, X_MN, b), bs)

    return matmat, n, dtype


def _signs(key: jax.Array, m: int, n: int, dtype) -> jax.Array:
    return jax.random.rademacher(key, (m, n), dtype)


def _estimate(samples: np.ndarray, method: str, offset: float = 0.0, used: int = 0, sq=None) -> TraceEstimate:
    s = np.asarray(samples, np.float64)
    se = float(s.std(ddof=1) / np.sqrt(s.size)) if s.size > 1 else float("nan")
    sq_mean = sq_se = None
    if sq is not None:
        q = np.asarray(sq, np.float64)
        sq_mean, sq_se = float(q.mean()), float(q.std(ddof=1) / np.sqrt(q.size)) if q.size > 1 else float("nan")
    return TraceEstimate(mean=float(s.mean()) + offset, stderr=se, num_samples=used or s.size, method=method,
                         probe_stderr=se, sample_std=float(s.std(ddof=1)) if s.size > 1 else None,
                         trace_sq=sq_mean, trace_sq_stderr=sq_se)


def hutchinson(loss_fn, params: Params, key: jax.Array, num_matvecs: int, *, matvec: MatVec | None = None,
               chunk_size: int = 8, batches=None) -> TraceEstimate:
    """Hutchinson with `num_matvecs` Rademacher probes: Tr(A) = E v.Av and Tr(A^2) = E ||Av||^2 (`trace_sq`)."""
    mm, n, dtype = operator(loss_fn, params, matvec, chunk_size, batches)
    V_MN = _signs(key, max(1, num_matvecs), n, dtype)
    AV_MN = mm(V_MN)
    z, sq = _hutchinson_samples(V_MN, AV_MN)
    return _estimate(np.asarray(z), "hutchinson", sq=np.asarray(sq))


@jax.jit
def _hutchinson_samples(V_MN, AV_MN):
    return jnp.sum(V_MN * AV_MN, axis=1), jnp.sum(AV_MN * AV_MN, axis=1)


def hutchpp(loss_fn, params: Params, key: jax.Array, num_matvecs: int, *, matvec: MatVec | None = None,
            chunk_size: int = 8, batches=None) -> TraceEstimate:
    """Hutch++ with k = num_matvecs // 3 sketch, basis and deflated-Hutchinson products each (3k in all)."""
    k = num_matvecs // 3
    if k < 2:
        raise ValueError(f"Hutch++ needs num_matvecs >= 6 (3 x 2 products), got {num_matvecs}")
    mm, n, dtype = operator(loss_fn, params, matvec, chunk_size, batches)
    k_s, k_g = jax.random.split(key)
    S_KN, G_KN = _signs(k_s, k, n, dtype), _signs(k_g, k, n, dtype)
    Q_KN = _orth_rows(mm(S_KN))
    low = float(jnp.sum(Q_KN * mm(Q_KN)))  # Tr(Q^T A Q)
    PG_KN = _deflate(Q_KN, G_KN)
    z = jnp.sum(PG_KN * mm(PG_KN), axis=1)  # g^T P A P g
    return _estimate(np.asarray(z), "hutchpp", offset=low, used=3 * k)


@jax.jit
def _orth_rows(Y_KN):
    """Orthonormal rows spanning the rows of Y (Householder QR: orthonormal even if Y is rank deficient)."""
    return jnp.linalg.qr(Y_KN.T)[0].T


@jax.jit
def _deflate(Q_KN, G_KN):
    return G_KN - (G_KN @ Q_KN.T) @ Q_KN


def xtrace(loss_fn, params: Params, key: jax.Array, num_matvecs: int, *, matvec: MatVec | None = None,
           kind: str = "sphere", chunk_size: int = 8, batches=None) -> TraceEstimate:
    """XTrace with m = num_matvecs // 2 test vectors (2m products: A Omega and A Q); kind "sphere" (the paper's
    improved estimator) or "rademacher". Refuses a budget above twice the operator's numerical rank."""
    m = num_matvecs // 2
    if m < 2:
        raise ValueError(f"XTrace needs num_matvecs >= 4 (2 x 2 products), got {num_matvecs}")
    if kind not in ("sphere", "rademacher"):
        raise ValueError(f"kind must be 'sphere' or 'rademacher', got {kind!r}")
    mm, n, dtype = operator(loss_fn, params, matvec, chunk_size, batches)
    if m >= n:
        raise ValueError(f"XTrace needs num_matvecs // 2 < n = {n}, got {num_matvecs}")
    if kind == "sphere":
        G_MN = jax.random.normal(key, (m, n), dtype)
        Om_MN = np.sqrt(n) * G_MN / jnp.linalg.norm(G_MN, axis=1, keepdims=True)
    else:
        Om_MN = _signs(key, m, n, dtype)
    Y_MN = mm(Om_MN)
    Q_MN, R_MM = _qr_rows(Y_MN)
    d = np.abs(np.diag(np.asarray(R_MM)))
    if d.min() <= 100 * np.finfo(np.dtype(dtype)).eps * d.max():
        raise ValueError(f"A Omega is rank deficient (the operator's rank is below num_matvecs // 2 = {m}): "
                         "use fewer products for XTrace")
    ests = _xtrace_ests(Om_MN, Q_MN, R_MM, mm(Q_MN), kind == "sphere")
    return _estimate(np.asarray(ests), f"xtrace_{kind}", used=2 * m)


@jax.jit
def _qr_rows(Y_MN):
    """Y^T = Q R with Q [n, m] orthonormal, as (Q^T [m, n], R [m, m])."""
    Q_NM, R_MM = jnp.linalg.qr(Y_MN.T)
    return Q_NM.T, R_MM


@functools.partial(jax.jit, static_argnames=("improved",))
def _xtrace_ests(Om_MN, Q_MN, R_MM, Z_MN, improved):
    """The m exchangeable estimates tr_i from Omega, Y = A Omega = Q R and Z = A Q (column i of a matrix below
    is vector i; all m x m).

    With W = Q^T Omega, H = Q^T A Q, T = Z^T Omega (= Q^T A^T Omega), sigma_i = s_i.w_i and
    c_i = (I - s_i s_i^T) w_i (the coordinates of Q_(i) Q_(i)^T omega_i in the basis Q):
      Tr(Q_(i)^T A Q_(i)) = Tr(H) - s_i^T H s_i
      p_i^T A p_i for p_i = omega_i - Q c_i: omega_i^T y_i - t_i.c_i - c_i.r_i + c_i^T H c_i, with
      omega_i^T y_i = w_i.r_i (y_i lies in range(Q)), so it is c_i^T H c_i - t_i.c_i - c_i.r_i + w_i.r_i.
    The sphere version multiplies the second part by (n - m + 1) / ||p_i||^2, ||p_i||^2 = n - |w_i|^2 + sigma_i^2.
    """
    n = Om_MN.shape[1]
    m = Om_MN.shape[0]
    W = Q_MN @ Om_MN.T
    H = Q_MN @ Z_MN.T
    T = Z_MN @ Om_MN.T
    Rinv = jax.scipy.linalg.solve_triangular(R_MM, jnp.eye(m, dtype=R_MM.dtype), lower=False)
    S = Rinv.T / jnp.linalg.norm(Rinv, axis=1)[None, :]  # column i: row i of R^-1, normalised
    sigma = jnp.sum(S * W, axis=0)
    C = W - S * sigma[None, :]
    low = jnp.trace(H) - jnp.sum(S * (H @ S), axis=0)
    quad = (jnp.sum(C * (H @ C), axis=0) - jnp.sum(T * C, axis=0) - jnp.sum(C * R_MM, axis=0)
            + jnp.sum(W * R_MM, axis=0))
    if improved:
        quad = quad * (n - m + 1) / (n - jnp.sum(W * W, axis=0) + sigma**2)
    return low + quad
