"""PCFG grammars without the chart: the sampler's rule draws and parse trees, the rules-file format, construction's
checks, random_grammar's released shape, and float32 on a grammar of rare rules against its closed form."""

import jax
import numpy as np
import pytest
from pcfg_reference import dense_pcfg, layered_pcfg, ref_length_distribution

from flatlm.errors import UserError
from flatlm.languages.base import special_ids
from flatlm.languages.pcfg import PCFG, random_grammar


@pytest.mark.parametrize("name", ["dense", "layered", "released"])
def test_guided_rule_draws_are_the_binary_search_draws(name):
    """The sampler's bucket table (and, in buckets holding an edge, its guide + short scan) picks, for every
    (symbol, u), the rule np.searchsorted(edge, symbol + u, side="right") picks (the inverse CDF it replaced):
    random points, every bucket's first and last float, the float just below each bucket start and just below
    each edge, so a corpus drawn from a seed is the same as before."""
    from flatlm.languages.pcfg.sample import Sampler

    g = {"dense": dense_pcfg, "layered": layered_pcfg, "released": lambda: random_grammar(0)}[name]()
    sp = Sampler(g.root, g.binary, g.emit)
    rng = np.random.default_rng(0)
    N, G = sp.N, sp.G
    assert (sp.table < 0).any() and (sp.table >= 0).any()  # both paths taken
    starts = np.arange(G) / G
    edge_sym = np.ceil(sp.edge).astype(np.int64) - 1  # edges of symbol A lie in (A, A + 1]
    sym = np.concatenate([rng.integers(0, N, 100_000), np.repeat(np.arange(N), G), np.repeat(np.arange(N), G),
                          np.repeat(np.arange(N), G), edge_sym, edge_sym])
    u = np.concatenate([rng.random(100_000), np.tile(starts, N), np.nextafter(np.tile(starts, N), -1).clip(0),
                        np.nextafter(np.tile(starts + 1 / G, N), 0), np.nextafter(sp.edge - edge_sym, 0),
                        (sp.edge - edge_sym) % 1.0])
    want = np.minimum(np.searchsorted(sp.edge, sym + u, side="right"), sp.edge.size - 1)
    np.testing.assert_array_equal(sp._rules(u, sym), want)
    # a table with edges at and just above every bucket start, where a scan that started too far would skip one
    offsets = np.unique(np.concatenate([starts[1:], starts[1:] + 1e-12, [1.0]]))
    sp.edge = (np.arange(N)[:, None] + offsets[None, :]).reshape(-1)
    sp._guide_table(N)
    sym = np.repeat(np.arange(N), 2 * G)
    u = np.tile(np.concatenate([starts, starts + 5e-13]), N)
    want = np.minimum(np.searchsorted(sp.edge, sym + u, side="right"), sp.edge.size - 1)
    np.testing.assert_array_equal(sp._rules(u, sym), want)


def test_sample_returns_parse_trees():
    """The latent tree arrays describe a derivation of each sentence with positive probability."""
    layered = layered_pcfg()
    corpus = layered.sample(200, seed=11)
    lat = corpus.latents
    T = layered.max_length
    for key in ("preterminal", "split_symbol", "split_start", "split_end"):
        assert lat[key].shape == (200, T) and lat[key].dtype == np.int32
    assert np.all(corpus.tokens[np.arange(T)[None] >= corpus.lengths[:, None]] == special_ids(8).pad)
    for b in range(200):
        n = int(corpus.lengths[b])
        x, pre = corpus.tokens[b, :n], lat["preterminal"][b, :n]
        assert np.all(layered.emit[pre, x] > 0) and np.all(lat["preterminal"][b, n:] == -1)
        spans = {(t, t + 1): int(pre[t]) for t in range(n)}
        for k in range(1, n):
            i, j = int(lat["split_start"][b, k]), int(lat["split_end"][b, k])
            assert i < k < j <= n
            spans[(i, j)] = int(lat["split_symbol"][b, k])
        assert lat["split_symbol"][b, 0] == -1 and np.all(lat["split_symbol"][b, n:] == -1)
        assert layered.root[spans[(0, n)]] > 0
        for k in range(1, n):
            i, j = int(lat["split_start"][b, k]), int(lat["split_end"][b, k])
            assert layered.binary[spans[(i, j)], spans[(i, k)], spans[(k, j)]] > 0


