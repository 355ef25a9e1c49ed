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

Vectors are raveled to [n] and stacked as rows ([m, n]), so memory is m parameter copies, split over the devices of
the params' mesh (`flatlm.flatness.flat`: each holds 1/D of every stack, n zero-padded to a multiple of D): for
Hessians of models that fit a few dozen copies of their parameters over the mesh. Products are computed
`chunk_size` at a time (vmapped); a Hessian product is forward-over-reverse (`hessian.hvp`, the primal
recomputed per chunk). The compiled product is cached on the `loss_fn` / `matvec` object, so pass the same one
for repeated estimates.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flatlm.flatness import flat
from flatlm.flatness.estimates import TraceEstimate, batch_list, hashable
from flatlm.flatness.hessian import hvp, mean_over_batches

Params = Any
MatVec = Callable[[Params], Params]


@functools.lru_cache(maxsize=16)
def _matmat(fn: Callable, is_loss: bool, sp: flat.Space, chunk: int) -> Callable:
    """Jitted (params, X[m, size], batch) -> (A x_j)_j [m, size] in the raveled space `sp` of the params: A the
    Hessian of `fn(params)` (batch None) or `fn(params, batch)` (is_loss; forward-over-reverse `hvp`) or the pytree
    operator `fn(v)`. Cached on `fn`'s identity, so repeated estimates with one loss or operator compile once per
    stack shape; params are an argument (no constants baked into the program)."""

    def apply(p, X_MN, batch):
        loss = fn if batch is None else (lambda q: fn(q, batch))

        def one(x_N):
            v = flat.unravel(sp, x_N)
            return flat.ravel(sp, hvp(loss, p, v) if is_loss else fn(v))

        return flat.constrain(sp, jax.lax.map(one, X_MN, batch_size=chunk), stacked=True)

    return jax.jit(apply)


def operator(loss_fn: Callable[..., jax.Array] | None, params: Params, matvec: MatVec | None = None,
             chunk_size: int = 8, batches=None) -> tuple[Callable[[jax.Array], jax.Array], flat.Space]:
    """(matmat, space): matmat maps stacked raveled vectors [m, space.size] to their products (a stack [m, n]
    made elsewhere is padded and placed first: `flat.put`), for the Hessian at `params` of `loss_fn(params)`, or
    with `batches` (a batch or a sequence) of the mean over batches of `loss_fn(params, batch)` (one pass over
    the batches per matmat); or for `matvec` when given (then `loss_fn` may be None). On a mesh the stacks are
    split along n over every device (`flatlm.flatness.flat`), so each holds 1/D of them."""
    if matvec is None and loss_fn is None:
        raise ValueError("give loss_fn or matvec")
    if matvec is not None and batches is not None:
        raise ValueError("batches go with loss_fn(params, batch), not with a matvec")
    sp = flat.space(params)
    mm = _matmat(hashable(matvec or loss_fn), matvec is None, sp, max(1, int(chunk_size)))
    bs = batch_list(batches)

    def matmat(X_MN):
        X_MN = flat.put(sp, X_MN)  # a fresh stack in the products' layout: one compile
        return mean_over_batches(lambda b: mm(params, X_MN, b), bs)

    return matmat, sp


def _estimate(samples: np.ndarray, method: str, offset: float = 0.0, used: int = 0, sq=None,
              batches=None) -> TraceEstimate:
    """The estimate from m exchangeable samples (probe error only); `batches`: those the operator averages."""
    s = np.asarray(samples, np.float64)
    se = float(s.std(ddof=1) / np.sqrt(s.size)) if s.size > 1 else float("nan")
    sq_mean = sq_se = None
    if sq is not None:
        q = np.asarray(sq, np.float64)
        sq_mean, sq_se = float(q.mean()), float(q.std(ddof=1) / np.sqrt(q.size)) if q.size > 1 else float("nan")
    return TraceEstimate(mean=float(s.mean()) + offset, stderr=se, num_samples=used or s.size, method=method,
                         num_batches=len(batch_list(batches)), probe_stderr=se,
                         sample_std=float(s.std(ddof=1)) if s.size > 1 else None,
                         trace_sq=sq_mean, trace_sq_stderr=sq_se)


