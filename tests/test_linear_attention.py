"""The SCB linear transformer: with the ground-truth parameters it outputs the exact next-word distribution (against
the joint-based MLM conditional of the last position, enumerated) and reaches the conditional entropy (float64,
1e-10); the distance is gauge-invariant; one optimizer step equals the hand-written projected SGD + soft threshold;
a short proximal (and SGD) run from the uniform start closes most of the distance, V's column sums kept at 1."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from flatlm.languages.scb import correlated_scb, random_scb
from flatlm.models import linear_attention as la
from flatlm.train import linear_attention as tla


def _all_sentences(scb):
    return np.array(list(itertools.product(range(scb.vocab_size), repeat=scb.max_length)))


def test_ground_truth_params_give_the_exact_next_word_distribution_and_reach_the_entropy():
    scb = random_scb(2, num_words=3, context_length=4, sparsity=2, concentration=0.5)
    X = _all_sentences(scb)
    truth = la.truth_params(scb)
    q_last = scb.conditionals(X, np.full(len(X), scb.max_length))[:, -1]  # joint normalised over the last word
    with jax.enable_x64(True):
        y_hat = np.asarray(la.next_word_probs(truth, X))
        assert y_hat.dtype == np.float64
        np.testing.assert_allclose(y_hat, q_last, rtol=0, atol=1e-12)
        q = scb.next_word(X)
        entropy = -np.mean(np.sum(np.where(q > 0, q * np.log(np.where(q > 0, q, 1.0)), 0.0), axis=1))
        assert float(la.exact_cross_entropy(truth, X, q)) == pytest.approx(entropy, abs=1e-10)
        assert float(la.exact_excess(truth, X, q)) < 1e-25
        # a wrong model pays its KL: cross-entropy of the uniform start = entropy + mean KL(q || uniform)
        uniform = la.uniform_params(3, 4, np.float64)
        kl = np.mean(np.sum(np.where(q > 0, q * np.log(np.where(q > 0, q, 1.0) * 3), 0.0), axis=1))
        assert float(la.exact_cross_entropy(uniform, X, q)) == pytest.approx(entropy + kl, abs=1e-10)


def test_distance_to_truth_is_zero_at_the_truth_and_gauge_invariant():
    scb = random_scb(0, num_words=5, context_length=6, sparsity=2)
    truth = la.truth_params(scb)
    assert la.distance_to_truth(truth, scb) == {"V": 0.0, "A": 0.0, "scale": pytest.approx(1.0)}
    scaled = la.distance_to_truth({"V": 2.5 * truth["V"], "A": truth["A"] / 2.5}, scb)
    assert scaled["V"] < 1e-12 and scaled["A"] < 1e-12 and scaled["scale"] == pytest.approx(0.4)
    E = np.eye(6, 5)  # one 1 per column: every column sum of A grows by 0.1, so c = 1.1
    off = la.distance_to_truth({"V": truth["V"], "A": truth["A"] + 0.1 * E}, scb)
    assert off["scale"] == pytest.approx(1.1)
    assert off["V"] == pytest.approx(0.1 * np.linalg.norm(truth["V"]), rel=1e-9)
    assert off["A"] == pytest.approx(0.1 / 1.1 * np.linalg.norm(E - truth["A"]), rel=1e-9)


def test_one_prox_step_is_projected_sgd_then_soft_threshold_on_A():
    scb = random_scb(1, num_words=4, context_length=5, sparsity=2)
    rng = np.random.default_rng(0)
    params = {"V": rng.normal(size=(4, 4)).astype(np.float32), "A": rng.normal(size=(5, 4)).astype(np.float32)}
    batch = {"tokens": scb.sample(32, seed=0).tokens}
    cfg = tla.LinearTrainConfig(method="prox", lr=0.3, lam=0.5)
    opt = tla.optimizer(cfg)
    g = jax.grad(la.squared_loss)(params, batch)
    updates, _ = opt.update(g, opt.init(params), params)
    V = params["V"] - 0.3 * (g["V"] - g["V"].mean(0, keepdims=True))
    z = params["A"] - 0.3 * g["A"]
    A = np.sign(z) * np.maximum(np.abs(z) - 0.15, 0)
    np.testing.assert_allclose(params["V"] + updates["V"], V, atol=1e-6)
    np.testing.assert_allclose(params["A"] + updates["A"], A, atol=1e-6)
    assert (A == 0).any()


def test_short_proximal_run_closes_the_distance():
    scb = random_scb(0, num_words=6, context_length=8, sparsity=2, concentration=0.5)
    start = la.uniform_params(6, 8)
    runs = {m: tla.train(scb, start, tla.LinearTrainConfig(method=m, lr=0.1, lam=1e-3, batch_size=64,
                                                             max_samples=64_000, log_every=50, seed=0))
            for m in ("sgd", "prox")}
    for params, rows in runs.values():
        assert rows[0]["samples"] == 0 and rows[-1]["samples"] == 64_000
        assert rows[-1]["distance"] < 0.3 * rows[0]["distance"], (rows[0], rows[-1])
        np.testing.assert_allclose(np.asarray(params["V"]).sum(0), 1.0, atol=1e-4)  # columns kept on sum 1
    assert tla.samples_to_target(runs["prox"][1], 0.5 * runs["prox"][1][0]["distance"]) <= 64_000


def test_correlated_scb_keeps_one_factor():
    scb = random_scb(0, num_words=5, context_length=6, sparsity=2)
    same_q = correlated_scb(scb, seed=7, keep="patterns", mix=0.3)
    np.testing.assert_array_equal(same_q.patterns, scb.patterns)
    fresh = random_scb(7, 5, 6, 2)
    np.testing.assert_allclose(same_q.transition, 0.7 * scb.transition + 0.3 * fresh.transition, atol=1e-15)
    same_p = correlated_scb(scb, seed=7, keep="transition", mix=1.0)
    np.testing.assert_array_equal(same_p.transition, scb.transition)
    np.testing.assert_allclose(same_p.patterns, fresh.patterns, atol=1e-15)


def test_transfer_from_the_same_patterns_needs_fewer_samples_and_the_cli_refuses_bad_input():
    import dataclasses

    from flatlm.cli.main import main
    from flatlm.theory.scb_transfer import PRESETS, run_transfer

    cfg = dataclasses.replace(PRESETS["tiny"], seeds=(0,), methods=("sgd", "prox"), stop_at_target=True)
    rows = {(r["method"], r["start"]): r for r in run_transfer(cfg)}
    assert sorted(rows) == [("prox", "finetuned"), ("prox", "scratch"), ("sgd", "finetuned"), ("sgd", "scratch")]
    scb = random_scb(0, cfg.num_words, cfg.context_length, cfg.sparsity, cfg.concentration)
    uniform = tla.distance(la.distance_to_truth(la.uniform_params(cfg.num_words, cfg.context_length), scb))
    for method in ("sgd", "prox"):
        scratch, tuned = rows[(method, "scratch")], rows[(method, "finetuned")]
        assert scratch["start_distance"] == pytest.approx(uniform, rel=1e-5)
        assert scratch["final_distance"] <= cfg.target and tuned["final_distance"] <= cfg.target
        # the source shares Q, so the pre-trained start is far closer and the target takes several times fewer samples
        assert tuned["start_distance"] < 0.6 * scratch["start_distance"]
        assert 3 * tuned["samples_to_target"] < scratch["samples_to_target"]
    assert main(["theory", "scb", "--mix", "2"]) == 2
