"""Theorem 6.1 as a search: minimising Tr(H) over the zero-loss set from random starts reaches the closed-form
minimum 4 / (m sqrt T) of Lemma D.1, and what it finds transfers. The seeds (0) and start counts were fixed before
the results were looked at."""

from __future__ import annotations

import itertools
import math

import jax
import numpy as np
import pytest

from flatlm.languages import dyck as lang
from flatlm.theory import dyck as th
from flatlm.theory import dyck_search as ds


def _check_search(out, T, m):
    bound = 4.0 / (m * math.sqrt(T))  # closed form, not the library's flattest_trace
    assert out["bound"] == pytest.approx(bound, rel=1e-12)
    assert out["n_feasible"] >= 1
    assert abs(out["min_trace"] - bound) <= 1e-3 * bound
    for r in out["rows"]:
        if r["feasible"]:
            assert r["pretrain_loss"] <= 1e-12
            assert r["trace"] >= bound * (1 - 1e-9)  # Lemma D.1: no zero-loss solution is flatter


@pytest.mark.slow  # make test: the success probability against brute force
def test_search_reaches_the_closed_form_minimum_m4():
    """T = 6, m = 4, 2 starts of a short schedule: Tr(H) (dense jax.hessian at the end) within 1e-3 of 4/(m sqrt T),
    and every solution at the minimum has uniform attention, V's rows along +-1_T and zero downstream loss from 8
    samples whenever the sample has both signs of g*."""
    cfg = ds.SearchConfig(starts=2, rounds=8, inner_steps=150, ns=(8,), down_seeds=(0, 1))
    with jax.enable_x64():
        out = ds.search(6, 4, cfg, seed=0)
    _check_search(out, 6, 4)
    for r in out["rows"]:
        if r["feasible"] and r["trace_gap"] <= 1e-3:
            assert r["attention_spread"] < 1e-4 and r["alignment"] > 0.999
            for s, loss in zip(cfg.down_seeds, r["downstream"]["8"]):
                y = lang.downstream_sample(6, 8, 10_000 * 8 + s)["y"]
                assert (loss < ds.SUCCESS_TOL) == (np.any(y > 0) and np.any(y < 0))


@pytest.mark.slow
def test_search_reaches_the_closed_form_minimum_m2():
    """T = 6, m = 2 (Theorem 6.1's smallest width), 8 starts of the default schedule (about a minute): within 1e-3
    of the minimum; the starts that do not reach zero loss are reported, not counted."""
    with jax.enable_x64():
        out = ds.search(6, 2, ds.SearchConfig(starts=8, ns=(4, 16), down_seeds=(0, 1, 2)), seed=0)
    _check_search(out, 6, 2)
    assert out["n_at_bound"] >= 1
    assert out["downstream_at_bound"]["16"] < 1e-10


def test_success_probability_matches_brute_force():
    """The exact probability that the transferable solution's head on n samples transfers with zero loss, against
    brute force over every n-sample of T = 4 strings (all 16^n of them, fitted with the min-norm head)."""
    T = 4
    down = lang.downstream_population(T)
    with jax.enable_x64():
        sol = th.transferable_solution(T, 2)
        for n in (1, 2, 3):
            hits = []
            for idx in itertools.product(range(2**T), repeat=n):
                tokens = lang.all_strings(T)[list(idx)]
                train = {"x": lang.encode(tokens), "y": lang.g_star(tokens)}
                hits.append(th.downstream_loss(sol, train, down) < ds.SUCCESS_TOL)
            assert np.mean(hits) == pytest.approx(ds.success_probability(T, n), abs=1e-12)
    assert ds.success_probability(6, 4) == pytest.approx(0.639, abs=1e-3)  # below Theorem 6.1's 1 - 2^-4
