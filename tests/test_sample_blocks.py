"""`sample_blocks(ns, seeds)`: the sentences of one `sample(ns[b], seeds[b])` call per block (the reference),
concatenated, from one pass over all blocks (the stream source's batches of `data.stream_block`-row blocks). The
PCFG shares each tree level's work, the HMM its chain; both keep every block's own generator."""

from __future__ import annotations

import numpy as np
import pytest

from flatlm.languages import hmm as hmm_lib
from flatlm.languages.hmm import random_hmm
from flatlm.languages.pcfg import PCFG, random_grammar


def _assert_blocks(got, want, latents):
    np.testing.assert_array_equal(got.tokens, np.concatenate([c.tokens for c in want]))
    np.testing.assert_array_equal(got.lengths, np.concatenate([c.lengths for c in want]))
    assert got.latents.keys() == want[0].latents.keys() and bool(got.latents) == latents
    for k in got.latents:
        np.testing.assert_array_equal(got.latents[k], np.concatenate([c.latents[k] for c in want]), err_msg=k)
    assert got.tokens.dtype == want[0].tokens.dtype and got.lengths.dtype == want[0].lengths.dtype


@pytest.mark.parametrize("cap", [None, 3])  # 3: most sentences are longer and dropped
def test_pcfg_sample_blocks_gives_each_block_the_sentences_of_its_own_call(cap, monkeypatch):
    """`PCFG.sample_blocks(ns, seeds)` (one pass over all blocks: the stream source's batches) against the
    reference `sample(ns[b], seeds[b])` per block, concatenated: the same tokens, lengths and trees, for blocks of
    0, 1, 3 and 64 sentences. With the cap of 3 most draws are rejected, and blocks left short after the shared
    pass draw on alone (counted: it happens)."""
    from flatlm.languages.pcfg.sample import Sampler

    g = random_grammar(0)
    g = g if cap is None else PCFG(g.root, g.binary, g.emit, max_length=cap)
    assert g._rejects == (cap is not None)
    alone = []
    real_draw = Sampler.draw
    monkeypatch.setattr(Sampler, "draw", lambda self, *a, **kw: alone.append(1) or real_draw(self, *a, **kw))
    ns, seeds = [64, 0, 1, 3, 64], [5, 6, 7, 8, 9]
    for latents in (False, True):
        got = g.sample_blocks(ns, seeds, latents=latents)
        alone_in_blocks = len(alone)
        _assert_blocks(got, [g.sample(n, seed, latents=latents) for n, seed in zip(ns, seeds, strict=True)], latents)
        assert (alone_in_blocks > 0) == (cap is not None)
        alone.clear()


@pytest.mark.parametrize("chunk", [None, 5])  # 5: a block spans several chunks and a chunk-sized group several blocks
def test_hmm_sample_blocks_gives_each_block_the_sentences_of_its_own_call(chunk, monkeypatch):
    """The HMM draws each block's uniforms from its own generator in chunks of `_SAMPLE_CHUNK` rows, as its own
    call does, and runs the chain over groups of rows that span blocks: the same states and words."""
    if chunk:
        monkeypatch.setattr(hmm_lib, "_SAMPLE_CHUNK", chunk)
    h = random_hmm(0, num_states=6, vocab_size=8, length=5, num_blocks=2)
    ns, seeds = [64, 0, 1, 3, 12, 64], [5, 6, 7, 8, 9, 10]
    for latents in (False, True):
        got = h.sample_blocks(ns, seeds, latents=latents)
        _assert_blocks(got, [h.sample(n, seed, latents=latents) for n, seed in zip(ns, seeds, strict=True)], latents)
    with pytest.raises(ValueError, match="must be >= 0"):
        h.sample_blocks([3, -1], [0, 1])
