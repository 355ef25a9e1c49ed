"""The l1 proximal optax transform against the soft-thresholding closed form and the lasso's closed-form solution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flatlm.train.prox import l1_proximal, soft_threshold


def test_one_step_is_sgd_then_soft_thresholding():
    p = {"w": jnp.array([1.0, -0.2, 0.05, -3.0])}
    g = {"w": jnp.array([0.5, 0.1, -0.3, 1.0])}
    opt = optax.chain(optax.sgd(0.1), l1_proximal(lam=2.0, learning_rate=0.1))
    updates, _ = opt.update(g, opt.init(p), p)
    z = p["w"] - 0.1 * g["w"]
    want = np.sign(z) * np.maximum(np.abs(z) - 0.2, 0)
    np.testing.assert_allclose(optax.apply_updates(p, updates)["w"], want, atol=1e-7)
    assert float(soft_threshold(jnp.array(0.1), 0.2)) == 0.0


def test_proximal_gradient_solves_the_lasso_in_closed_form():
    """Orthonormal design: the lasso minimiser of 0.5 |X w - y|^2 + lam |w|_1 is soft_threshold(X^T y, lam)."""
    rng = np.random.default_rng(0)
    X, _ = np.linalg.qr(rng.normal(size=(20, 8)))
    w_true = np.array([2.0, 0, 0, -1.5, 0, 0, 0, 0.3])
    y = X @ w_true + 0.05 * rng.normal(size=20)
    lam = 0.4
    loss = lambda w: 0.5 * jnp.sum((X @ w - y) ** 2)
    opt = optax.chain(optax.sgd(0.5), l1_proximal(lam, optax.constant_schedule(0.5)))
    w, state = jnp.zeros(8), None
    state = opt.init(w)
    for _ in range(200):
        updates, state = opt.update(jax.grad(loss)(w), state, w)
        w = optax.apply_updates(w, updates)
    closed = np.asarray(soft_threshold(X.T @ y, lam))
    np.testing.assert_allclose(w, closed, atol=1e-6)
    assert np.all(np.asarray(w)[closed == 0] == 0) and (closed == 0).sum() >= 5  # exact zeros, not small values
    with pytest.raises(ValueError):
        l1_proximal(-1.0, 0.1)