# ---- rules files, construction, random grammars -----------------------------------------------------------


def test_rules_file_round_trip(tmp_path):
    layered = layered_pcfg()
    path = tmp_path / "rules.txt"
    layered.to_rules_file(path)
    back = PCFG.from_rules_file(path)
    assert back.nonterminals == layered.nonterminals and back.words == layered.words
    for name in ("root", "binary", "emit"):
        np.testing.assert_allclose(getattr(back, name), getattr(layered, name), rtol=1e-12, atol=0)
    assert back.max_length == layered.max_length


def test_rules_file_sums_duplicates_renormalises_and_folds_root(tmp_path):
    path = tmp_path / "rules.txt"
    path.write_text("S S1 0.25\nS S2 0.75\nS1 A B 1.0\nS2 B A 0.5\nS2 B A 0.5\n"
                    "A x 0.3\nA y 0.3\nA x 0.3\nB y 0.4\nB A B 0.5\n")
    g = PCFG.from_rules_file(path, max_length=6)
    assert g.nonterminals == ["S1", "S2", "A", "B"] and g.words == ["x", "y"]
    np.testing.assert_allclose(g.root, [0.25, 0.75, 0, 0])
    np.testing.assert_allclose(g.emit[2], [0.6 / 0.9, 0.3 / 0.9])  # duplicates summed, then renormalised
    assert g.binary[1, 3, 2] == pytest.approx(1.0)
    np.testing.assert_allclose(g.emit[3, 1] + g.binary[3, 2, 3], 1.0)
    assert g.binary[3, 2, 3] == pytest.approx(0.5 / 0.9)
    with pytest.raises(UserError, match="unbounded length; pass max_length"):
        PCFG.from_rules_file(path)  # B -> A B is recursive


@pytest.mark.parametrize("line, message", [
    ("A1 w", "expected 'LHS RHS1 \\[RHS2\\] PROB'"),
    ("A1 w 0.x", "probability '0.x' is not a number"),
    ("A1 w -0.5", "must be finite and >= 0"),
    ("A1 A1 Z 0.5", "'Z' has no rules of its own"),
    ("A1 A1 0.5", "unary rule A1 -> A1"),
])
def test_rules_file_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.txt"
    path.write_text(f"S A1 1.0\nA1 A1 A1 0.5\n\n{line}\nA1 w 0.5\n")
    with pytest.raises(UserError, match=message) as err:
        PCFG.from_rules_file(path)
    assert f"{path}:4:" in str(err.value) and "\n" not in str(err.value)


def test_constructor_validates():
    root, binary, emit = np.array([1.0, 0.0]), np.zeros((2, 2, 2)), np.array([[1.0, 0.0], [0.5, 0.4]])
    with pytest.raises(ValueError, match="'N1' sum to 0.9"):
        PCFG(root, binary, emit)
    with pytest.raises(ValueError, match="binary must have shape"):
        PCFG(root, binary[:1], emit)
    with pytest.raises(ValueError, match="root must sum to 1"):
        PCFG(root * 0.5, binary, np.array([[1.0, 0.0], [0.5, 0.5]]))
    g = PCFG(root, binary, np.array([[1.0, 0.0], [0.5, 0.5]]))
    assert (g.num_nonterminals, g.vocab_size, g.max_length) == (2, 2, 1)
    with pytest.raises(ValueError, match="word ids"):
        g.log_prob(np.array([[2]]), np.array([1]))


def test_random_grammar_defaults_have_the_released_shape():
    g = random_grammar(0)
    assert (g.num_nonterminals, g.vocab_size, g.max_length) == (49, 200, 16)
    assert g.nonterminals[:9] == [f"S{k}" for k in range(1, 10)] and g.nonterminals[-1] == "A4_9"
    np.testing.assert_allclose(g.binary.reshape(49, -1).max(1)[:9], 1.0)  # Sk -> A1_i A1_j with prob 1
    assert np.all((g.emit[9:39] > 0).sum(1) == 1) and np.all(g.emit[39:].sum(1) == pytest.approx(1.0))
    assert np.all(g.binary[39:] == 0) and np.all(g.emit.sum(0) > 0)  # A4 only emits; every word is used
    lengths = ref_length_distribution(g, 16)
    assert lengths[:2].sum() == 0 and lengths.sum() == pytest.approx(1.0)
    assert 9.7 < (np.arange(17) * lengths).sum() < 11.7  # released grammar: 10.66


