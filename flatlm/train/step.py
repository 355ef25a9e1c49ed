"""The pure, module-level train step. `jax.jit` it once with explicit shardings (see loop.py)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax

from flatlm.models.losses import mlm_loss

# objective(params, batch, apply_fn, dropout_key) -> (loss, aux_metrics_dict)
Objective = Callable[..., tuple[jax.Array, dict]]


def mlm_objective(params, batch, apply_fn, dropout_key):
    """The plain MLM objective for `train_step`: (mean masked cross-entropy in nats, no aux)."""
    return mlm_loss(params, batch, apply_fn, dropout_key), {}


def train_step(state: dict, batch: dict, *, apply_fn, optimizer: optax.GradientTransformation, seed: int,
               objective: Objective = mlm_objective, dropout: bool = True):
    """One optimizer step. Dropout keys are fold_in(seed, step), and objectives that draw (label noise, probes)
    read `batch["rng"]` = fold_in(fold_in(seed, step), 1), so a resumed run repeats its randomness."""
    step_key = jax.random.fold_in(jax.random.key(seed), state["step"])
    key = step_key if dropout else None
    batch = {**batch, "rng": jax.random.fold_in(step_key, 1)}
    (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(state["params"], batch, apply_fn, key)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {
        "train/loss": loss,
        "train/grad_norm": optax.global_norm(grads),
        "train/update_norm": optax.global_norm(updates),
        "train/param_norm": optax.global_norm(params),
        **aux,
    }
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics
