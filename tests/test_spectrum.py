"""Lanczos top eigenvalues, power iteration and stochastic Lanczos quadrature against jax.hessian + eigh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from flatlm.flatness import spectrum


@pytest.fixture(scope="module")
def problem():
    """A float64 two-layer tanh softmax classifier on random data (~150 parameters), its exact Hessian."""
    with jax.enable_x64(True):
        k = jax.random.split(jax.random.key(0), 5)
        x, y = jax.random.normal(k[0], (64, 6), jnp.float64), jax.random.randint(k[1], (64,), 0, 4)
        params = {"w1": jax.random.normal(k[2], (6, 12), jnp.float64), "b1": jnp.zeros(12, jnp.float64),
                  "w2": 0.5 * jax.random.normal(k[3], (12, 4), jnp.float64)}

        def loss_fn(p):
            logits = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
            return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(64), y])

        flat, unravel = ravel_pytree(params)
        H = np.asarray(jax.hessian(lambda v: loss_fn(unravel(v)))(flat))
        yield loss_fn, params, H, np.linalg.eigvalsh(H)


def test_lanczos_top_eigenvalues_match_eigh(problem):
    loss_fn, params, H, eig = problem
    with jax.enable_x64(True):
        full = spectrum.top_eigenvalues(loss_fn, params, jax.random.key(1), k=3, num_iters=H.shape[0])
        short = spectrum.top_eigenvalues(loss_fn, params, jax.random.key(1), k=3, num_iters=20)
    np.testing.assert_allclose(full.values, eig[::-1][:3], rtol=1e-8)
    assert short.num_matvecs == 20
    assert abs(short.values[0] - eig[-1]) <= short.residual[0] + 1e-10  # the Ritz bound holds
    assert abs(short.values[0] - eig[-1]) < 1e-6 * eig[-1]  # and the top value has converged in 20 HVPs


def test_power_iteration_agrees_with_lanczos(problem):
    loss_fn, params, _, eig = problem
    with jax.enable_x64(True):
        value, used = spectrum.power_iteration(loss_fn, params, jax.random.key(2), num_iters=2000, tol=1e-12)
        top = spectrum.top_eigenvalues(loss_fn, params, jax.random.key(3), k=1, num_iters=30)
    largest = eig[np.argmax(np.abs(eig))]
    assert value == pytest.approx(largest, rel=1e-6) and used < 2000
    assert top.values[0] == pytest.approx(value, rel=1e-6)


def test_slq_moments_estimate_trace_and_frobenius_norm(problem):
    loss_fn, params, H, eig = problem
    with jax.enable_x64(True):
        density = spectrum.spectral_density(loss_fn, params, jax.random.key(4), num_probes=40, num_iters=12)
    assert density.dim == H.shape[0] and np.allclose(density.weights.sum(1), 1.0)
    for p, exact in ((1, np.trace(H)), (2, np.sum(H * H))):
        est, se = density.moment(p)
        assert abs(est - exact) < 4 * se, (p, est, exact, se)
    grid = np.linspace(eig.min() - 1, eig.max() + 1, 4001)
    assert np.trapezoid(density.curve(grid), grid) == pytest.approx(1.0, abs=1e-3)
    assert density.nodes.max() == pytest.approx(eig.max(), rel=1e-6)  # 12 steps resolve the extreme eigenvalue


def test_preconditioned_sharpness_is_the_top_eigenvalue_of_p_inverse_h(problem):
    """Against eigvals of P^-1 H built densely (a non-symmetric matrix with the same spectrum as the symmetric form)."""
    loss_fn, params, H, _ = problem
    with jax.enable_x64(True):
        nu = jax.tree.map(lambda x: 0.01 + jnp.abs(x) ** 2, params)  # any positive second moments
        got = spectrum.preconditioned_sharpness(loss_fn, params, nu, jax.random.key(5), b2=0.999, step=10,
                                                num_iters=H.shape[0])
        p = ravel_pytree(jax.tree.map(lambda v: jnp.sqrt(v / (1 - 0.999 ** 10)) + 1e-8, nu))[0]
    want = np.max(np.linalg.eigvals(np.asarray(H) / np.asarray(p)[:, None]).real)
    assert got.values[0] == pytest.approx(want, rel=1e-7)
    assert spectrum.adam_edge_of_stability(1e-3) == pytest.approx(38_000)
