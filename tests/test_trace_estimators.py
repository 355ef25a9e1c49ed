"""Hutchinson, Hutch++ and XTrace at a fixed matvec budget (flatlm.flatness.trace_estimators) against numpy:
XTrace's downdated formulas against its leave-one-out definition, and the variance-reduced two beating Hutchinson
on a low-rank-plus-noise matrix at equal budget. (All three unbiased for a model's jax.hessian trace:
tests/test_spectrum.py, which has that model.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flatness_tiny import fast_compile

from flatlm.flatness import trace_estimators as te


@pytest.fixture(autouse=True, scope="module")
def _fast_compile():
    with fast_compile():
        yield


def _dense(A: np.ndarray):
    """(params, matvec) of the operator v -> A v on a one-leaf pytree."""
    A_j = jnp.asarray(A)
    return {"x": jnp.zeros(A.shape[0], A_j.dtype)}, lambda v: {"x": A_j @ v["x"]}


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


def test_batches_give_the_hessian_of_the_mean_loss():
    """loss_fn(params, batch) with batches: the operator is the mean over batches of their Hessians (checked
    against the closed-form Hessian A + diag(-s cos x + 1.2 x^2) of a non-quadratic loss, same key)."""
    def loss(p, b):
        x = p["x"]
        return 0.5 * x @ b["A"] @ x + b["s"] @ jnp.cos(x) + 0.1 * jnp.sum(x**4)

    with jax.enable_x64(True):
        rng = np.random.default_rng(4)
        n = 30
        sym = [(lambda M: M + M.T)(rng.normal(size=(n, n))) for _ in range(2)]
        batches = [{"A": jnp.asarray(A), "s": jnp.asarray(rng.normal(size=n))} for A in sym]
        params = {"x": jnp.asarray(rng.normal(size=n))}
        x = np.asarray(params["x"])
        H = np.mean([np.asarray(b["A"]) + np.diag(-np.asarray(b["s"]) * np.cos(x) + 1.2 * x**2) for b in batches], 0)
        _, mv = _dense(H)
        got = te.xtrace(loss, params, jax.random.key(1), 16, batches=batches)  # (one operator() for all three)
        want = te.xtrace(None, params, jax.random.key(1), 16, matvec=mv)
        assert got.mean == pytest.approx(want.mean, rel=1e-9) and got.stderr == pytest.approx(want.stderr, rel=1e-7)
        with pytest.raises(ValueError, match="batches go with loss_fn"):
            te.hutchinson(None, params, jax.random.key(1), 4, matvec=mv, batches=batches)


def test_products_over_params_on_a_mesh_compile_once():
    """Restored parameters live on the run's mesh and so do the products over them; a fresh probe stack off it must
    join it first, or the product program compiles twice (once per layout) before its output is fed back."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    params = jax.device_put({"w": jnp.arange(1.0, 8.0)}, NamedSharding(mesh, PartitionSpec()))  # n = 7: its own shape

    def loss(p):
        return jnp.sum(p["w"] ** 3) / 6.0  # Hessian diag(w)

    matmat, sp = te.operator(loss, params, chunk_size=3)
    n, mm = sp.n, te._matmat(loss, True, sp, 3)
    before = mm._cache_size()
    Y = matmat(jnp.eye(n)[:3])  # a fresh stack, off the mesh
    np.testing.assert_allclose(matmat(Y), np.eye(n)[:3] * np.arange(1.0, 8.0) ** 2, rtol=1e-6)  # fed back: H^2
    assert mm._cache_size() == before + 1