def hutchinson(loss_fn, params: Params, key: jax.Array, num_matvecs: int, *, matvec: MatVec | None = None,
               chunk_size: int = 8, batches=None) -> TraceEstimate:
    """Hutchinson with `num_matvecs` Rademacher probes: Tr(A) = E v.Av and Tr(A^2) = E ||Av||^2 (`trace_sq`)."""
    mm, sp = operator(loss_fn, params, matvec, chunk_size, batches)
    V_MN = flat.draw(key, sp, max(1, num_matvecs))
    AV_MN = mm(V_MN)
    z, sq = _hutchinson_samples(V_MN, AV_MN)
    return _estimate(np.asarray(z), "hutchinson", sq=np.asarray(sq), batches=batches)


@jax.jit
def _hutchinson_samples(V_MN, AV_MN):
    return jnp.sum(V_MN * AV_MN, axis=1), jnp.sum(AV_MN * AV_MN, axis=1)


def hutchpp(loss_fn, params: Params, key: jax.Array, num_matvecs: int, *, matvec: MatVec | None = None,
            chunk_size: int = 8, batches=None) -> TraceEstimate:
    """Hutch++ with k = num_matvecs // 3 sketch, basis and deflated-Hutchinson products each (3k in all)."""
    k = num_matvecs // 3
    if k < 2:
        raise ValueError(f"Hutch++ needs num_matvecs >= 6 (3 x 2 products), got {num_matvecs}")
    mm, sp = operator(loss_fn, params, matvec, chunk_size, batches)
    k_s, k_g = jax.random.split(key)
    S_KN, G_KN = flat.draw(k_s, sp, k), flat.draw(k_g, sp, k)
    Q_KN = flat.qr_rows(mm(S_KN), sp)[0]
    low = float(jnp.sum(Q_KN * mm(Q_KN)))  # Tr(Q^T A Q)
    PG_KN = _deflate(Q_KN, G_KN)
    z = jnp.sum(PG_KN * mm(PG_KN), axis=1)  # g^T P A P g
    return _estimate(np.asarray(z), "hutchpp", offset=low, used=3 * k, batches=batches)


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
    mm, sp = operator(loss_fn, params, matvec, chunk_size, batches)
    if m >= sp.n:
        raise ValueError(f"XTrace needs num_matvecs // 2 < n = {sp.n}, got {num_matvecs}")
    Om_MN = flat.draw(key, sp, m, "normal" if kind == "sphere" else "rademacher")
    if kind == "sphere":
        Om_MN = _to_sphere(Om_MN, sp.n)
    Y_MN = mm(Om_MN)
    Q_MN, R_MM = flat.qr_rows(Y_MN, sp)
    d = np.abs(np.diag(np.asarray(R_MM)))
    if d.min() <= 100 * np.finfo(np.dtype(sp.dtype)).eps * d.max():
        raise ValueError(f"A Omega is rank deficient (the operator's rank is below num_matvecs // 2 = {m}): "
                         "use fewer products for XTrace")
    ests = _xtrace_ests(Om_MN, Q_MN, R_MM, mm(Q_MN), kind == "sphere", sp.n)
    return _estimate(np.asarray(ests), f"xtrace_{kind}", used=2 * m, batches=batches)


@functools.partial(jax.jit, static_argnames="n")
def _to_sphere(G_MN, n: int):
    """Each row rescaled to norm sqrt(n) (n the unpadded dimension): Gaussian rows become uniform on that sphere."""
    return np.sqrt(n) * G_MN / jnp.linalg.norm(G_MN, axis=1, keepdims=True)


@functools.partial(jax.jit, static_argnames=("improved", "n"))
def _xtrace_ests(Om_MN, Q_MN, R_MM, Z_MN, improved, n):
    """The m exchangeable estimates tr_i from Omega, Y = A Omega = Q R and Z = A Q (column i of a matrix below
    is vector i; all m x m).

    With W = Q^T Omega, H = Q^T A Q, T = Z^T Omega (= Q^T A^T Omega), sigma_i = s_i.w_i and
    c_i = (I - s_i s_i^T) w_i (the coordinates of Q_(i) Q_(i)^T omega_i in the basis Q):
      Tr(Q_(i)^T A Q_(i)) = Tr(H) - s_i^T H s_i
      p_i^T A p_i for p_i = omega_i - Q c_i: omega_i^T y_i - t_i.c_i - c_i.r_i + c_i^T H c_i, with
      omega_i^T y_i = w_i.r_i (y_i lies in range(Q)), so it is c_i^T H c_i - t_i.c_i - c_i.r_i + w_i.r_i.
    The sphere version multiplies the second part by (n - m + 1) / ||p_i||^2, ||p_i||^2 = n - |w_i|^2 + sigma_i^2.
    """
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
