"""Errors of differences of two curvature traces on the same batches (flatlm.flatness.estimates.paired_difference,
what `flatlm flatness --gap` reports for Tr(H) - Tr(F)), checked by Monte Carlo against the empirical spread of the
difference over replicates; and the batch bookkeeping of the pooled estimators (Hutch++, XTrace)."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flatness_tiny import fast_compile, mlm_batch, tiny_bert
from scipy import stats

from flatlm.flatness import compare
from flatlm.flatness.estimates import paired_difference, summarize


def _replicate(rng, num_batches: int, shared_sd: float, gap_sd: float = 0.5):
    """Two estimates on the same `num_batches` batches: each batch's true trace t_b is shared (spread `shared_sd`
    across batches), H = t_b + probe noise (16 probes, sd 1), F = t_b + 0.5 + d_b + draw noise (8 draws, sd 0.5),
    d_b the batch's own gap (spread `gap_sd`: data noise the difference keeps)."""
    t_b = 10.0 + shared_sd * rng.normal(size=num_batches)
    d_b = gap_sd * rng.normal(size=num_batches)
    h = [t + rng.normal(size=(16, 1)) for t in t_b]
    f = [t + 0.5 + d + 0.5 * rng.normal(size=(8, 1)) for t, d in zip(t_b, d_b)]
    return summarize(h, ["all"], method="h"), summarize(f, ["all"], method="f")


@pytest.mark.parametrize("num_batches", [1, 4])
def test_paired_difference_matches_the_spread_of_the_difference(num_batches):
    """Audit regression: `gap_report` added the two stderrs as if independent. On shared batches (spread 3 across
    batches, far above the probes' noise) that overstated the gap's error many times over. The paired error's
    square, averaged over 2000 replicates, must match the variance of the gap across them (within 12 %, ~3.5 of
    its own standard errors; its floor at the probes' error adds a little), and the gap must be unbiased for the
    true -0.5. The floor: never below the probes' error of the difference."""
    rng = np.random.default_rng(0)
    gaps, var_paired, var_indep, how = [], [], [], set()
    for _ in range(2000):
        # one batch: the probes' error is that of the gap on this batch, so no gap of the batch's own
        h, f = _replicate(rng, num_batches, shared_sd=3.0, gap_sd=0.5 if num_batches > 1 else 0.0)
        gap, se, kind = paired_difference(h, f)
        assert se >= np.hypot(h.probe_stderr, f.probe_stderr) * (1 - 1e-12)
        gaps.append(gap), var_paired.append(se**2), var_indep.append(h.stderr**2 + f.stderr**2), how.add(kind)
    empirical = np.var(gaps, ddof=1)
    assert how == {"paired" if num_batches > 1 else "probes"}
    assert np.mean(var_paired) == pytest.approx(empirical, rel=0.12)
    assert abs(np.mean(gaps) + 0.5) < 4 * math.sqrt(empirical / len(gaps))
    if num_batches > 1:  # what was reported before: the batches' spread counted twice
        assert np.mean(var_indep) > 20 * empirical


def test_paired_difference_falls_back_to_independent_errors():
    """Different batch counts cannot be paired: the errors add in quadrature."""
    rng = np.random.default_rng(1)
    h, _ = _replicate(rng, 4, 1.0)
    _, f = _replicate(rng, 3, 1.0)
    gap, se, kind = paired_difference(h, f)
    assert kind == "independent" and gap == h.mean - f.mean and se == pytest.approx(math.hypot(h.stderr, f.stderr))


@pytest.fixture(scope="module")
def bert():
    with fast_compile(), jax.enable_x64(True):
        model, params = tiny_bert()
        yield model, params, [mlm_batch(s, batch_size=4) for s in range(3)]


def test_gap_report_pairs_the_batches(bert):
    """The report's gap error is the per-batch differences' (same keys as `gap_report` uses, so the same samples),
    and Hutch++ / XTrace over three batches say three (they pooled their operator over them but reported one)."""
    model, params, batches = bert
    with fast_compile(), jax.enable_x64(True):
        key = jax.random.key(0)
        rep = compare.gap_report(model.apply, params, batches, key, num_probes=8, num_draws=6, chunk_size=4)
        k_h, k_f = jax.random.split(key)
        h = compare.measure("hutchinson", model.apply, params, batches, k_h, num_probes=8, chunk_size=4)
        f = compare.measure("fisher", model.apply, params, batches, k_f, num_draws=6)
        d = np.array(h.batch_means) - np.array(f.batch_means)
        assert len(d) == 3 and rep["hessian_minus_fisher_error"] == "paired"
        assert rep["hessian_minus_fisher"] == pytest.approx(h.mean - f.mean, rel=1e-12)
        assert rep["hessian_minus_fisher_stderr"] == pytest.approx(d.std(ddof=1) / math.sqrt(3), rel=1e-9)
        z = rep["hessian_minus_fisher_z"]  # 3 batches: 2 degrees of freedom, Student's t
        assert rep["hessian_minus_fisher_dof"] == 2
        assert rep["hessian_minus_fisher_p"] == pytest.approx(2 * stats.t.sf(abs(z), 2), rel=1e-12)
        assert "batch_means" not in rep["hessian"]  # in memory only: stored results keep their size
        for method in ("hutchpp", "xtrace"):
            est = compare.measure(method, model.apply, params, batches, key, num_probes=6)
            assert est.num_batches == 3, method
