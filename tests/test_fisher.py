"""flatlm.flatness.fisher: the Fisher identity (enumerated labels = Hessian of the stop-gradient-weighted loss),
both sampling estimators against it, the empirical Fisher, and Hutch++ on Fisher-vector products. (The gap report
is exercised through the CLI in test_flatness_cli.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flatness_tiny import fast_compile, float64_everywhere, mlm_batch, tiny_bert
from jax.flatten_util import ravel_pytree

from flatlm.flatness import fisher as fi
from flatlm.flatness import hessian as hs
from flatlm.flatness.compare import measure


@pytest.fixture(autouse=True, scope="module")
def _fast_compile():
    with fast_compile():
        yield


@pytest.fixture(scope="module")
def case():
    """Tiny BERT, two batches (rows with 1 or 2 masked positions), the exact Fisher trace of their mean."""
    with float64_everywhere():
        model, params = tiny_bert(seed=1)
        batches = [mlm_batch(0), mlm_batch(1)]
        exact = fi.exact_fisher_trace(model.apply, params, batches)
        return model, params, batches, exact


def test_enumerated_fisher_equals_hessian_of_stop_gradient_loss(case):
    model, params, batches, exact = case
    with float64_everywhere():
        surrogate = lambda p, b: fi.fisher_surrogate_loss(p, b, model.apply)
        H, unravel = hs.exact_hessian(surrogate, params, batches)
        assert exact.mean == pytest.approx(float(jnp.trace(H)), rel=1e-10)
        diag = unravel(jnp.diag(H))
        for name, value in exact.per_group.items():
            assert value == pytest.approx(float(sum(jnp.sum(x) for x in jax.tree.leaves(diag[name]))), rel=1e-8,
                                          abs=1e-12)
        # fisher_vp is the same PSD operator (per batch, averaged).
        v = hs.probe_like(jax.random.key(0), params, "gaussian")
        fvp = jax.jit(fi.fisher_vp, static_argnums=0)
        fv = [ravel_pytree(fvp(model.apply, params, b, v))[0] for b in batches]
        np.testing.assert_allclose(sum(fv) / 2, H @ ravel_pytree(v)[0], atol=1e-10)


@pytest.mark.parametrize("method,draws", [("per_sample", 200), ("summed", 800)])
def test_fisher_estimators_within_3_stderr(case, method, draws):
    model, params, batches, exact = case
    with float64_everywhere():
        est = fi.fisher_trace(model.apply, params, batches, jax.random.key(7), num_draws=draws, method=method,
                              draw_chunk_size=50)
    assert est.method == f"fisher_{method}" and est.num_batches == 2 and est.num_samples == 2 * draws
    assert abs(est.mean - exact.mean) < 3 * est.probe_stderr  # exact is the Fisher of exactly these batches
    assert sum(est.per_group.values()) == pytest.approx(est.mean, rel=1e-10)
    assert est.data_std is not None


def test_empirical_fisher_is_exact(case):
    model, params, batches, _ = case
    with float64_everywhere():
        exact = fi.exact_fisher_trace(model.apply, params, batches, labels="true")
        est = fi.empirical_fisher_trace(model.apply, params, batches, chunk_size=2)
    assert est.mean == pytest.approx(exact.mean, rel=1e-10)
    assert est.method == "empirical_fisher" and est.num_samples == int(sum(np.sum(b["weights"]) for b in batches))
    for name, value in exact.per_group.items():
        assert est.per_group[name] == pytest.approx(value, rel=1e-8, abs=1e-12)
    with pytest.raises(ValueError, match="biased"):
        fi.fisher_trace(model.apply, params, batches, jax.random.key(0), method="summed", labels="true")


def test_hutchpp_on_fisher(case):
    model, params, batches, exact = case
    with float64_everywhere():
        est = measure("hutchpp", model.apply, params, batches, jax.random.key(0), num_probes=90, chunk_size=10)
    # Rank of the Fisher <= masked positions x (V - 1), here ~36 > k = 30: a small deflated remainder is left.
    assert abs(est.mean - exact.mean) < 3 * est.stderr + 1e-8 * exact.mean
    assert sum(est.per_group.values()) == pytest.approx(est.mean, rel=1e-8)


def test_split_positions():
    batch = mlm_batch(3, batch_size=4, max_per_row=3)
    out = fi.split_positions(batch)
    w, n = np.asarray(batch["weights"]), int(np.sum(batch["weights"]))
    assert out["weights"].shape[0] % 4 == 0 and out["weights"].shape[0] >= n
    assert np.all(out["weights"].sum(axis=1) <= 1) and out["weights"].sum() == n
    rows, cols = np.nonzero(w)
    for r, (src, t) in enumerate(zip(rows, cols)):
        assert out["weights"][r, t] == 1 and np.all(out["tokens"][r] == np.asarray(batch["tokens"])[src])


def test_sample_labels_draws_the_softmax_distribution():
    """The inverse-CDF sampler the Fisher estimators use: 200k draws from three rows (one with two words of zero
    probability, one peaked) match softmax(logits) by a chi-square test, and -inf words never appear."""
    from scipy import stats  # test-only dependency

    from flatlm.models.losses import sample_labels

    logits_RV = jnp.array([[0.3, -1.2, 2.0, 0.0, 0.5, -0.7],
                           [1.0, -jnp.inf, 0.2, -jnp.inf, 3.0, 0.1],
                           [7.0, 0.0, -3.0, 1.0, 0.0, -jnp.inf]], jnp.float32)
    n = 200_000
    y_NR = np.asarray(sample_labels(jax.random.key(0), jnp.broadcast_to(logits_RV, (n, *logits_RV.shape))))
    p_RV = np.asarray(jax.nn.softmax(logits_RV.astype(jnp.float64) if jax.config.x64_enabled else logits_RV, -1))
    for r in range(3):
        counts = np.bincount(y_NR[:, r], minlength=6)
        assert counts[p_RV[r] == 0].sum() == 0
        live = p_RV[r] * n >= 5  # chi-square needs expected counts >= 5; the rest are checked to be rare
        expected = p_RV[r, live] * n
        chi2 = ((counts[live] - expected) ** 2 / expected).sum()
        assert stats.chi2.sf(chi2, live.sum() - 1) > 1e-4, (r, counts, p_RV[r] * n)
        assert counts[~live].sum() <= 20
