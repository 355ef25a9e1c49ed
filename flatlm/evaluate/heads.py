"""What the linear probe and fine-tuning share: a classification head's loss, schedule, minibatches and summaries.

Both protocols (paper, appendix A.4) train a randomly initialised linear head g_phi with AdamW under a linear
warmup then linear decay, over epochs of shuffled minibatches, and report mean and std over 5 seeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def warmup_linear_decay(peak: float, warmup_steps: int, total_steps: int, end: float = 0.0) -> optax.Schedule:
    """0 -> peak linearly over `warmup_steps`, then linearly to `end` at `total_steps` (HF 'polynomial')."""
    warmup_steps = max(0, min(warmup_steps, total_steps))
    decay = optax.linear_schedule(peak, end, max(1, total_steps - warmup_steps))
    if warmup_steps == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup_steps), decay], [warmup_steps])


def masked_ce(logits_BC, y_B, w_B):
    """Mean cross-entropy (nats) of logits[B, C] against labels int[B] over the rows with weight w_B = 1.

    The padded tail of the last minibatch has weight 0, so every step keeps one shape.
    """
    logp_BC = jax.nn.log_softmax(logits_BC, axis=-1)
    nll_B = -jnp.take_along_axis(logp_BC, y_B[:, None], axis=-1)[:, 0]
    return jnp.sum(nll_B * w_B) / jnp.maximum(jnp.sum(w_B), 1.0)


def epoch_indices(key, epoch, n: int, batch_size: int):
    """This seed's minibatch indices int32[steps, B] for `epoch`; the tail batch is padded with index 0."""
    steps = -(-n // batch_size)
    perm_N = jax.random.permutation(jax.random.fold_in(key, epoch), n)
    perm_N = jnp.concatenate([perm_N, jnp.zeros((steps * batch_size - n,), perm_N.dtype)])
    return perm_N.reshape(steps, batch_size)


def chunks(n: int, chunk: int, *arrays):
    """Yields (valid, *arrays[start:start + chunk]) with the tail zero-padded to `chunk` rows (one shape)."""
    for start in range(0, n, chunk):
        valid = min(chunk, n - start)
        parts = []
        for a in arrays:
            part = a[start:start + chunk]
            if valid < chunk:
                xp = np if isinstance(part, np.ndarray) else jnp
                part = xp.concatenate([part, xp.zeros((chunk - valid,) + part.shape[1:], part.dtype)])
            parts.append(part)
        yield (valid, *parts)


def summarize(per_seed) -> dict:
    """{"mean", "std", "per_seed"} of per-seed values (std over seeds with ddof=0, as np.std; paper A.4: 5 seeds)."""
    v = np.asarray(per_seed, np.float64)
    return {"mean": float(v.mean()), "std": float(v.std()), "per_seed": [float(a) for a in v]}


def infer_num_classes(labels: Mapping[str, Any]) -> int:
    """1 + the largest label over all splits (split -> int[N]); pass `num_classes` instead when a class may be
    missing from the data."""
    return int(max(int(np.max(np.asarray(y))) for y in labels.values() if np.size(y))) + 1
