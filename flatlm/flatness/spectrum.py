"""The Hessian's spectrum beyond its trace, from Hessian-vector products of any `loss_fn(params) -> scalar`.

- `lanczos`: m steps of the Lanczos iteration on a symmetric matvec over parameter pytrees, with full
  reorthogonalisation (the basis is kept, m parameter copies), giving the tridiagonal T_m.
- `top_eigenvalues`: the k largest Ritz values of T_m with their residual bounds |beta_m * s_mi| (a Ritz value
  is within its bound of an eigenvalue of H); one HVP per step.
- `power_iteration`: the top eigenvalue by repeated HVPs, the independent check of Lanczos's largest value
  (it converges to the eigenvalue of largest magnitude).
- `spectral_density`: stochastic Lanczos quadrature (Ubaru, Chen & Saad 2017; Ghorbani et al. 2019): for each
  of P random unit probes v, the Gauss quadrature nodes theta_j (Ritz values) and weights tau_j^2 (squared first
  components of T_m's eigenvectors) give v^T f(H) v ~ sum_j tau_j^2 f(theta_j). Over probes,
  n * mean(sum_j tau_j^2 theta_j^p) estimates Tr(H^p) (exactly, in expectation, for p < 2m), and a Gaussian
  smoothing of the nodes is the density plotted by `Density.curve`.
Eigenvalues and densities are in the units of the loss's curvature (nats per unit^2 of parameter), like Tr(H).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flatlm.flatness import flat
from flatlm.flatness.hessian import hvp_fn, probe_like
from flatlm.sharding import keep_layout, layout, one_at_a_time, place_like

Params = object
MatVec = Callable[[Params], Params]


def _dot(a: Params, b: Params) -> float:
    return float(sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)))


def _scale(alpha: float, x: Params) -> Params:
    return jax.tree.map(lambda xi: alpha * xi, x)


def _start(key: jax.Array, params: Params) -> Params:
    """A Rademacher start vector laid out as `params` (on their mesh when they are jax Arrays), so that it and the
    products the matvec returns share one layout and each jitted step compiles once, not once per layout."""
    leaves = jax.tree.leaves(params)
    if not all(isinstance(x, jax.Array) for x in leaves):
        return probe_like(key, params)
    return probe_like(key, params, shardings=jax.tree.map(lambda x: x.sharding, params))


def num_params(params: Params) -> int:
    """Number of scalars in a parameter pytree (n, the Hessian's dimension)."""
    return int(sum(np.size(x) for x in jax.tree.leaves(params)))


def lanczos(matvec: MatVec, v0: Params, num_iters: int) -> tuple[np.ndarray, np.ndarray]:
    """(alpha[m], beta[m]) of T_m from `num_iters` Lanczos steps started at `v0` (normalised here); beta[-1] is
    the residual norm after the last step (0 if the Krylov space was exhausted early, then m < num_iters).

    Each step is the three-term recurrence w = Hv - alpha v - beta v_prev followed by full reorthogonalisation
    against the kept basis: one classical Gram-Schmidt pass, and a second only when the first removed more than
    1 - 1/sqrt(2) of w's norm (Daniel, Gragg, Kaufman & Stewart 1976; "twice is enough"), decided on the device.
    Vectors are raveled to one array and the basis kept as a fixed [num_iters, N] stack (unused rows zero), so a
    pass is two matrix products of one shape (compiled once); on a mesh both are split along N over every device
    (`flatlm.flatness.flat`: each device holds 1/D of the basis). All steps are dispatched without a host round
    trip (on an accelerator a round trip per step would idle it between products; on several CPU devices each step
    is waited for: `flatlm.sharding.one_at_a_time`) and (alpha, beta) read once at the end; an early breakdown
    (beta ~ 0) truncates them there: steps after it are wasted work, never a result."""
    sp = flat.space(v0)
    ravel, unravel = flat.ravellers(sp)
    mv = lambda x: ravel(matvec(unravel(x)))
    v, v_prev, beta, B_MN = _lanczos_start(ravel(v0), num_iters, sp)
    kept = layout((v, B_MN))  # every step's vector and basis where the first step's are: one compile of each program
    coefs = []
    for i in range(num_iters):
        alpha, beta, v_next, B_MN = one_at_a_time(_lanczos_step(B_MN, v, v_prev, beta, mv(v), i, kept=kept))
        coefs.append((alpha, beta))
        v_prev, v = v, v_next
    alphas, betas = np.asarray(jax.device_get(coefs), np.float64).T
    scale = np.maximum.accumulate(np.maximum(np.abs(alphas), betas))  # the operator's size seen so far
    stop = next((i for i, b in enumerate(betas) if b <= 1e-10 * scale[i]), num_iters - 1)
    return alphas[: stop + 1], betas[: stop + 1]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _lanczos_start(flat0_N, num_iters: int, sp: flat.Space):
    """The unit start vector, a zero previous vector and beta, and the empty basis [num_iters, N], in the space's
    layout (as the steps' outputs are: one compile of `_lanczos_step`, not three)."""
    v_N = flat0_N / jnp.linalg.norm(flat0_N)
    B_MN = flat.constrain(sp, jnp.zeros((num_iters, v_N.size), v_N.dtype), stacked=True)
    return v_N, flat.constrain(sp, jnp.zeros_like(v_N)), jnp.zeros((), v_N.dtype), B_MN


@functools.partial(jax.jit, donate_argnums=0, static_argnames="kept")
def _lanczos_step(B_MN, v_N, v_prev_N, beta_prev, w_N, i, kept=None):
    """The basis with v as row i (written in place: the basis is donated); alpha = w.v; w - alpha v - beta_prev
    v_prev reorthogonalised against the basis; beta = |w|; the next vector w / beta. One dispatch per step. (The
    row is written before the basis is read, not after: a write after the reorthogonalisation's conditional read
    made XLA copy the whole basis every step.) `kept`: `flatlm.sharding.layout` of (v, basis) to keep them in (on
    a multi-device mesh XLA laid the outputs out its own way: this step and the products compiled twice)."""
    B_MN = jax.lax.dynamic_update_index_in_dim(B_MN, v_N, i, 0)
    alpha = jnp.vdot(w_N, v_N)
    w_N = w_N - alpha * v_N - beta_prev * v_prev_N
    w_N, beta = _reorthogonalise(B_MN, w_N)
    v_next_N, B_MN = keep_layout((w_N / jnp.where(beta > 0, beta, 1.0), B_MN), kept)
    return alpha, beta, v_next_N, B_MN


def _reorthogonalise(B_MN, w_N):
    """w minus its projection on the rows of B (orthonormal or zero), and its norm: one classical Gram-Schmidt
    pass, repeated once if it shrank w below 1/sqrt(2) of its norm (cancellation: the first pass's result
    then carries rounding errors along B that a second pass removes; DGKS)."""
    def one_pass(w):
        w = w - (B_MN @ w) @ B_MN
        return w, jnp.linalg.norm(w)

    norm0 = jnp.linalg.norm(w_N)
    w_N, norm1 = one_pass(w_N)
    return jax.lax.cond(norm1 < norm0 / math.sqrt(2.0), one_pass, lambda w: (w, norm1), w_N)


def _ritz(alphas: np.ndarray, betas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (ascending) and eigenvectors of the tridiagonal T_m."""
    m = len(alphas)
    T = np.diag(alphas) + np.diag(betas[: m - 1], 1) + np.diag(betas[: m - 1], -1)
    return np.linalg.eigh(T)


@dataclasses.dataclass(frozen=True)
class TopEigenvalues:
    """The k largest Ritz values (descending), each within `residual` of an eigenvalue of H; `num_matvecs` HVPs
    computed."""

    values: np.ndarray
    residual: np.ndarray
    num_matvecs: int

    def to_dict(self) -> dict:
        """JSON-able form for results.json."""
        return {"values": self.values.tolist(), "residual": self.residual.tolist(), "num_matvecs": self.num_matvecs}


def top_eigenvalues(loss_fn: Callable[[Params], jax.Array], params: Params, key: jax.Array, k: int = 5,
                    num_iters: int | None = None, matvec: MatVec | None = None) -> TopEigenvalues:
    """The k largest eigenvalues of the Hessian of `loss_fn` at `params` by Lanczos from a Rademacher start.

    num_iters defaults to k + 5 (k = 20 in 25 HVPs); `matvec` replaces the HVP (e.g. a Fisher-vector product).
    Distinct eigenvalues, largest first (algebraic, not by magnitude): a single start vector sees one direction of
    each eigenspace, so an exactly repeated eigenvalue comes back once and fewer than k values can come back
    when the Krylov space is exhausted (in exact arithmetic; float32 rounding may resolve copies)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    mv = matvec or jax.jit(hvp_fn(loss_fn, params))
    m = min(num_iters or k + 5, num_params(params))
    alphas, betas = lanczos(mv, _start(key, params), m)
    theta, S = _ritz(alphas, betas)
    order = np.argsort(theta)[::-1][:k]
    return TopEigenvalues(theta[order], np.abs(betas[-1] * S[-1, order]), m)  # m HVPs ran, whatever was kept


def power_iteration(loss_fn: Callable[[Params], jax.Array], params: Params, key: jax.Array, num_iters: int = 200,
                    tol: float = 1e-7, matvec: MatVec | None = None) -> tuple[float, int]:
    """(eigenvalue of largest magnitude, HVPs used): v <- Hv / |Hv| until the Rayleigh quotient moves by at most
    tol of itself between two iterations (relative, so a Hessian of any scale converges alike; an audit found the
    old absolute floor and a start at 0 returning after one HVP when the first quotient, ~Tr(H) / n, was near 0)."""
    mv = matvec or jax.jit(hvp_fn(loss_fn, params))
    v = _start(key, params)
    v = _scale(1.0 / np.sqrt(_dot(v, v)), v)
    value = None
    for i in range(1, num_iters + 1):
        w = mv(v)
        new, norm = _dot(w, v), np.sqrt(_dot(w, w))
        if norm == 0:  # H v = 0: v is in the null space (a zero Hessian)
            return 0.0, i
        v = _scale(1.0 / norm, w)
        if value is not None and abs(new - value) <= tol * abs(new):
            return new, i
        value = new
    return value, num_iters


@dataclasses.dataclass(frozen=True)
class Density:
    """Stochastic Lanczos quadrature: nodes[P, m] and weights[P, m] (each row sums to 1) of P probes, dim n."""

    nodes: np.ndarray
    weights: np.ndarray
    dim: int

    def moment(self, p: int) -> tuple[float, float]:
        """(estimate, standard error over probes) of Tr(H^p) = n * E_v[v^T H^p v] for unit v."""
        per_probe = self.dim * np.sum(self.weights * self.nodes ** p, axis=1)
        se = per_probe.std(ddof=1) / np.sqrt(len(per_probe)) if len(per_probe) > 1 else float("nan")
        return float(per_probe.mean()), float(se)

    def curve(self, grid: np.ndarray, sigma: float | None = None) -> np.ndarray:
        """Density of eigenvalues on `grid` (integrates to ~1): the nodes smoothed by Gaussians of width `sigma`
        (default: 1% of the node range)."""
        span = float(self.nodes.max() - self.nodes.min()) or 1.0
        s = sigma or 0.01 * span
        g = np.exp(-0.5 * ((grid[None, None, :] - self.nodes[..., None]) / s) ** 2) / (s * np.sqrt(2 * np.pi))
        return np.sum(self.weights[..., None] * g, axis=(0, 1)) / len(self.nodes)

    def to_dict(self) -> dict:
        """JSON-able form for results.json."""
        return {"nodes": self.nodes.tolist(), "weights": self.weights.tolist(), "dim": self.dim}


def spectral_density(loss_fn: Callable[[Params], jax.Array], params: Params, key: jax.Array, num_probes: int = 8,
                     num_iters: int = 30, matvec: MatVec | None = None) -> Density:
    """SLQ over `num_probes` Rademacher probes of `num_iters` Lanczos steps each (probes * iters HVPs)."""
    mv = matvec or jax.jit(hvp_fn(loss_fn, params))
    m = min(num_iters, num_params(params))
    nodes = np.zeros((num_probes, m))
    weights = np.zeros((num_probes, m))
    for i in range(num_probes):
        alphas, betas = lanczos(mv, _start(jax.random.fold_in(key, i), params), m)
        theta, S = _ritz(alphas, betas)
        nodes[i, : len(theta)], weights[i, : len(theta)] = theta, S[0] ** 2
    return Density(nodes, weights, num_params(params))


def adam_edge_of_stability(lr: float, b1: float = 0.9) -> float:
    """The preconditioned sharpness Adam hovers near at the edge of stability, 2 (1 + b1) / ((1 - b1) lr)
    (Cohen et al. 2022): 38 / lr for b1 = 0.9. A sanity check for `preconditioned_sharpness` on Adam runs."""
    return 2.0 * (1.0 + b1) / ((1.0 - b1) * lr)


@jax.jit
def _inverse_sqrt_preconditioner(nu: Params, corr: float, eps: float) -> Params:
    """P^-1/2 = 1 / sqrt(sqrt(nu / corr) + eps) leafwise, one dispatch (jitted, as `_multiply_trees`: eager tree
    maps compiled each op once per leaf shape, seconds of a small model's first call on CPU)."""
    return jax.tree.map(lambda x: 1.0 / jnp.sqrt(jnp.sqrt(x / corr) + eps), nu)


@jax.jit
def _multiply_trees(a: Params, b: Params) -> Params:
    return jax.tree.map(jnp.multiply, a, b)


def preconditioned_sharpness(loss_fn: Callable[[Params], jax.Array], params: Params, second_moment: Params,
                             key: jax.Array, *, b2: float = 0.999, step: int = 0, eps: float = 1e-8,
                             num_iters: int = 20, matvec: MatVec | None = None) -> TopEigenvalues:
    """Top eigenvalue of P^-1 H for Adam's preconditioner P = diag(sqrt(nu_hat) + eps) by Lanczos on the similar
    symmetric P^-1/2 H P^-1/2 (same eigenvalues). `second_moment` is Adam's nu (optax's `ScaleByAdamState.nu`),
    bias-corrected by 1 - b2^step when `step` > 0; compare with `adam_edge_of_stability(lr, b1)`. `matvec`
    replaces the HVP of `loss_fn` (e.g. `compare.hessian_matvec` over several batches)."""
    corr = 1.0 - b2 ** step if step > 0 else 1.0
    inv_sqrt_p = _inverse_sqrt_preconditioner(second_moment, corr, eps)
    hv = matvec or jax.jit(hvp_fn(loss_fn, params))

    def matvec(v):  # both products' inputs as the params are laid out: each program compiles once on any mesh
        u = hv(_multiply_trees(inv_sqrt_p, place_like(params, v)))
        return _multiply_trees(inv_sqrt_p, place_like(params, u))

    return top_eigenvalues(loss_fn, params, key, k=1, num_iters=num_iters, matvec=matvec)