def test_float32_keeps_long_sentences_of_a_grammar_with_rare_rules():
    """Audit regression: a span of zero mass (normaliser 1) used to set its parent's reference scale, above every
    real span's (which shrink by log s at each width), so in float32 the real splits' weights underflowed and a
    derivable 16-word sentence got P(x) = 0 and rows of zeros. S -> S S | X Y (1e-3 each) | Z S; X -> x .7 | u .3;
    Y -> y; Z -> z: every x/u can be the other (q_t = [.7, 0, 0, .3] in closed form at x/u positions, one-hot at
    y and z), and the float64 chart (exact against parse-tree sums above) gives log P."""
    N, V, p = 4, 4, 1e-3
    binary, emit = np.zeros((N, N, N)), np.zeros((N, V))
    binary[0, 0, 0] = binary[0, 1, 2] = p
    binary[0, 3, 0] = 1 - 2 * p
    emit[1, 0], emit[1, 3], emit[2, 1], emit[3, 2] = 0.7, 0.3, 1.0, 1.0
    g = PCFG(np.eye(N)[0], binary, emit, max_length=24)
    lengths = np.array([14, 16, 23, 24], np.int32)
    rng = np.random.default_rng(0)
    tokens = np.full((len(lengths), 24), V, np.int32)
    for b, n in enumerate(lengths):  # z^(n mod 2) then (x|u) y pairs
        pairs = np.stack([rng.choice([0, 3], n // 2), np.ones(n // 2, int)], 1).ravel()
        tokens[b, :n] = np.concatenate([np.full(n % 2, 2), pairs])
    q = g.conditionals(tokens, lengths)
    with jax.enable_x64(True):
        want_logp = g.log_prob(tokens, lengths)
    np.testing.assert_allclose(g.log_prob(tokens, lengths), want_logp, rtol=1e-5)
    assert want_logp.min() < -150  # far below float32's e^-87: the chart's scales carry it
    closed = {0: [0.7, 0, 0, 0.3], 3: [0.7, 0, 0, 0.3], 1: [0, 1, 0, 0], 2: [0, 0, 1, 0]}
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(q[b, :n], [closed[w] for w in tokens[b, :n]], atol=1e-6)
        assert not q[b, n:].any()


def test_sampler_without_the_reject_bookkeeping_draws_the_same_trees():
    """`Sampler.draw(rejects=False)`, for grammars that derive nothing longer than the cap, skips the early
    rejection of long sentences: the same trees as with it (which never rejects there), tokens-only and with trees."""
    from flatlm.languages.pcfg.sample import Sampler

    g = layered_pcfg()
    assert not g._rejects
    s = Sampler(g.root, g.binary, g.emit)
    for seed in range(3):
        for latents in (False, True):
            a = s.draw(np.random.default_rng(seed), 257, g.max_length, latents, rejects=True)
            b = s.draw(np.random.default_rng(seed), 257, g.max_length, latents, rejects=False)
            assert a.keys() == b.keys() and len(a["lengths"]) == 257
            for k in a:
                np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("name", ["dense", "layered"])
def test_zero_sentences_are_empty_arrays_and_a_negative_count_is_refused(name):
    """sample(0) returns empty arrays of the usual shapes (it raised IndexError before), for grammars with and
    without rejection; sample(-1) is a ValueError, as for the HMM."""
    from flatlm.languages.pcfg.sample import TREE

    g = {"dense": dense_pcfg, "layered": layered_pcfg}[name]()
    for latents in (True, False):
        c = g.sample(0, seed=3, latents=latents)
        assert c.tokens.shape == (0, g.max_length) and c.tokens.dtype == np.int32
        assert c.lengths.shape == (0,) and c.lengths.dtype == np.int32
        assert sorted(c.latents) == (sorted(TREE) if latents else [])
        assert all(v.shape == (0, g.max_length) for v in c.latents.values())
    with pytest.raises(ValueError, match="must be >= 0"):
        g.sample(-1, seed=3)
