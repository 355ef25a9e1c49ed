"""Online training of the SCB linear transformer (`flatlm.models.linear_attention`): fresh sentences every step,
the squared loss, plain SGD or SGD followed by the l1 proximal step on A (`flatlm.train.prox.l1_proximal`, the sparse
attention patterns; V is left unpenalised).

Both keep V on the affine set 1^T V = 1^T (columns summing to 1, as P's do; the update's column means are removed,
an exact projection when the start is on the set): y_hat is invariant under V -> cV, A -> A / c, and without that
constraint the l1 penalty drives A -> 0 while V grows. With it, 1^T y_hat = the column sum of A at x_T, which the loss
pins near 1; so the l1 shrinkage of A's support is paid back through every entry of the column, the off-support ones
included (measured: off-support entries of A end larger under prox than under SGD, no exact zeros at lam <= 3e-3),
and at lam = 1e-2 the column sums of A settle near 0.5: prox finds the support early, then drifts off the truth
(configs/experiments/README.md "SCB"; `prox_samples` switches to SGD after a proximal phase). Logs, every
`log_every` steps, the sample count and the gauge-fixed Frobenius distances of V and A to the ground truth, and stops
once `distance` = sqrt(dV^2 + dA^2) <= `target`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flatlm.models import linear_attention as la
from flatlm.train.prox import l1_proximal

METHODS = ("sgd", "prox")


@dataclasses.dataclass(frozen=True)
class LinearTrainConfig:
    """method "sgd" | "prox"; lr of SGD; lam the l1 weight of the proximal step on A; prox_samples > 0: "prox" only
    for the first that many sentences, plain SGD after (the l1 bias gone once the support is found); batch_size
    fresh sentences per step; max_samples the budget; log_every steps between distance measurements; target the
    distance to stop at (0: run the whole budget); seed of the sentences."""

    method: str = "sgd"
    lr: float = 1.0
    lam: float = 1e-3
    prox_samples: int = 0
    batch_size: int = 64
    max_samples: int = 200_000
    log_every: int = 25
    target: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.lr <= 0 or self.lam < 0 or self.batch_size < 1 or self.log_every < 1:
            raise ValueError("lr > 0, lam >= 0, batch_size >= 1 and log_every >= 1 are required")


def column_sums_kept() -> optax.GradientTransformation:
    """Remove each column's mean from the update of a matrix, so that its column sums stay where they are."""
    return optax.stateless(lambda updates, params=None: jax.tree.map(lambda u: u - u.mean(0, keepdims=True), updates))


def optimizer(cfg: LinearTrainConfig) -> optax.GradientTransformation:
    """SGD (V's column sums kept), then for "prox" prox_{lr lam ||A||_1} on A."""
    sgd = optax.chain(optax.sgd(cfg.lr), optax.masked(column_sums_kept(), {"V": True, "A": False}))
    if cfg.method == "sgd":
        return sgd
    return optax.chain(sgd, optax.masked(l1_proximal(cfg.lam, cfg.lr), {"V": False, "A": True}))


@functools.partial(jax.jit, static_argnums=0)
def _chunk(opt: optax.GradientTransformation, params, opt_state, tokens_KBL):
    """K steps of `opt` on the squared loss, one batch tokens_KBL[k] each; returns the mean batch loss."""
    def step(carry, tokens_BL):
        p, s = carry
        loss, grads = jax.value_and_grad(la.squared_loss)(p, {"tokens": tokens_BL})
        updates, s = opt.update(grads, s, p)
        return (optax.apply_updates(p, updates), s), loss

    (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), tokens_KBL)
    return params, opt_state, jnp.mean(losses)


def distance(d: dict) -> float:
    """sqrt(dV^2 + dA^2) of a `distance_to_truth` result."""
    return float(np.hypot(d["V"], d["A"]))


def train(scb, params, cfg: LinearTrainConfig) -> tuple[dict, list[dict]]:
    """Train from `params` on fresh samples of `scb`; returns (final params, rows). Row 0 is the start; each row has
    samples (sentences seen), loss (mean squared loss of the chunk's batches), dist_V, dist_A, distance."""
    opt = optimizer(cfg)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    opt_state = opt.init(params)
    rows = [_row(0, float("nan"), params, scb)]
    chunk = cfg.log_every * cfg.batch_size
    for i in range(-(-cfg.max_samples // chunk)):
        if cfg.method == "prox" and 0 < cfg.prox_samples <= i * chunk and i * chunk < cfg.prox_samples + chunk:
            opt = optimizer(dataclasses.replace(cfg, method="sgd"))  # the proximal phase is over
            opt_state = opt.init(params)
        tokens = scb.sample(chunk, seed=cfg.seed * 1_000_003 + i).tokens
        params, opt_state, loss = _chunk(opt, params, opt_state,
                                         tokens.reshape(cfg.log_every, cfg.batch_size, -1))
        rows.append(_row((i + 1) * chunk, float(loss), params, scb))
        if not np.isfinite(rows[-1]["distance"]) or rows[-1]["distance"] <= cfg.target:
            break
    return params, rows


def _row(samples: int, loss: float, params, scb) -> dict:
    d = la.distance_to_truth(jax.device_get(params), scb)
    return {"samples": samples, "loss": loss, "dist_V": d["V"], "dist_A": d["A"], "distance": distance(d)}


def samples_to_target(rows: list[dict], target: float) -> int | None:
    """The first logged sample count whose distance is <= target (None if never within the run)."""
    return next((r["samples"] for r in rows if r["distance"] <= target), None)
