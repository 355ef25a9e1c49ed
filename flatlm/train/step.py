"""The pure, module-level train step. `jax.jit` it once with explicit shardings (see loop.py)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from flatlm.models.losses import mlm_loss

# objective(params, batch, apply_fn, dropout_key) -> (loss, aux_metrics_dict)
Objective = Callable[..., tuple[jax.Array, dict]]


def mlm_objective(params, batch, apply_fn, dropout_key):
    """The plain MLM objective for `train_step`: (mean masked cross-entropy in nats, no aux)."""
    return mlm_loss(params, batch, apply_fn, dropout_key), {}


def train_step(state: dict, batch: dict, *, apply_fn, optimizer: optax.GradientTransformation, seed: int,
               objective: Objective = mlm_objective, dropout: bool = True, microbatches: int = 1):
    """One optimizer step. Dropout keys are fold_in(seed, step), and objectives that draw (label noise, probes)
    read `batch["rng"]` = fold_in(fold_in(seed, step), 1), so a resumed run repeats its randomness.
    `microbatches` > 1 computes the batch's gradient slice by slice (`accumulated_grad`): same update, less memory."""
    step_key = jax.random.fold_in(jax.random.key(seed), state["step"])
    key = step_key if dropout else None
    batch = {**batch, "rng": jax.random.fold_in(step_key, 1)}
    (loss, aux), grads = accumulated_grad(objective, microbatches)(state["params"], batch, apply_fn, key)
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


def microbatch(x_B, k: int):
    """x[B, ...] as [k, B / k, ...] with slice m = rows m, m + k, m + 2k, ...: strided, so that each device of the
    data axis (which holds a contiguous block of rows) keeps its rows in every slice and nothing moves."""
    if x_B.shape[0] % k:
        raise ValueError(f"a batch of {x_B.shape[0]} rows does not split into {k} microbatches")
    return jnp.swapaxes(x_B.reshape(x_B.shape[0] // k, k, *x_B.shape[1:]), 0, 1)


def accumulated_grad(objective: Objective, microbatches: int = 1):
    """`jax.value_and_grad(objective, has_aux=True)`, computed over `microbatches` slices of the batch one after
    another (a `lax.scan`): gradient accumulation, for batches whose activations do not fit a device at once (the
    paper's batch 4096 at L12-H768 needs a 51.75 GiB temporary on one GPU; launch/README.md).

    Exact for objectives that are weighted means over `batch["weights"]` (the MLM loss, label noise): slice m's
    mean loss L_m over its weight sum W_m enters as max(W_m, 1) L_m / max(sum W, 1), which is the whole batch's
    mean (`masked_cross_entropy`'s sum / max(count, 1)) up to float summation order; gradients likewise, summed
    in float32. Aux metrics are the W_m-weighted means of the slices'. Randomness differs from one slice of
    the whole batch: slice m reads fold_in(key, m) for dropout and fold_in(batch["rng"], m) for its draws (same
    distribution, other masks), so with dropout on a run's trajectory depends on `microbatches`.
    On a mesh XLA reduces each slice's gradient over the data axis, and FSDP gathers the parameters for each slice
    (`microbatches` times a step, not once: seen in the compiled programs on CPU; the batch's rows never move):
    accumulation buys memory, not speed; spread the batch over devices first. (XLA's GPU pipeline runs a pass,
    WhileLoopAllReduceCodeMotion, that moves an all-reduce whose result is only accumulated out of the loop; the
    CPU pipeline does not. Whether it fires on this step was not checked: no multi-GPU machine so far.)
    Why not `optax.MultiSteps`: it makes every microbatch an optimizer call, so the step counter, schedules,
    checkpoints and the data iterator would count microbatches, and it averages microbatch gradients with equal
    weights, which is not the batch's gradient when slices hold different numbers of masked tokens.
    """
    if microbatches == 1:
        return jax.value_and_grad(objective, has_aux=True)

    def weighted(params, part, apply_fn, key, scale):  # max(W_m, 1) L_m: its gradient adds to the sum as it is
        loss, aux = objective(params, part, apply_fn, key)
        return scale * loss.astype(jnp.float32), aux

    grad_fn = jax.value_and_grad(weighted, has_aux=True)

    def run(params, batch, apply_fn, dropout_key):
        rng = batch.get("rng")
        slices = {k: microbatch(v, microbatches) for k, v in batch.items() if k != "rng"}

        def part_of(m, part):
            part = part if rng is None else {**part, "rng": jax.random.fold_in(rng, m)}
            return part, None if dropout_key is None else jax.random.fold_in(dropout_key, m)

        def one(carry, xs):
            part, key = part_of(*xs)
            count = jnp.sum(part["weights"]).astype(jnp.float32)
            (loss_sum, aux), grads = grad_fn(params, part, apply_fn, key, jnp.maximum(count, 1.0))
            g_acc, l_acc, aux_acc, n_acc = carry
            return (jax.tree.map(lambda a, g: a + g.astype(a.dtype), g_acc, grads), l_acc + loss_sum,
                    jax.tree.map(lambda a, x: a + count * x.astype(jnp.float32), aux_acc, aux), n_acc + count), None

        f32 = lambda x: jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32))
        part0, key0 = part_of(0, jax.tree.map(lambda x: x[0], slices))
        aux0 = jax.eval_shape(lambda p, s, k: objective(p, s, apply_fn, k)[1], params, part0, key0)
        zero = jnp.zeros((), jnp.float32)
        carry = (jax.tree.map(f32, params), zero, jax.tree.map(f32, aux0), zero)
        (g_sum, l_sum, aux_sum, n), _ = jax.lax.scan(one, carry, (jnp.arange(microbatches), slices))
        total = jnp.maximum(n, 1.0)
        grads = jax.tree.map(lambda s, p: (s / total).astype(p.dtype), g_sum, params)
        return (l_sum / total, jax.tree.map(lambda s: s / jnp.maximum(n, 1e-30), aux_sum)), grads

    return run
