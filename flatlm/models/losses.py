"""Pure objectives. Every loss takes the parameter pytree first: `loss(params, batch, ...) -> scalar`.

An MLM batch is a dict of arrays:
  tokens  int32[B, T]   model input (masked positions replaced by the mask id / a random word / kept)
  targets int32[B, T]   the original words (0..V-1; pad positions hold the pad id)
  weights float32[B, T] 1.0 at positions whose prediction counts, else 0.0
  positions int32[B, P] (optional) positions that hold every weighted one of the row (the rest: weight 0)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

ApplyFn = Callable[..., jax.Array]  # apply_fn({"params": params}, tokens, deterministic=..., rngs=...) -> logits


def masked_cross_entropy(logits_BTV, targets_BT, weights_BT):
    """Sum over weighted positions of -log softmax(logits)[target], and the weight sum (nats)."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    safe_BT = jnp.where(weights_BT > 0, targets_BT, 0)
    nll_BT = -jnp.take_along_axis(logp_BTV, safe_BT[..., None], axis=-1)[..., 0]
    return jnp.sum(nll_BT * weights_BT), jnp.sum(weights_BT)


def sample_labels(key: jax.Array | None, logits_XV: jax.Array, uniform_X1: jax.Array | None = None) -> jax.Array:
    """int32[X] draws y ~ softmax(logits) over the last axis, by the inverse CDF: one uniform per row.

    Same distribution as `jax.random.categorical` (up to float32 rounding of the cumulative sum, ~1e-7), without
    its Gumbel noise over every logit: X random numbers instead of X * V, which made a Fisher draw cost 1.5
    gradients instead of 1.0 at V = 200 (benchmarks/flatness_cost.py). Zero-probability words are never drawn.
    `uniform_X1`: the rows' uniforms in [0, 1) given instead of drawn from `key` (label noise draws them over every
    position and keeps the predicted ones', so the labels do not depend on where the head ran).
    """
    p_XV = jax.nn.softmax(logits_XV.astype(jnp.promote_types(logits_XV.dtype, jnp.float32)), axis=-1)
    cdf_XV = jnp.cumsum(p_XV, axis=-1)
    total_X1 = cdf_XV[..., -1:]
    if uniform_X1 is None:
        uniform_X1 = jax.random.uniform(key, total_X1.shape, cdf_XV.dtype)
    u_X1 = jnp.minimum(uniform_X1.astype(cdf_XV.dtype) * total_X1,
                       jnp.nextafter(total_X1, 0))  # u < total: the last positive-probability word is the cap
    return jnp.sum(cdf_XV <= u_X1, axis=-1).astype(jnp.int32)


def mlm_loss(params, batch, apply_fn: ApplyFn, dropout_key=None):
    """Mean cross-entropy (nats) over the batch's weighted positions. Dropout is on iff a key is given.

    With `batch["positions"]` (int32[B, P], every weighted position of a row among its P; `mask_batch` adds it)
    the MLM head runs at those P positions only, the original BERT's `masked_lm_positions`: the same loss and
    gradient for ~P / T of the head's work (5 of 32 positions at the `bert` masking's default)."""
    return mlm_loss_of_logits(mlm_logits(params, batch, apply_fn, dropout_key), batch)


def mlm_logits(params, batch, apply_fn: ApplyFn, dropout_key=None):
    """The logits `mlm_loss` scores: [B, T, V], or [B, P, V] at `batch["positions"]`; dropout on iff a key."""
    rngs = {} if dropout_key is None else {"dropout": dropout_key}
    positions = batch.get("positions")
    kw = {} if positions is None else {"positions_BP": positions}
    return apply_fn({"params": params}, batch["tokens"], deterministic=dropout_key is None, rngs=rngs, **kw)


def mlm_loss_of_logits(logits, batch):
    """`mlm_loss` from `mlm_logits`' output (objectives that need the logits for more than the loss share them)."""
    targets, weights = batch["targets"], batch["weights"]
    if batch.get("positions") is not None:
        targets, weights = jnp.take_along_axis(targets, batch["positions"], axis=1), predicted_weights(batch)
    total, count = masked_cross_entropy(logits, targets, weights)
    return total / jnp.maximum(count, 1.0)


def predicted_weights(batch):
    """weights[B, P] at `batch["positions"]`; all NaN when a weighted position of the batch is not among them (a
    batch built by hand), so the loss turns non-finite and training stops instead of dropping predictions."""
    w_BP = jnp.take_along_axis(batch["weights"], batch["positions"], axis=1)
    missing = jnp.sum(batch["weights"] != 0) != jnp.sum(w_BP != 0)
    return jnp.where(missing, jnp.nan, w_BP)
