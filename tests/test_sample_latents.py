"""`Language.sample(n, seed, latents=False)`: the same sentences as with the latents, and no latents (the stream
source's training batches). The reference is each language's own `sample(n, seed)`, whose sentences and latents
the language's tests check against its exact distribution."""

from __future__ import annotations

import numpy as np
import pytest

from flatlm.languages.dyck import Dyck
from flatlm.languages.hmm import random_hmm
from flatlm.languages.opt import OPTConfig, OPTLanguage, random_params
from flatlm.languages.pcfg import dense_grammar, random_grammar
from flatlm.languages.pcfg.sample import TREE
from flatlm.languages.scb import random_scb

LANGUAGES = {
    "pcfg-released": lambda: random_grammar(0),
    "pcfg-dense-rejects": lambda: dense_grammar(0, max_length=10),  # derives longer sentences: redraws
    "hmm": lambda: random_hmm(0, length=6),
    "scb": lambda: random_scb(0),
    "dyck": lambda: Dyck(6),
    "opt": lambda: OPTLanguage(OPTConfig.named("tiny"), random_params(OPTConfig.named("tiny"), seed=0, std=0.15),
                               [5, 9, 17, 33, 40], length=4),
}


@pytest.mark.parametrize("name", list(LANGUAGES))
def test_sample_without_latents_gives_the_same_sentences(name):
    lang = LANGUAGES[name]()
    sizes = (1, 300) if name != "opt" else (3,)
    for n in sizes:
        for seed in (0, 7):
            full, bare = lang.sample(n, seed), lang.sample(n, seed, latents=False)
            assert full.latents and bare.latents == {}
            np.testing.assert_array_equal(bare.tokens, full.tokens)
            np.testing.assert_array_equal(bare.lengths, full.lengths)
            assert bare.tokens.dtype == full.tokens.dtype and bare.lengths.dtype == full.lengths.dtype


def test_pcfg_trees_of_a_rejecting_grammar_hold_its_words():
    """With latents (the default), a grammar that derives over-long sentences (drawn 25 % larger, then cut) still
    returns every tree array, T-shaped int32, whose preterminals emit the words (tests/test_pcfg_grammar.py checks whole
    derivations on a grammar that never rejects)."""
    g = dense_grammar(0, max_length=10)
    assert g._rejects
    corpus = g.sample(500, seed=3)
    assert tuple(corpus.latents) == TREE
    for name in TREE:
        assert corpus.latents[name].shape == corpus.tokens.shape and corpus.latents[name].dtype == np.int32
    # each word's preterminal emits it; positions beyond a sentence's length hold -1
    inside = np.arange(10)[None, :] < corpus.lengths[:, None]
    pre = corpus.latents["preterminal"]
    assert np.all(g.emit[pre[inside], corpus.tokens[inside]] > 0) and np.all(pre[~inside] == -1)
