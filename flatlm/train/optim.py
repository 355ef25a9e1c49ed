"""Optimizers and schedules from the config's `train` section (optax)."""

from __future__ import annotations

import optax

from flatlm.models.blocks import decay_mask


def schedule(train) -> optax.Schedule:
    """Linear warmup over `warmup_frac * steps`, then linear decay to 0, constant, or cosine decay."""
    warmup = int(round(train.warmup_frac * train.steps))
    rest = max(1, train.steps - warmup)
    if train.schedule == "linear":
        after = optax.linear_schedule(train.lr, 0.0, rest)
    elif train.schedule == "constant":
        after = optax.constant_schedule(train.lr)
    elif train.schedule == "cosine":
        after = optax.cosine_decay_schedule(train.lr, rest)
    else:
        raise ValueError(f"unknown schedule {train.schedule!r}")
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, train.lr, warmup), after], [warmup])


def optimizer(train) -> optax.GradientTransformation:
    """The config's optimizer: AdamW (BERT's decay mask) or SGD (+ momentum, decoupled decay), on the schedule."""
    lr = schedule(train)
    if train.optimizer == "adamw":
        opt = optax.adamw(lr, b1=train.b1, b2=train.b2, eps=train.eps, weight_decay=train.weight_decay,
                          mask=decay_mask)
    elif train.optimizer == "sgd" and train.weight_decay and train.momentum:
        # decoupled (SGDW, Loshchilov & Hutter 2019): the decay outside the momentum buffer, which otherwise
        # accumulates it (plain L2): w -= lr * (m + wd * w), m the momentum of the gradients alone
        opt = optax.chain(optax.trace(decay=train.momentum),
                          optax.add_decayed_weights(train.weight_decay, mask=decay_mask),
                          optax.scale_by_learning_rate(lr))
    elif train.optimizer == "sgd":  # without momentum the order does not matter: w -= lr * (g + wd * w)
        opt = optax.sgd(lr, momentum=train.momentum or None)
        if train.weight_decay:
            opt = optax.chain(optax.add_decayed_weights(train.weight_decay, mask=decay_mask), opt)
    else:
        raise ValueError(f"unknown optimizer {train.optimizer!r}")
    if train.grad_clip:
        opt = optax.chain(optax.clip_by_global_norm(train.grad_clip), opt)
    return opt
