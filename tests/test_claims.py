"""The "same loss" band, paired effects and verdicts of flatlm.claims on synthetic result sets."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from flatlm import claims


def _loss(loss, kl, std=0.001):
    return {"loss": loss, "kl": kl, "loss_std": std}


def test_same_loss_band_uses_both_the_kl_bound_and_the_tolerance():
    ok = claims.same_loss(_loss(2.000, 0.010), _loss(2.004, 0.015))
    assert ok.ok and ok.tolerance == pytest.approx(0.005) and ok.gap == pytest.approx(0.004)
    assert not claims.same_loss(_loss(2.000, 0.010), _loss(2.006, 0.015)).ok  # gap 0.006 > 0.005
    assert claims.same_loss(_loss(2.000, 0.010, std=0.004), _loss(2.006, 0.015)).ok  # tolerance 2 x 0.004
    assert not claims.same_loss(_loss(2.000, 0.010), _loss(2.000, 0.021)).ok  # KL above 0.02
    assert "NOT the same loss" in claims.same_loss(_loss(2.0, 0.03), _loss(2.0, 0.01)).describe()
    # two functionals are never compared (a result without `average` is the default token one)
    sentence = {**_loss(2.0, 0.01), "average": "sentence"}
    assert claims.same_loss(sentence, dict(sentence)).ok and claims.same_loss(_loss(2.0, 0.01),
                                                                             {**sentence, "average": "token"}).ok
    with pytest.raises(claims.UserError, match="different averages"):
        claims.same_loss(_loss(2.0, 0.01), sentence)


def test_near_optimal_is_the_band_alone_with_the_kl_as_the_gap():
    """Against the optimal loss the gap is the model's KL: inside the band passes whatever the subset std."""
    ok = claims.near_optimal(_loss(2.015, 0.015, std=0.0001))
    assert ok.ok and ok.kl == (0.0, 0.015) and ok.gap == 0.015 and ok.tolerance == claims.MAX_KL
    assert claims.same_loss(_loss(2.0, 0.0, std=0.0001), _loss(2.015, 0.015, std=0.0001)).ok is False  # pairwise
    assert not claims.near_optimal(_loss(2.021, 0.021)).ok and claims.near_optimal(_loss(2.02, 0.02)).ok


def test_paired_effect_is_the_t_interval_of_the_per_seed_differences():
    control, treatment = {0: 0.30, 1: 0.32, 2: 0.31, 3: 0.29}, {0: 0.35, 1: 0.36, 2: 0.33, 3: 0.36, 7: 0.9}
    e = claims.paired_effect(control, treatment)
    d = np.array([0.05, 0.04, 0.02, 0.07])
    ci = stats.ttest_1samp(d, 0.0).confidence_interval(0.95)
    assert e.num_seeds == 4 and e.mean == pytest.approx(d.mean())
    assert (e.low, e.high) == pytest.approx((ci.low, ci.high))
    with pytest.raises(ValueError, match=">= 2 common seeds"):
        claims.paired_effect({0: 1.0}, {0: 2.0, 1: 3.0})


@pytest.mark.parametrize("treatment, sign, want", [
    ({0: 0.40, 1: 0.41, 2: 0.42}, +1, "reproduced"),          # clearly higher, as the paper says
    ({0: 0.20, 1: 0.21, 2: 0.22}, +1, "not reproduced"),      # clearly lower: the opposite direction
    ({0: 0.20, 1: 0.21, 2: 0.22}, -1, "reproduced"),          # ... which is right when the paper says lower
    ({0: 0.35, 1: 0.25, 2: 0.31}, +1, "inconclusive"),        # the interval straddles 0
])
def test_verdicts(treatment, sign, want):
    control = {0: 0.30, 1: 0.30, 2: 0.31}
    effect = claims.paired_effect(control, treatment)
    assert claims.verdict(effect, sign, [claims.same_loss(_loss(2.0, 0.01), _loss(2.001, 0.012))]) == want


def test_a_clear_effect_between_models_at_different_losses_is_inconclusive():
    effect = claims.paired_effect({0: 0.3, 1: 0.3, 2: 0.3}, {0: 0.5, 1: 0.51, 2: 0.52})
    violated = claims.same_loss(_loss(2.0, 0.01), _loss(2.05, 0.01))
    assert claims.verdict(effect, +1, []) == "reproduced"
    assert claims.verdict(effect, +1, [violated]) == "inconclusive"
