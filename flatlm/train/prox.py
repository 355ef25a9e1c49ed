"""The l1 proximal step as an optax transform (issue 19's sparse contextual bigram setting: proximal gradient
recovers the sparse ground truth where plain SGD stalls). Chain it after the optimizer's own transform:

    optax.chain(optax.sgd(lr), l1_proximal(lam, lr))

turns the update u into u' such that params + u' = prox(params + u) = sign(z) max(|z| - lr_t lam, 0) with
z = params + u: soft-thresholding by lr_t * lam, lr_t the step's learning rate (a float or an optax schedule).
optax has projections but no l1 proximal operator, hence this thin transform.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def soft_threshold(z, threshold):
    """The l1 proximal operator: argmin_x 0.5 (x - z)^2 + threshold |x|, elementwise."""
    return jnp.sign(z) * jnp.maximum(jnp.abs(z) - threshold, 0.0)


def l1_proximal(lam: float, learning_rate: float | optax.Schedule) -> optax.GradientTransformation:
    """Updates that land on prox_{lr_t lam ||.||_1}(params + updates); state: the step count (for schedules)."""
    if lam < 0:
        raise ValueError(f"lam must be >= 0, got {lam}")

    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("l1_proximal needs params (pass them to optimizer.update)")
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        new = jax.tree.map(lambda p, u: soft_threshold(p + u, lr * lam) - p, params, updates)
        return new, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)
