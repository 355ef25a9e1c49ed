"""Lemma 4.2 (Bartlett identity) on a tiny tanh MLM whose labels come from the model itself, checked against an
independent brute-force Fisher (and, slow, on the tiny BERT); and the noise ablation: from a converged point only
SGD flattens."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, run_cli
from flatness_tiny import fast_compile, float64_everywhere, mlm_batch, tiny_bert

from flatlm.flatness import bartlett as bt

V, T, D, H = 3, 3, 4, 6


def apply(variables, tokens, deterministic=True):
    """A tiny MLM: token embeddings plus their mean, one tanh layer, logits per position (tanh, so the Hessian's
    residual term has a non-zero trace and the identity is not trivially the Gauss-Newton one)."""
    p = variables["params"]
    e = p["E"][tokens]
    h = jnp.tanh((e + e.mean(axis=1, keepdims=True)) @ p["W1"] + p["b1"])
    return h @ p["W2"] + p["b2"]


def init(key):
    ks = jax.random.split(key, 4)
    return {"E": jax.random.normal(ks[0], (V, D)), "W1": jax.random.normal(ks[1], (D, H)),
            "b1": 0.1 * jax.random.normal(ks[2], (H,)), "W2": jax.random.normal(ks[3], (H, V)), "b2": jnp.zeros(V)}


CONTEXTS = np.array(list(itertools.product(range(V), repeat=T)))  # all 27 contexts


def brute_force_fisher(params):
    """sum over contexts, positions and labels of p(y) ||grad log p(y)||^2, averaged over (context, position)."""
    logp = lambda q, tokens, t, y: jax.nn.log_softmax(apply({"params": q}, tokens[None])[0, t])[y]
    sq_grad = jax.jit(lambda q, tokens, t, y: sum(jnp.sum(g**2) for g in jax.tree.leaves(
        jax.grad(logp)(q, tokens, t, y))))
    logp_jit = jax.jit(logp)
    total = 0.0
    for tokens in CONTEXTS:
        for t in range(T):
            for y in range(V):
                total += np.exp(float(logp_jit(params, tokens, t, y))) * float(sq_grad(params, tokens, t, y))
    return total / (len(CONTEXTS) * T)


def test_bartlett_identity_at_the_optimum():
    """Labels from the model: the population Hessian (dense jax.hessian) equals the Fisher to rounding, the
    gradient vanishes, and both match the brute-force Fisher (first-order gradients, label by label)."""
    with jax.enable_x64():
        params = init(jax.random.PRNGKey(0))
        pop = bt.population_batch(apply, params, CONTEXTS)
        out = bt.bartlett_check(apply, params, pop, jax.random.PRNGKey(1), label_sources=("expected", "true"))
        ref = brute_force_fisher(params)
    assert out["fisher"] == pytest.approx(ref, rel=1e-10)
    assert out["true"]["trace"] == pytest.approx(ref, rel=1e-10)
    assert out["expected"]["trace"] == pytest.approx(ref, rel=1e-10)
    assert out["grad_norm"] < 1e-12


def test_bartlett_identity_with_sampled_labels_and_off_the_optimum():
    """Labels drawn from the model: Tr(H) on them is within 3 standard errors of Tr(F) (exact and Hutchinson
    Hessians). Labels from another model (not at the optimum) or fixed targets: Tr(H) is far from Tr(F)."""
    with jax.enable_x64():
        params = init(jax.random.PRNGKey(0))
        ctx = {"tokens": jnp.asarray(CONTEXTS), "targets": jnp.zeros(CONTEXTS.shape, jnp.int32),
               "weights": jnp.ones(CONTEXTS.shape)}
        exact = bt.bartlett_check(apply, params, ctx, jax.random.PRNGKey(1), num_label_draws=16)
        hutch = bt.bartlett_check(apply, params, ctx, jax.random.PRNGKey(2), hessian="hutchinson", num_probes=128,
                                  num_label_draws=8, label_sources=("sampled",))
        other = bt.population_batch(apply, init(jax.random.PRNGKey(5)), CONTEXTS)
        off = bt.bartlett_check(apply, params, other, jax.random.PRNGKey(3), label_sources=("true",))
    for res in (exact, hutch):
        s = res["sampled"]
        assert s["stderr"] > 0 and abs(s["gap"]) < 3 * s["stderr"] and s["stderr"] < 0.1 * res["fisher"]
    assert abs(exact["true"]["rel_gap"]) > 0.5  # fixed targets: the model is not at their optimum
    assert abs(off["true"]["rel_gap"]) > 0.2 and off["grad_norm"] > 0.1


def test_bartlett_error_bars_count_each_noise_once(monkeypatch):
    """Audit regression, the formulas with stand-in estimates: the sampled source's stderr is the spread of the
    draws' means (each already holds its probe noise; it was added again), and a Hutchinson Hessian on several
    batches reports its probe stderr (the trace over exactly these batches, beside the Fisher of the same ones),
    not the between-batch stderr, which counts their spread as data; so does a sampled Fisher."""
    from flatlm.flatness.estimates import TraceEstimate

    with jax.enable_x64():
        params = init(jax.random.PRNGKey(0))
        ctx = {"tokens": jnp.asarray(CONTEXTS), "targets": jnp.zeros(CONTEXTS.shape, jnp.int32),
               "weights": jnp.ones(CONTEXTS.shape)}
        draws = iter([2.0, 3.0, 7.0])
        monkeypatch.setattr(bt, "_hessian_trace", lambda *a: (next(draws), 10.0))
        out = bt.bartlett_check(apply, params, ctx, jax.random.PRNGKey(1), num_label_draws=3,
                                label_sources=("sampled",))
        assert out["sampled"]["stderr"] == pytest.approx(np.std([2.0, 3.0, 7.0], ddof=1) / np.sqrt(3))
        monkeypatch.undo()
        monkeypatch.setattr(bt, "hutchinson_trace", lambda *a, **k: TraceEstimate(4.0, 5.0, 8, probe_stderr=0.5))
        assert bt._hessian_trace(None, params, [ctx, ctx], None, "hutchinson", 4) == (4.0, 0.5)
        # the sampled Fisher likewise: the draws' error over these contexts, not the batches' spread
        monkeypatch.setattr(bt, "fisher_trace", lambda *a, **k: TraceEstimate(3.0, 2.0, 8, probe_stderr=0.25))
        out = bt.bartlett_check(apply, params, ctx, jax.random.PRNGKey(1), fisher="sampled", label_sources=())
        assert (out["fisher"], out["fisher_stderr"]) == (3.0, 0.25)


def test_noise_ablation_only_sgd_flattens_faster_with_lr_over_batch():
    """From the teacher's own function reparameterised sharply (E diag(c), W1 / c: same conditionals, so the
    population optimum, with a larger Tr(H)): full-batch GD stays; SGD on fresh samples lowers Tr(H), faster with a
    larger lr and a smaller batch. (Thresholds from a prototype run with another key.)"""
    with jax.enable_x64():
        params = init(jax.random.PRNGKey(0))
        c = jnp.array([3.0, 1 / 3, 2.0, 0.5])
        start = {**params, "E": params["E"] * c, "W1": params["W1"] / c[:, None]}
        pop = bt.population_batch(apply, params, CONTEXTS)
        sample = bt.teacher_sampler(apply, params, CONTEXTS)
        runs = bt.noise_ablation(apply, start, pop, sample, [(0.02, 0), (0.02, 8), (0.04, 8), (0.02, 2)], 2000, 500,
                                 jax.random.PRNGKey(7))
    gd, slow, fast_lr, small_b = runs
    tr0 = gd["trace"][0]
    assert np.allclose(gd["trace"], tr0, rtol=1e-9) and np.allclose(gd["loss"], gd["loss"][0], rtol=1e-12)
    for r in (slow, fast_lr, small_b):
        assert r["trace"][0] == tr0 and np.mean(r["trace"][1:]) < 0.8 * tr0
    assert fast_lr["mean_rate"] > slow["mean_rate"] and small_b["mean_rate"] > slow["mean_rate"]


@pytest.mark.slow
def test_bartlett_identity_on_tiny_bert():
    """The same check on the tiny BERT of the flatness tests (two MLM batches, labels drawn from the model): the
    label-expected Hessian equals the Fisher to rounding; on sampled labels within 3 standard errors."""
    with fast_compile(), float64_everywhere():
        model, params = tiny_bert(seed=1)
        out = bt.bartlett_check(model.apply, params, [mlm_batch(0), mlm_batch(1)], jax.random.PRNGKey(0),
                                num_label_draws=16, label_sources=("expected", "sampled"))
    assert abs(out["expected"]["rel_gap"]) < 1e-9
    s = out["sampled"]
    assert s["stderr"] > 0 and abs(s["gap"]) < 3 * s["stderr"]


def test_sampled_fisher_option_agrees_with_the_exact_one():
    """fisher="sampled" (the paper's estimator) is within 3 standard errors of the exact Fisher, and its stderr
    enters the z of the gaps."""
    with jax.enable_x64():
        params = init(jax.random.PRNGKey(0))
        pop = bt.population_batch(apply, params, CONTEXTS)
        out = bt.bartlett_check(apply, params, pop, jax.random.PRNGKey(4), label_sources=("true",),
                                fisher="sampled", fisher_draws=200)
    assert out["fisher_stderr"] > 0
    assert abs(out["true"]["gap"]) < 3 * out["fisher_stderr"] and out["true"]["z"] is not None


@pytest.mark.slow
def test_checkpoint_bartlett_on_a_trained_run(tmp_path):
    """A 20-step tiny HMM run: on its last checkpoint, Tr(H) on labels drawn from the model is within 3 standard
    errors of the sampled Fisher (the identity holds in expectation at any params for the model's own labels)."""
    wd = tmp_path / "w"
    proc = run_cli("train", "--config", str(REPO / "configs" / "hmm_mlm.py") + ":tiny", "--workdir", str(wd),
                   "--quiet", "--config.train.steps=20", "--config.checkpoint.every=20",
                   "--config.train.eval_every=20")
    assert proc.returncode == 0, proc.stderr
    out = bt.checkpoint_bartlett(str(wd), jax.random.PRNGKey(0), num_batches=2, batch_size=8, num_probes=16,
                                 num_label_draws=4)
    assert out["step"] == 20 and out["fisher"] > 0 and out["fisher_stderr"] > 0
    assert abs(out["sampled"]["z"]) < 3 and out["true"]["trace"] > 0
