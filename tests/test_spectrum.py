"""Lanczos top eigenvalues, power iteration and stochastic Lanczos quadrature against jax.hessian + eigh; the
fixed-budget trace estimators (Hutchinson, Hutch++, XTrace) unbiased for the same model's exact trace."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from flatlm.flatness import spectrum
from flatlm.flatness import trace_estimators as te


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


def test_lanczos_in_float32_over_the_whole_space_has_no_ghost_eigenvalues():
    """A float32 matvec with a wide, clustered spectrum, Lanczos run to the dimension n: without full
    reorthogonalisation the converged top values come back as spurious copies ("ghosts") and the Ritz values no
    longer match eigh; with it, all n Ritz values match (the one-pass-then-DGKS scheme)."""
    rng = np.random.default_rng(0)
    n = 60
    eig = np.concatenate([1e3 * (1 + 1e-3 * np.arange(5)), np.geomspace(1e-2, 10.0, n - 5)])
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    A = jnp.asarray((Q * eig) @ Q.T, jnp.float32)
    alphas, betas = spectrum.lanczos(lambda v: {"x": A @ v["x"]}, {"x": jnp.ones(n, jnp.float32)}, n)
    theta = np.linalg.eigvalsh(np.diag(alphas) + np.diag(betas[:-1], 1) + np.diag(betas[:-1], -1))
    np.testing.assert_allclose(theta, np.sort(eig), rtol=1e-4, atol=2e-4 * eig.max())
    assert np.sum(theta > 900) == 5  # the five top eigenvalues once each


def test_lanczos_stops_where_the_krylov_space_is_exhausted():
    """A matrix with 3 distinct eigenvalues: from a start vector with weight on all of them the Krylov space has
    dimension 3, so Lanczos asked for 10 steps returns 3 (the last beta ~ 0) whose Ritz values are exactly those
    eigenvalues; the steps dispatched after the breakdown do not leak into the result."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(1)
        Q, _ = np.linalg.qr(rng.standard_normal((12, 12)))
        eig = np.repeat([5.0, 2.0, -1.0], 4)
        A = jnp.asarray((Q * eig) @ Q.T)
        alphas, betas = spectrum.lanczos(lambda v: {"x": A @ v["x"]}, {"x": jnp.ones(12)}, 10)
    assert len(alphas) == len(betas) == 3 and abs(betas[-1]) < 1e-9
    theta = np.linalg.eigvalsh(np.diag(alphas) + np.diag(betas[:-1], 1) + np.diag(betas[:-1], -1))
    np.testing.assert_allclose(theta, [-1.0, 2.0, 5.0], atol=1e-10)


def test_power_iteration_agrees_with_lanczos(problem):
    loss_fn, params, _, eig = problem
    with jax.enable_x64(True):
        value, used = spectrum.power_iteration(loss_fn, params, jax.random.key(2), num_iters=2000, tol=1e-12)
        top = spectrum.top_eigenvalues(loss_fn, params, jax.random.key(3), k=1, num_iters=30)
    largest = eig[np.argmax(np.abs(eig))]
    assert value == pytest.approx(largest, rel=1e-6) and used < 2000
    assert top.values[0] == pytest.approx(value, rel=1e-6)


@pytest.mark.parametrize("scale", [1.0, 1e-5, 1e-8])
def test_power_iteration_converges_whatever_the_hessians_scale_and_trace(scale):
    """Audit regression: the stopping test compared against a start of 0 with an absolute floor of tol, so a
    Hessian whose first Rayleigh quotient (~ Tr(H) / n) is near 0, or any Hessian of small scale, stopped after one
    or a few HVPs far from its top eigenvalue. A diagonal one (closed form): trace 0 with |top| 10, and diag(1..50)
    times `scale`."""
    with jax.enable_x64(True):
        c = jnp.asarray(np.concatenate([[10.0], -np.ones(10)]))
        value, used = spectrum.power_iteration(lambda p: 0.5 * jnp.sum(c * p["x"] ** 2), {"x": jnp.ones(11)},
                                               jax.random.key(0), num_iters=500, tol=1e-10)
        assert value == pytest.approx(10.0, rel=1e-6) and used > 1
        d = scale * jnp.arange(1.0, 51.0)
        value, used = spectrum.power_iteration(lambda p: 0.5 * jnp.sum(d * p["x"] ** 2), {"x": jnp.ones(50)},
                                               jax.random.key(0), num_iters=5000, tol=1e-10)
    assert value == pytest.approx(50 * scale, rel=1e-4) and used < 5000


