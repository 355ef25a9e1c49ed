"""The statistics of a reproduction claim: "same loss", paired effects over pre-training seeds, and a verdict.

"Same loss" (the regime the paper is about) is defined once, here: every compared model has exact KL <=
`MAX_KL` nats, and two compared exact losses differ by less than max(`MIN_LOSS_GAP` nats, 2 x the larger of
their subset standard deviations). `same_loss` returns both numbers so a report can print them; `near_optimal`
is the check against the optimal loss itself (the band alone).

An effect is measured over pre-training seeds fixed in advance: per-seed differences (treatment - control),
their mean and a two-sided 95% t-interval (`paired_effect`). The verdict of a claim (`verdict`):
  "inconclusive"   when a compared pair is not at the same loss (the claim is about equal-loss models), or
                   when the interval contains 0 (too few seeds or too small an effect to tell),
  "reproduced"     when the interval lies entirely on the side the paper reports,
  "not reproduced" when it lies entirely on the other side.
The thresholds are constants of this module, not arguments a caller tunes per claim.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import stats

from flatlm.errors import UserError

MAX_KL = 0.02  # nats: "near-optimal" pre-training loss
MIN_LOSS_GAP = 0.005  # nats: the smallest loss difference that counts as "different"
CONFIDENCE = 0.95
VERDICTS = ("reproduced", "not reproduced", "inconclusive")


@dataclasses.dataclass(frozen=True)
class SameLoss:
    """The "same loss" check of two exact-loss results (nats)."""

    ok: bool
    kl: tuple[float, float]
    gap: float  # |loss_a - loss_b|
    tolerance: float  # max(MIN_LOSS_GAP, 2 x the larger subset std)

    def describe(self) -> str:
        """One line for a report: both KLs, the gap and the tolerance."""
        mark = "same loss" if self.ok else "NOT the same loss"
        return (f"{mark}: KL {self.kl[0]:.4f} / {self.kl[1]:.4f} nats (<= {MAX_KL}), |loss gap| {self.gap:.4f} "
                f"vs tolerance {self.tolerance:.4f} nats")


def same_loss(a: dict, b: dict) -> SameLoss:
    """`a`, `b`: exact-loss results with `loss`, `kl` and `loss_std` (std over the evaluation's subsets), over the
    same `average` of (sentence, position) pairs (a result without one is taken as the "token" default): a token
    average beside a sentence average is two functionals, and the check refuses it."""
    avg_a, avg_b = a.get("average", "token"), b.get("average", "token")
    if avg_a != avg_b:
        raise UserError(f"exact losses over different averages ({avg_a!r} vs {avg_b!r}) are not comparable; "
                        "evaluate both with the same eval.loss_average")
    gap = abs(float(a["loss"]) - float(b["loss"]))
    tolerance = max(MIN_LOSS_GAP, 2.0 * max(float(a.get("loss_std", 0.0)), float(b.get("loss_std", 0.0))))
    kl = (float(a["kl"]), float(b["kl"]))
    return SameLoss(ok=max(kl) <= MAX_KL and gap < tolerance, kl=kl, gap=gap, tolerance=tolerance)


def near_optimal(a: dict) -> SameLoss:
    """The "same loss" check of a trained model against the optimal one (the lookup table: loss = the entropy, KL 0):
    the model is inside the band. Its gap to the entropy, measured on the same sentences, is its KL itself, so the
    pairwise tolerance (made for two estimated losses) would ask for a narrower band than `MAX_KL`."""
    kl = float(a["kl"])
    return SameLoss(ok=kl <= MAX_KL, kl=(0.0, kl), gap=kl, tolerance=MAX_KL)


@dataclasses.dataclass(frozen=True)
class Effect:
    """Mean per-seed difference (treatment - control) with its two-sided t-interval."""

    mean: float
    low: float
    high: float
    differences: tuple[float, ...]
    over: str = "seeds"  # what the interval is over (a rank correlation's is over models)
    seeds: tuple[int, ...] = ()  # the seed of each difference (paired effects)

    @property
    def num_seeds(self) -> int:
        """How many paired seeds the interval is over."""
        return len(self.differences)

    def describe(self, scale: float = 1.0, unit: str = "") -> str:
        """`mean [low, high]` over n seeds, multiplied by `scale` (e.g. 100 for percentage points)."""
        return (f"{scale * self.mean:+.3g}{unit} [{scale * self.low:+.3g}, {scale * self.high:+.3g}] "
                f"({int(CONFIDENCE * 100)}% CI, {self.num_seeds} {self.over})")


def t_half_width(values) -> float:
    """Half-width of the `CONFIDENCE` t-interval of the mean of `values` (>= 2 of them)."""
    v = np.asarray(values, np.float64)
    return float(stats.t.ppf(0.5 + CONFIDENCE / 2, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))


def paired_effect(control: dict[int, float], treatment: dict[int, float]) -> Effect:
    """The paired effect over the seeds both dicts have ({seed: value}); needs at least 2 common seeds."""
    seeds = sorted(set(control) & set(treatment))
    if len(seeds) < 2:
        raise ValueError(f"a paired interval needs >= 2 common seeds, got {seeds}")
    d = np.asarray([treatment[s] - control[s] for s in seeds], np.float64)
    mean = float(d.mean())
    half = t_half_width(d)
    return Effect(mean, mean - half, mean + half, tuple(float(x) for x in d), seeds=tuple(seeds))


def verdict(effect: Effect, expected_sign: int, checks: list[SameLoss] = ()) -> str:
    """"reproduced" / "not reproduced" / "inconclusive" for an effect the paper reports with sign
    `expected_sign` (+1: treatment higher), given the "same loss" checks of the compared models."""
    if expected_sign not in (1, -1):
        raise ValueError(f"expected_sign must be +1 or -1, got {expected_sign}")
    if any(not c.ok for c in checks):
        return "inconclusive"
    low, high = expected_sign * effect.low, expected_sign * effect.high
    lo, hi = min(low, high), max(low, high)
    if lo > 0:
        return "reproduced"
    if hi < 0:
        return "not reproduced"
    return "inconclusive"
