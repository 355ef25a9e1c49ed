"""MLM masking: the paper's single-position masking and the released BERT 15% / 80-10-10 with a cap."""

from __future__ import annotations

import numpy as np
import pytest

from flatlm.data.masking import BlockGenerators, mask_batch

V = 20  # words 0..19, pad 20, mask 21


def _corpus(n=4000, T=16, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, T + 1, size=n)
    tokens = rng.integers(0, V, size=(n, T))
    tokens = np.where(np.arange(T)[None] < lengths[:, None], tokens, V)
    return tokens, lengths


def test_single_masks_exactly_one_word_uniformly():
    tokens, lengths = _corpus()
    b = mask_batch(tokens, lengths, V, np.random.default_rng(1), masking="single")
    assert (b["weights"].sum(1) == 1).all()
    pos = b["weights"].argmax(1)
    assert (pos < lengths).all()
    assert (b["tokens"][np.arange(len(pos)), pos] == V + 1).all()
    assert (np.where(b["weights"] > 0, tokens, b["tokens"]) == tokens).all()  # nothing else changes
    assert (b["targets"] == tokens).all()
    # uniform over positions: relative position pos/length ~ U[0,1)
    u = (pos + 0.5) / lengths
    assert abs(u.mean() - 0.5) < 0.02


def test_bert_masking_rates_and_cap():
    tokens, lengths = _corpus(n=20000, T=32)
    b = mask_batch(tokens, lengths, V, np.random.default_rng(2), masking="bert", mask_prob=0.15, max_predictions=5)
    w = b["weights"] > 0
    per = w.sum(1)
    assert per.min() >= 1 and per.max() <= 5
    assert not (w & (np.arange(32)[None] >= lengths[:, None])).any()  # never a pad
    sel_in, sel_orig = b["tokens"][w], tokens[w]
    frac_mask = (sel_in == V + 1).mean()
    frac_keep = (sel_in == sel_orig).mean()  # kept (10%) + random that hit the same word (10% / V)
    assert abs(frac_mask - 0.8) < 0.015
    assert abs(frac_keep - (0.1 + 0.1 / V)) < 0.012
    # selection rate close to 15% where the cap does not bind (short sentences)
    short = lengths <= 12
    rate = per[short].sum() / lengths[short].sum()
    assert 0.15 < rate < 0.22  # >= 15% because every sentence gets at least one prediction


def test_masking_is_deterministic_in_the_generator():
    tokens, lengths = _corpus(n=50)
    a = mask_batch(tokens, lengths, V, np.random.default_rng(7), masking="bert")
    b = mask_batch(tokens, lengths, V, np.random.default_rng(7), masking="bert")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_positions_hold_every_prediction_once():
    """`positions` [B, P] lists each row's weighted positions (ascending) first, the rest unweighted, no repeats:
    `losses.mlm_loss` runs the head there only (a weighted position outside them would make its loss NaN)."""
    tokens, lengths = _corpus(n=3000, T=12)
    cases = (("single", {}, 1), ("bert", dict(max_predictions=5), 5), ("bert", dict(max_predictions=20), 12),
             ("bert", dict(mask_prob=1.0, max_predictions=3), 3))
    for masking, kw, P in cases:
        b = mask_batch(tokens, lengths, V, np.random.default_rng(3), masking=masking, **kw)
        pos, w = b["positions"], b["weights"]
        assert pos.shape == (len(tokens), P) and pos.dtype == np.int32
        assert all(len(set(row)) == P for row in pos.tolist())
        covered = np.take_along_axis(w, pos, axis=1)
        assert (covered.sum(1) == w.sum(1)).all(), masking  # every weighted position is among them
        n = w.sum(1).astype(int)
        assert all((np.diff(row[:k]) > 0).all() and (covered[i, :k] == 1).all()
                   for i, (row, k) in enumerate(zip(pos, n)))


def test_last_use_single_masking_is_the_same_batch():
    """`last_use=True` skips the unused random-word draw of "single" masking: the same batch, empty rows included,
    for a Generator and for `RowHash`; with the default a shared Generator's next draw is where it always was."""
    from flatlm.data.masking import RowHash

    tokens, lengths = _corpus(n=500, T=9)
    lengths[:7] = 0  # empty rows: nothing selected, position 0
    for make in (lambda: np.random.default_rng(5), lambda: RowHash(5, np.arange(500) * 3)):
        a = mask_batch(tokens, lengths, V, make(), masking="single")
        b = mask_batch(tokens, lengths, V, make(), masking="single", last_use=True)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype, k
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    rng = np.random.default_rng(5)
    mask_batch(tokens, lengths, V, rng, masking="single")
    ref = np.random.default_rng(5)
    ref.random(500), ref.integers(0, V, size=tokens.shape)  # the stream as before: the draw is still made
    assert rng.random() == ref.random()


@pytest.mark.parametrize("masking", ["single", "bert"])
@pytest.mark.parametrize("last_use", [False, True])
def test_block_generators_mask_each_block_as_its_own_call(masking, last_use):
    """One `mask_batch` over blocks of rows with `BlockGenerators` (block b draws from generator b) against the
    reference, one `mask_batch` per block with its generator: the same arrays, blocks of 0 to 7 rows; and each
    generator is left where its own call leaves it."""
    rng = np.random.default_rng(0)
    sizes, T = [3, 0, 1, 7, 2], 9
    tokens = rng.integers(0, 20, (sum(sizes), T))
    lengths = rng.integers(0, T + 1, sum(sizes))
    kw = dict(num_words=20, masking=masking, last_use=last_use)
    got_rngs = [np.random.default_rng(s) for s in range(len(sizes))]
    got = mask_batch(tokens, lengths, rng=BlockGenerators(got_rngs, sizes), **kw)
    want_rngs = [np.random.default_rng(s) for s in range(len(sizes))]
    ends = np.cumsum(sizes)
    want = [mask_batch(tokens[e - n:e], lengths[e - n:e], rng=r, **kw)
            for n, e, r in zip(sizes, ends, want_rngs, strict=True)]
    assert got.keys() == want[0].keys()
    for k in got:
        np.testing.assert_array_equal(got[k], np.concatenate([w[k] for w in want]), err_msg=k)
    assert [r.random() for r in got_rngs] == [r.random() for r in want_rngs]
    with pytest.raises(ValueError, match="BlockGenerators has 13 rows, asked for 4"):
        BlockGenerators(got_rngs, sizes).random((4, T))
