"""SGD for the Section 6 check, optionally with an explicit Tr(H) penalty or label noise: `TrainConfig`, the
penalised objective and the jitted scan of steps (`run_steps`). `flatlm.theory.dyck.train` runs these steps from a
Gaussian init and logs the population quantities between them.

The default penalty is the Gauss-Newton part 2 E||grad f||^2 of Tr(H), which equals Tr(H) on the zero-loss
set (the set Theorem 6.1 minimises Tr(H) over; Appendix D.1) and is bounded below; "hutchinson" (Rademacher
probes) and "exact" penalise the full Tr(H), which is indefinite away from minima.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from flatlm.errors import UserError
from flatlm.languages import dyck as lang
from flatlm.models import dyck as model

Params = model.Params
Batch = lang.Batch

PENALTY_METHODS = ("gauss_newton", "hutchinson", "exact")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """SGD on mini-batches of the pre-training population. lr is per unit of width: the step is lr * m * grad
    (the 1/m output scaling makes raw gradients O(1/m)). penalty > 0 adds penalty * Tr(H) of the mini-batch loss:
    "gauss_newton" (default) its PSD part 2 E||grad f||^2, equal to Tr(H) on the zero-loss set and bounded below
    (the full Tr(H) is indefinite away from minima, so penalising it can run off to negative curvature);
    "hutchinson" the full Tr(H) with `penalty_probes` Rademacher probes; "exact" the full Tr(H) (tiny models).
    batch_size 0 means full-batch GD on the whole (weighted) population. label_noise > 0 is label-noise SGD: every
    step adds fresh N(0, label_noise^2) noise to the mini-batch's labels, i.e. SGD with fresh samples of the
    noisy-label Dyck task y + eps, whose minimisers are still f = E[y | x] = g* (the clean zero-loss set) but whose
    loss there is label_noise^2 > 0, so the gradient noise does not vanish at the optimum (Section 4's mechanism;
    its covariance, 4 label_noise^2 E[grad f grad f^T] / B, is proportional to Tr(H)'s matrix there)."""

    steps: int = 3000
    lr: float = 0.02
    batch_size: int = 64
    penalty: float = 0.0
    penalty_method: str = "gauss_newton"
    penalty_probes: int = 4
    log_every: int = 100
    d_attn: int = 0
    v_std: float = 1.0
    u_std: float = 1.0
    qk_std: float = 0.1
    label_noise: float = 0.0


def check_penalty_method(method: str) -> None:
    """Raise UserError unless `method` is one of PENALTY_METHODS."""
    if method not in PENALTY_METHODS:
        raise UserError(f"penalty method {method!r} is unknown; use one of {', '.join(PENALTY_METHODS)}")


def gauss_newton(params: Params, mb: Batch) -> jax.Array:
    """2 sum_b w_b ||grad_theta f(x_b)||^2 as a differentiable scalar (PSD part of Tr(H); equal at zero loss)."""
    grads = jax.vmap(jax.grad(lambda p, x: model.apply(p, x[None])[0]), in_axes=(None, 0))(params, mb["x"])
    sq_B = sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in jax.tree.leaves(grads))
    return 2.0 * jnp.sum(mb["w"] * sq_B)


def _objective(params, mb, key, cfg: TrainConfig):
    """The mini-batch loss plus cfg.penalty * Tr(H) by cfg.penalty_method (`key` draws Hutchinson's probes)."""
    base = model.loss(params, mb)
    if cfg.penalty <= 0:
        return base
    if cfg.penalty_method == "gauss_newton":
        return base + cfg.penalty * gauss_newton(params, mb)
    flat, unravel = ravel_pytree(params)
    f = model.flat_loss(unravel, mb)
    if cfg.penalty_method == "exact":
        diag = jax.vmap(lambda e: e @ jax.jvp(jax.grad(f), (flat,), (e,))[1])
        tr = jnp.sum(diag(jnp.eye(flat.shape[0], dtype=flat.dtype)))
    else:
        v_KP = jax.random.rademacher(key, (cfg.penalty_probes, flat.shape[0]), flat.dtype)
        tr = jnp.mean(jax.vmap(lambda v: v @ jax.jvp(jax.grad(f), (flat,), (v,))[1])(v_KP))
    return base + cfg.penalty * tr


@functools.partial(jax.jit, static_argnames=("cfg",))
def run_steps(params: Params, keys: jax.Array, data: Batch, cfg: TrainConfig) -> Params:
    """len(keys) SGD steps on mini-batches drawn uniformly (with replacement) from `data` (the whole weighted
    population when cfg.batch_size is 0: full-batch GD), labels noised when cfg.label_noise > 0; one dispatch."""
    n_all, m, bs = data["x"].shape[0], params["u"].shape[0], cfg.batch_size

    def step(params, key):
        k_idx, k_pen, k_noise = jax.random.split(key, 3)
        if bs == 0:
            mb = {"x": data["x"], "y": data["y"], "w": data["w"]}
        else:
            idx = jax.random.randint(k_idx, (bs,), 0, n_all)
            mb = {"x": data["x"][idx], "y": data["y"][idx], "w": jnp.full((bs,), 1.0 / bs, data["x"].dtype)}
        if cfg.label_noise > 0:
            mb["y"] = mb["y"] + cfg.label_noise * jax.random.normal(k_noise, mb["y"].shape, mb["y"].dtype)
        grads = jax.grad(_objective)(params, mb, k_pen, cfg)
        return jax.tree.map(lambda p, g: p - cfg.lr * m * g, params, grads), None

    return jax.lax.scan(step, params, keys)[0]

