"""The sparse contextual bigram language: exact joint, MLM and next-word conditionals against brute-force
enumeration (float64, 1e-10), and sampling against the joint."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from flatlm.languages.scb import SCB, random_scb


@pytest.fixture(scope="module")
def tiny():
    return random_scb(3, num_words=3, context_length=3, sparsity=2)


def _all_sentences(lang):
    return np.array(list(itertools.product(range(lang.vocab_size), repeat=lang.max_length)))


def _brute_joint(lang, x):
    """P(x) straight from the generative story: mu per context word, then the mixture over attended positions."""
    ctx, last = x[:-1], x[-1]
    p = np.prod([lang.mu[w] for w in ctx])
    return p * sum(lang.patterns[ctx[-1], s] * lang.transition[last, ctx[s]] for s in range(len(ctx)))


def test_joint_and_conditionals_equal_brute_force_enumeration(tiny):
    X = _all_sentences(tiny)
    L = tiny.max_length
    brute = np.array([_brute_joint(tiny, x) for x in X])
    assert brute.sum() == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(np.exp(tiny.log_prob(X, np.full(len(X), L))), brute, rtol=1e-10, atol=1e-15)
    q = tiny.conditionals(X, np.full(len(X), L))
    index = {tuple(x): i for i, x in enumerate(X)}
    for b in range(0, len(X), 7):
        for j in range(L):
            rows = [index[tuple(np.concatenate([X[b][:j], [w], X[b][j + 1:]]))] for w in range(tiny.vocab_size)]
            want = brute[rows] / brute[rows].sum()
            np.testing.assert_allclose(q[b, j], want, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(tiny.next_word(X), q[:, -1], rtol=1e-10, atol=1e-14)


def test_sampling_matches_the_joint(tiny):
    corpus = tiny.sample(60_000, seed=1)
    X = _all_sentences(tiny)
    codes = (corpus.tokens * (tiny.vocab_size ** np.arange(tiny.max_length)[::-1])).sum(1)
    freq = np.bincount(codes, minlength=len(X)) / len(corpus)
    p = np.exp(tiny.log_prob(X, np.full(len(X), tiny.max_length)))
    assert 0.5 * np.abs(freq - p).sum() < 0.02  # total variation; sampling noise ~ 0.01 at 81 cells
    assert set(np.unique(corpus.latents["position"])) <= set(np.flatnonzero(tiny.patterns.sum(0)))


def test_invalid_scbs_and_sentences_are_refused(tiny):
    with pytest.raises(ValueError, match="columns"):
        SCB(np.ones((3, 3)), tiny.patterns)
    with pytest.raises(ValueError, match="exactly 4 words"):
        tiny.conditionals(np.zeros((2, 4), np.int32), np.array([3, 4]))
    with pytest.raises(ValueError, match="sparsity"):
        random_scb(0, context_length=3, sparsity=4)
