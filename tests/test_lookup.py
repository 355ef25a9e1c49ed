"""Lookup-table baseline against the Bayes rate E[max_j P(z_k = j | x)] of HMM task-k (sampled states)."""

import os

import numpy as np
import pytest

from flatlm.evaluate import lookup
from flatlm.evaluate.probe import ProbeConfig

hmm = pytest.importorskip("flatlm.languages.hmm")

K_POS = 3  # task-k: the hidden state at position 3 of 8
# lr 1e-2 and batch 128: on 4096 sentences the paper's lr 1e-3 under-fits within a test's budget
CFG = ProbeConfig(epochs=60, batch_size=128, lr=1e-2, num_seeds=2)


def _task(language, n_train=4096, n_test=2048, seed=1):
    corpus = language.sample(n_train + n_test, seed=seed)
    tok, ln, z = corpus.tokens, corpus.lengths, corpus.latents["states"][:, K_POS]
    post_NK = language.state_posteriors(tok[n_train:], ln[n_train:])[:, K_POS]
    split = lambda a: {"train": a[:n_train], "test": a[n_train:]}
    return split(tok), split(ln), split(z), lookup.bayes_accuracy(post_NK), n_test


def test_lookup_features_are_the_conditionals():
    language = hmm.random_hmm(0, num_states=4, vocab_size=6, length=5, num_blocks=2)
    corpus = language.sample(7, seed=0)
    x = lookup.lookup_features(language, corpus.tokens, corpus.lengths, batch_size=3, progress=False)
    q = language.conditionals(corpus.tokens, corpus.lengths)
    np.testing.assert_allclose(x, q.reshape(7, 5 * 6), atol=1e-6)
    xp = lookup.lookup_features(language, corpus.tokens, corpus.lengths, projection_dim=4, progress=False)
    assert xp.shape == (7, 4)


def test_lookup_features_with_words_append_the_one_hot_words_inside_each_sentence():
    language = hmm.random_hmm(0, num_states=4, vocab_size=6, length=5, num_blocks=2)
    corpus = language.sample(7, seed=0)
    lengths = np.array([5, 3, 5, 1, 4, 5, 2])  # shorter sentences: positions beyond the length get no word
    x = lookup.lookup_features(language, corpus.tokens, lengths, batch_size=3, progress=False, with_words=True)
    q = language.conditionals(corpus.tokens, lengths).reshape(7, 30)
    words = np.zeros((7, 5, 6), np.float32)
    for n in range(7):
        for t in range(lengths[n]):
            words[n, t, corpus.tokens[n, t]] = 1.0
    np.testing.assert_allclose(x, np.concatenate([q, words.reshape(7, 30)], axis=1), atol=1e-6)
    # task corpora pad beyond the length with the pad id (= the vocabulary size): an IndexError before (audit)
    padded = np.where(np.arange(5)[None, :] < lengths[:, None], corpus.tokens, 6)
    np.testing.assert_array_equal(lookup.one_hot_words(padded, lengths, 6), words.reshape(7, 30))


def test_lookup_reaches_bayes_rate_when_emissions_identify_states():
    # one state per block: each state emits its own two words (w.p. 0.99), so x pins down z
    language = hmm.random_hmm(0, num_states=8, vocab_size=16, length=8, num_blocks=8, leakage=0.3,
                              emission_leakage=0.01)
    tokens, lengths, labels, bayes, n_test = _task(language)
    out = lookup.run_lookup_probe(language, tokens, lengths, labels, CFG, num_classes=8, batch_size=2048,
                                  progress=False)
    assert out["kind"] == "lookup_table" and out["feature_dim"] == 8 * 16
    assert bayes > 0.97
    assert out["accuracy"]["test"]["mean"] >= bayes - 0.02


def test_lookup_is_at_most_bayes_rate_on_a_generic_hmm(tmp_path):
    language = hmm.random_hmm(1, num_states=8, vocab_size=16, length=8, num_blocks=2)
    tokens, lengths, labels, bayes, n_test = _task(language)
    out = lookup.run_lookup_probe(language, tokens, lengths, labels, CFG, num_classes=8, batch_size=2048,
                                  cache_dir=str(tmp_path), progress=False)
    acc = out["accuracy"]["test"]["mean"]
    noise = np.sqrt(bayes * (1 - bayes) / n_test)  # std of a test accuracy near the Bayes rate
    assert acc <= bayes + 3 * noise
    assert acc > 1 / 8 + 0.1  # and well above chance
    assert sorted(os.listdir(tmp_path)) == ["features-steplookup-test-full.npz",
                                            "features-steplookup-train-full.npz"]
