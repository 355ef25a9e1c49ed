"""Hutchinson, Hutch++ and XTrace at a fixed matvec budget (flatlm.flatness.trace_estimators) against
jax.hessian + numpy: XTrace's downdated formulas against its leave-one-out definition, all three unbiased for a
model's exact Tr(H) (and Hutchinson's Tr(H^2)), and the variance-reduced two beating Hutchinson on a
low-rank-plus-noise matrix at equal budget."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flatness_tiny import fast_compile
from jax.flatten_util import ravel_pytree

from flatlm.flatness import trace_estimators as te


@pytest.fixture(autouse=True, scope="module")
def _fast_compile():
    with fast_compile():
        yield


def _dense(A: np.ndarray):
    """(params, matvec) of the operator v -> A v on a one-leaf pytree."""
    A_j = jnp.asarray(A)
    return {"x": jnp.zeros(A.shape[0], A_j.dtype)}, lambda v: {"x": A_j @ v["x"]}


@pytest.fixture(scope="module")
def model():
    """A float64 tanh softmax classifier (132 parameters, indefinite Hessian) and its exact Hessian."""
    with jax.enable_x64(True):
        k = jax.random.split(jax.random.key(0), 4)
        x, y = jax.random.normal(k[0], (64, 6), jnp.float64), jax.random.randint(k[1], (64,), 0, 4)
        params = {"w1": jax.random.normal(k[2], (6, 12), jnp.float64), "b1": jnp.zeros(12, jnp.float64),
                  "w2": 0.5 * jax.random.normal(k[3], (12, 4), jnp.float64)}

        def loss_fn(p):
            logits = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
            return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(64), y])

        flat, unravel = ravel_pytree(params)
        H = np.asarray(jax.hessian(lambda v: loss_fn(unravel(v)))(flat))
        yield loss_fn, params, H, unravel


@pytest.mark.parametrize("kind", ["sphere", "rademacher"])
def test_xtrace_equals_its_leave_one_out_definition(kind):
    """tr_i = Tr(Q_(i)^T A Q_(i)) + omega_i^T P_i A P_i omega_i (scaled by (n - m + 1) / |P_i omega_i|^2 on the
    sphere), Q_(i) from an explicit QR of A Omega without column i: the downdating must give the same numbers."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        n, m = 40, 7
        M = rng.normal(size=(n, n))
        A = M + M.T  # symmetric, indefinite
        params, mv = _dense(A)
        key = jax.random.key(3)
        got = te.xtrace(None, params, key, 2 * m, matvec=mv, kind=kind)
        if kind == "sphere":  # the same test vectors as xtrace draws
            G = np.asarray(jax.random.normal(key, (m, n), jnp.float64))
            Om = np.sqrt(n) * G / np.linalg.norm(G, axis=1, keepdims=True)
        else:
            Om = np.asarray(jax.random.rademacher(key, (m, n), jnp.float64))
    Y = A @ Om.T
    ests = []
    for i in range(m):
        Q = np.linalg.qr(np.delete(Y, i, axis=1))[0]
        P = np.eye(n) - Q @ Q.T
        quad = Om[i] @ P @ A @ P @ Om[i]
        ests.append(np.trace(Q.T @ A @ Q) + quad * ((n - m + 1) / (Om[i] @ P @ Om[i]) if kind == "sphere" else 1))
    assert got.mean == pytest.approx(np.mean(ests), rel=1e-10)
    assert got.stderr == pytest.approx(np.std(ests, ddof=1) / np.sqrt(m), rel=1e-8)
    assert got.num_samples == 2 * m and got.method == f"xtrace_{kind}"


def test_estimators_are_unbiased_for_a_model_hessian(model):
    """On the Hessian of a real loss: the HVP path equals the dense-matrix path (same key), and over 60
    repeats each estimator's mean is within 4 standard errors of jax.hessian's trace; Hutchinson's Tr(H^2) too."""
    loss_fn, params, H, unravel = model
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


def test_variance_reduced_estimators_beat_hutchinson_on_low_rank_plus_noise():
    """A PSD matrix with 10 decaying large eigenvalues (100 * 0.7^k) over 290 small ones (< 0.05): at a budget of
    24 products the median error over 40 repeats of Hutch++ and of XTrace is well below Hutchinson's, and XTrace
    (12 sketch vectors, all reused) below Hutch++ (8)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        n = 300
        U = np.linalg.qr(rng.normal(size=(n, n)))[0]
        lam = np.concatenate([100.0 * 0.7 ** np.arange(10), rng.uniform(0, 0.05, n - 10)])
        params, mv = _dense((U * lam) @ U.T)
        err = {fn: np.median([abs(fn(None, params, jax.random.fold_in(jax.random.key(0), r), 24, matvec=mv).mean
                                  - lam.sum()) for r in range(40)])
               for fn in (te.hutchinson, te.hutchpp, te.xtrace)}
    assert err[te.hutchpp] < 0.5 * err[te.hutchinson], err
    assert err[te.xtrace] < 0.5 * err[te.hutchinson], err
    assert err[te.xtrace] < 0.5 * err[te.hutchpp], err


def test_budgets_and_rank_deficiency_are_refused():
    with jax.enable_x64(True):
        params, mv = _dense(np.diag([1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))  # rank 2
        with pytest.raises(ValueError, match="rank deficient"):
            te.xtrace(None, params, jax.random.key(0), 8, matvec=mv)
        with pytest.raises(ValueError, match="num_matvecs >= 4"):
            te.xtrace(None, params, jax.random.key(0), 3, matvec=mv)
        with pytest.raises(ValueError, match="num_matvecs >= 6"):
            te.hutchpp(None, params, jax.random.key(0), 5, matvec=mv)
        # Hutch++ needs no full rank: with the range captured, the estimate is exact
        exact = te.hutchpp(None, params, jax.random.key(0), 9, matvec=mv)
    assert exact.mean == pytest.approx(3.0, abs=1e-10)
