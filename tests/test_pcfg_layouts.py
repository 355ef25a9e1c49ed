"""The PCFG chart's two memory layouts (`flatlm.languages.pcfg.kernels`): each is the other's independent second
implementation (the symbol-minor `Chart` and the batch-minor `SmallBlockChart` share no loop), so every kernel is
checked on both against the other; the plan's per-block parent rows; and a sentence's bits not depending on its
place in a chunk (`Engine.run`). Both layouts are also checked against parse-tree sums in test_pcfg.py (the dense
N=20 grammar takes `Chart`, the others `SmallBlockChart`)."""

import functools

import jax
import numpy as np
import pytest

from flatlm.languages.base import special_ids
from flatlm.languages.pcfg import PCFG, dense_grammar, kernels, random_grammar
from flatlm.languages.pcfg.chart import has_wide_blocks
from flatlm.languages.pcfg.engine import encode_tokens


@pytest.fixture(scope="module")
def layered():
    """Released shape in miniature (blocks of 3 symbols, each feeding one layer of parents), with rare rules."""
    return random_grammar(2, num_roots=2, levels=3, symbols_per_level=4, num_words=10, rules_per_symbol=5,
                          max_length=7, batch_size=8, bucket_lengths=False)


@pytest.fixture(scope="module")
def wide():
    """Dense N=20: one block of 20 x 20 children, the batched-matmul path of `Chart`."""
    return dense_grammar(3, num_nonterminals=20, num_words=3, emit_prob=0.4, max_length=5, batch_size=8,
                         bucket_lengths=False)


def _batch(g: PCFG, seed: int):
    """8 sentences of g's full width: sampled ones of every length and masked words, pad beyond each length."""
    rng = np.random.default_rng(seed)
    T = g.max_length
    corpus = g.sample(8, seed=seed)
    tokens = np.full((8, T), g.vocab_size, np.int64)
    tokens[:, : corpus.tokens.shape[1]] = corpus.tokens[:, :T]
    lengths = np.minimum(corpus.lengths, T)
    tokens[0, 0] = special_ids(g.vocab_size).mask
    tokens[3, lengths[3] - 1] = special_ids(g.vocab_size).mask
    tokens = np.where(np.arange(T) < lengths[:, None], tokens, rng.integers(0, g.vocab_size, tokens.shape))
    return encode_tokens(tokens, lengths, g.vocab_size)


def _run_both(g: PCFG, kind: str, *args):
    plan = g._plan(g.max_length)
    return [jax.jit(functools.partial(kernels.KERNELS[kind], plan, layout=layout))(plan.consts, *args)
            for layout in ("symbol_minor", "batch_minor")]


@pytest.mark.parametrize("name", ["layered", "wide"])
def test_both_layouts_give_every_kernel_the_same_numbers(name, request):
    """Float64: forward, conditionals and span posteriors of 8 sentences with masked words and garbage beyond their
    lengths, and the length kernel, agree between the layouts to 1e-12 relative."""
    g = request.getfixturevalue(name)
    assert has_wide_blocks(g._plan(g.max_length)) == (name == "wide")
    with jax.enable_x64(True):
        tokens, lengths = _batch(g, seed=1)
        outputs = {kind: _run_both(g, kind, tokens, lengths) for kind in ("forward", "conditionals", "posteriors")}
        for kind, (a, b) in outputs.items():
            assert set(a) == set(b)
            for key in a:
                x, y = np.asarray(a[key]), np.asarray(b[key])
                assert x.shape == y.shape, (kind, key)
                np.testing.assert_allclose(y, x, rtol=1e-12, atol=1e-14 * max(np.abs(x).max(), 1e-300),
                                           err_msg=f"{kind}: {key}")
        assert np.asarray(outputs["conditionals"][1]["q"]).sum() > 0
        plan = g._plan(g.max_length)
        leaf_1TN = np.broadcast_to(np.asarray(plan.consts["leaf_total"]), (1, g.max_length, g.num_nonterminals))
        for x, y in zip(*_run_both(g, "lengths", leaf_1TN)):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-12)


def test_each_block_holds_its_rules_in_its_parent_rows(layered):
    """`Block.n0`..`n1` (the rows the batch-minor chart multiplies) are the first and last parents with a rule of
    the block: every row outside is zero in the rule table, and the rows at either end are not."""
    plan = layered._plan(layered.max_length)
    narrower = 0
    for w, spec in plan.widths.items():
        G_PN, p = np.asarray(plan.consts["G"][w]), 0
        for k in spec.blocks:
            rows = np.flatnonzero(np.abs(G_PN[p: p + (k.l1 - k.l0) * (k.r1 - k.r0)]).sum(0) > 0)
            p += (k.l1 - k.l0) * (k.r1 - k.r0)
            assert (k.n0, k.n1) == (rows.min(), rows.max() + 1), (w, k)
            narrower += k.n1 - k.n0 < layered.num_nonterminals
        assert p == G_PN.shape[0]
    assert narrower > 0  # a layered grammar's blocks feed one layer each


@pytest.mark.parametrize("name", ["layered", "wide"])
def test_a_sentences_bits_do_not_depend_on_its_place_in_the_chunk(name, request):
    """Float32, one chart size: the 8 sentences of a chunk in reversed order, or with 5 of them alone in a padded
    chunk, give each sentence bitwise the same conditionals (the matmuls' kernels depend on the operands' sizes,
    which padding to the batch keeps fixed, not on a column's place)."""
    g = request.getfixturevalue(name)
    tokens, lengths = _batch(g, seed=2)
    q = g.conditionals(tokens, lengths)
    np.testing.assert_array_equal(g.conditionals(tokens[::-1], lengths[::-1])[::-1], q)
    np.testing.assert_array_equal(g.conditionals(tokens[3:], lengths[3:]), q[3:])


def test_the_default_layout_and_a_grammar_forced_to_the_other(layered, wide, monkeypatch):
    """On the CPU backend a plan of small blocks gets the batch-minor chart and a plan with wide blocks the
    symbol-minor one; an accelerator keeps symbol minor for both (not yet measured there). `Engine.layout` forces a
    layout on a grammar's kernels: the same conditionals, a kernel of its own."""
    assert kernels.default_layout(layered._plan(7)) == "batch_minor"
    assert kernels.default_layout(wide._plan(5)) == "symbol_minor"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert kernels.default_layout(layered._plan(7)) == "symbol_minor"
    monkeypatch.undo()
    tokens, lengths = _batch(layered, seed=3)
    forced = PCFG(layered.root, layered.binary, layered.emit, batch_size=8, bucket_lengths=False, max_length=7)
    forced._engine.layout = "symbol_minor"
    np.testing.assert_allclose(forced.conditionals(tokens, lengths), layered.conditionals(tokens, lengths),
                               rtol=1e-5, atol=1e-7)
    assert [key[-1] for key in forced._engine._fns] == ["symbol_minor"]
    forced._engine.layout = "rows"
    with pytest.raises(ValueError, match="unknown chart layout 'rows'"):
        forced.conditionals(tokens, lengths)