def test_lanczos_breakdown_test_is_relative_to_the_operators_scale():
    """Audit regression: breakdown was beta <= 1e-10 max(1, |alpha|), so an operator of norm ~1e-10 looked
    exhausted after one step. The same quadratic at scale 1 and 1e-11 gives the same top eigenvalues over eigh."""
    rng = np.random.default_rng(3)
    Q, _ = np.linalg.qr(rng.standard_normal((40, 40)))
    eig = np.concatenate([[-2.0], np.linspace(0.1, 4.0, 37), [8.0, 10.0]])
    with jax.enable_x64(True):
        for scale in (1.0, 1e-11):
            A = jnp.asarray(scale * (Q * eig) @ Q.T)
            top = spectrum.top_eigenvalues(lambda p, A=A: 0.5 * p["x"] @ A @ p["x"], {"x": jnp.zeros(40)},
                                           jax.random.key(1), k=2, num_iters=40)
            np.testing.assert_allclose(top.values / scale, [10.0, 8.0], rtol=1e-8)


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


def test_trace_estimators_are_unbiased_for_the_model_hessian(problem):
    """flatness.trace_estimators on the Hessian of a real loss: the HVP path equals the dense-matrix path (same
    key), and over 60 repeats each estimator's mean is within 4 standard errors of jax.hessian's trace;
    Hutchinson's Tr(H^2) too."""
    loss_fn, params, H, _ = problem
    unravel = ravel_pytree(params)[1]
    with jax.enable_x64(True):
        mv = lambda v: unravel(jnp.asarray(H) @ ravel_pytree(v)[0])
        budget = 30
        via_hvp = te.xtrace(loss_fn, params, jax.random.key(7), budget)  # (one operator() path for all three)
        dense = te.xtrace(None, params, jax.random.key(7), budget, matvec=mv)
        assert via_hvp.mean == pytest.approx(dense.mean, rel=1e-9) and via_hvp.stderr == pytest.approx(dense.stderr)
        for fn in (te.hutchinson, te.hutchpp, te.xtrace):
            runs = [fn(None, params, jax.random.fold_in(jax.random.key(8), r), budget, matvec=mv) for r in range(60)]
            means = np.array([r.mean for r in runs])
            se = means.std(ddof=1) / np.sqrt(len(means))
            assert abs(means.mean() - np.trace(H)) < 4 * se, (fn.__name__, means.mean(), np.trace(H), se)
            assert all(r.num_samples == budget for r in runs)  # 30 = 3 x 10 for Hutch++
        est = te.hutchinson(None, params, jax.random.key(9), 1000, matvec=mv, chunk_size=100)
    assert abs(est.trace_sq - np.sum(H * H)) < 4 * est.trace_sq_stderr
    assert abs(est.mean - np.trace(H)) < 4 * est.stderr
    # Rademacher: Var(v.Hv) = 2 (||H||_F^2 - sum_i H_ii^2)
    assert est.sample_std == pytest.approx(np.sqrt(2 * (np.sum(H * H) - np.sum(np.diag(H) ** 2))), rel=0.1)


def test_lanczos_on_params_on_a_mesh_compiles_its_step_once():
    """Parameters restored from a checkpoint live on the run's mesh, and so do the products of a matvec over them:
    the start vector, zeros and basis must too, or the step compiles three times (once per layout change)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    A = jnp.diag(jnp.arange(1.0, 30.0))  # 29 x 29: a shape no other test gives the step
    params = jax.device_put({"x": jnp.zeros(29)}, NamedSharding(mesh, PartitionSpec()))
    product = jax.jit(lambda p, v: {"x": A @ v["x"] + 0.0 * p["x"]})  # reads params, as an HVP does
    matvec = lambda v: product(params, v)  # noqa: E731
    before = spectrum._lanczos_step._cache_size()
    top = spectrum.top_eigenvalues(None, params, jax.random.key(0), k=1, num_iters=12, matvec=matvec)
    assert spectrum._lanczos_step._cache_size() == before + 1
    assert abs(top.values[0] - 29.0) <= top.residual[0] + 1e-4
