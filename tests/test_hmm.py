"""HMM language: exact inference against brute-force enumeration of all hidden paths, sampling against exact
probabilities, random_hmm structure, input validation."""

import itertools

import jax
import numpy as np
import pytest
import scipy.stats

from flatlm.languages.base import special_ids
from flatlm.languages.hmm import HMM, _conditionals_fn, random_hmm

K, V, T = 3, 4, 4
PAD, MASK = special_ids(V).pad, special_ids(V).mask


def tiny_hmm(seed: int, zeros: bool = False) -> HMM:
    """A random K=3, V=4, T=4 HMM. With zeros, only state 1 emits word 2, only state 2 emits word 3, and
    state 1 never moves to state 2, so the bigram "2 3" is impossible."""
    rng = np.random.default_rng(seed)
    initial, transition = rng.dirichlet(np.ones(K)), rng.dirichlet(np.ones(K), K)
    emission = rng.dirichlet(np.ones(V), K)
    if zeros:
        emission[[0, 2], 2] = emission[[0, 1], 3] = transition[1, 2] = 0.0
        transition /= transition.sum(1, keepdims=True)
        emission /= emission.sum(1, keepdims=True)
    return HMM(initial, transition, emission, T)


def brute_joint(hmm: HMM, words) -> np.ndarray:
    """P(x = words, z = path) for every path: [K] * L. A word None is unobserved (summed over)."""
    L = len(words)
    joint = np.zeros((hmm.num_states,) * L)
    for path in itertools.product(range(hmm.num_states), repeat=L):
        p = hmm.initial[path[0]]
        for t, (z, w) in enumerate(zip(path, words)):
            if t > 0:
                p *= hmm.transition[path[t - 1], z]
            p *= 1.0 if w is None else hmm.emission[z, w]
        joint[path] = p
    return joint


def brute_force(hmm: HMM, words) -> tuple[float, np.ndarray, np.ndarray]:
    """log P(x), conditionals [L, V] and state posteriors [L, K], enumerating all paths and all words at t."""
    L = len(words)
    joint = brute_joint(hmm, words)
    total = joint.sum()
    marginals = np.stack([joint.sum(axis=tuple(s for s in range(L) if s != t)) for t in range(L)])
    posteriors = marginals / total if total > 0 else 0.0 * marginals
    conditionals = np.zeros((L, hmm.vocab_size))
    for t in range(L):
        p_w = np.array([brute_joint(hmm, [*words[:t], w, *words[t + 1 :]]).sum() for w in range(V)])
        conditionals[t] = p_w / p_w.sum() if p_w.sum() > 0 else 0.0
    return (np.log(total) if total > 0 else -np.inf), conditionals, posteriors


def padded_batch(rng: np.random.Generator, lengths) -> np.ndarray:
    """Random words below each length; random garbage (words or pad) beyond it, which must be ignored."""
    tokens = rng.integers(0, V, size=(len(lengths), T))
    garbage = rng.integers(0, V + 1, size=tokens.shape)
    return np.where(np.arange(T) < np.asarray(lengths)[:, None], tokens, garbage).astype(np.int32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_inference_matches_brute_force_with_padding(seed):
    hmm = tiny_hmm(seed)
    rng = np.random.default_rng(100 + seed)
    lengths = np.array([4, 4, 3, 2, 1, 0, 4], dtype=np.int32)
    tokens = padded_batch(rng, lengths)
    tokens[6, 1] = MASK  # an unobserved word inside a sentence is marginalised out
    with jax.enable_x64(True):
        log_prob = hmm.log_prob(tokens, lengths)
        cond = hmm.conditionals(tokens, lengths)
        post = hmm.state_posteriors(tokens, lengths)
    assert cond.dtype == post.dtype == log_prob.dtype == np.float64
    assert cond.shape == (7, T, V) and post.shape == (7, T, K) and log_prob.shape == (7,)
    for b, L in enumerate(lengths):
        words = [None if w >= V else int(w) for w in tokens[b, :L]]
        ref_lp, ref_cond, ref_post = brute_force(hmm, words) if L else (0.0, 0.0, 0.0)
        np.testing.assert_allclose(log_prob[b], ref_lp, rtol=0, atol=1e-10)
        np.testing.assert_allclose(cond[b, :L], ref_cond, rtol=0, atol=1e-10)
        np.testing.assert_allclose(post[b, :L], ref_post, rtol=0, atol=1e-10)
        np.testing.assert_array_equal(cond[b, L:], 0.0)
        np.testing.assert_array_equal(post[b, L:], 0.0)
    np.testing.assert_allclose(cond.sum(-1), np.arange(T) < lengths[:, None], atol=1e-12)
    np.testing.assert_allclose(post.sum(-1), np.arange(T) < lengths[:, None], atol=1e-12)


def test_impossible_contexts_give_minus_inf_and_zero_rows():
    hmm = tiny_hmm(3, zeros=True)
    tokens = np.array(list(itertools.product(range(V), repeat=T)), dtype=np.int32)[::3]
    lengths = np.full(len(tokens), T, dtype=np.int32)
    with jax.enable_x64(True):  # chunk_size=8: the shape compiled for the test above, so no recompilation
        log_prob = hmm.log_prob(tokens, lengths, chunk_size=8)
        cond = hmm.conditionals(tokens, lengths, chunk_size=8)
        post = hmm.state_posteriors(tokens, lengths, chunk_size=8)
    assert np.isneginf(log_prob).any() and np.isfinite(log_prob).any()
    assert np.isfinite(cond).all() and np.isfinite(post).all()
    zero_rows = 0
    for b in range(0, len(tokens), 2):
        ref_lp, ref_cond, ref_post = brute_force(hmm, list(tokens[b]))
        zero_rows += (ref_cond.sum(-1) == 0).sum()
        np.testing.assert_allclose(log_prob[b], ref_lp, atol=1e-10)  # -inf == -inf passes
        np.testing.assert_allclose(cond[b], ref_cond, atol=1e-10)
        np.testing.assert_allclose(post[b], ref_post, atol=1e-10)  # all 0 for impossible sentences
    assert zero_rows > 0


def test_float32_default_agrees_with_float64_and_chunking():
    hmm = random_hmm(0, length=6)  # paper-sized K, V; short sentences compile faster
    corpus = hmm.sample(100, seed=1)
    cond32 = hmm.conditionals(corpus.tokens, corpus.lengths)
    lp32 = hmm.log_prob(corpus.tokens, corpus.lengths)
    with jax.enable_x64(True):
        cond64 = hmm.conditionals(corpus.tokens, corpus.lengths, chunk_size=32)  # 4 chunks, the last padded
        lp64 = hmm.log_prob(corpus.tokens, corpus.lengths)
    assert cond32.dtype == lp32.dtype == np.float32 and cond64.dtype == np.float64
    np.testing.assert_allclose(cond32, cond64, atol=1e-5)
    np.testing.assert_allclose(lp32, lp64, rtol=1e-5)
    np.testing.assert_allclose(cond64.sum(-1), 1.0, atol=1e-12)


def test_default_chunk_is_the_cpus_or_the_largest_power_of_two_in_the_accelerator_budget(monkeypatch):
    import flatlm.languages.hmm as hmm_lib

    hmm = random_hmm(0, length=6)
    corpus = hmm.sample(100, seed=1)
    expected = hmm.conditionals(corpus.tokens, corpus.lengths, chunk_size=1024)
    batches = []
    counting = lambda *args: batches.append(args[3].shape[0]) or _conditionals_fn(*args)  # noqa: E731
    monkeypatch.setattr(hmm_lib, "_conditionals_fn", counting)
    np.testing.assert_array_equal(hmm.conditionals(corpus.tokens, corpus.lengths), expected)
    assert batches == [128]  # the CPU: one chunk of 1024, bucketed
    per_sentence = 4 * 6 * (2 * hmm.num_states + hmm.vocab_size)
    monkeypatch.setattr(hmm_lib.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(hmm_lib, "_ACCEL_BYTES", 40 * per_sentence)  # room for 40 sentences: chunks of 32
    batches.clear()  # another batch size rounds the dots differently on XLA:CPU: equal to float32 rounding
    np.testing.assert_allclose(hmm.conditionals(corpus.tokens, corpus.lengths), expected, rtol=1e-5, atol=1e-8)
    assert batches == [32, 32, 32, 4]  # the last 4 sentences in a bucket of their own
    monkeypatch.setattr(hmm_lib, "_ACCEL_BYTES", 1)  # smaller than one sentence: one at a time
    batches.clear()
    hmm.conditionals(corpus.tokens[:3], corpus.lengths[:3])
    assert batches == [1, 1, 1]


def test_repeated_calls_do_not_recompile():
    hmm, other = random_hmm(0, length=6), random_hmm(1, length=6)
    corpus = hmm.sample(100, seed=0)
    hmm.conditionals(corpus.tokens, corpus.lengths)
    before = _conditionals_fn._cache_size()
    hmm.conditionals(corpus.tokens[:65], corpus.lengths[:65])  # same bucket (128)
    other.conditionals(corpus.tokens, corpus.lengths)  # another HMM of the same shape
    assert _conditionals_fn._cache_size() == before


def test_sample_matches_exact_joint_distribution():
    """Chi-square goodness of fit of the sampled (states, words) against the exact joint on all K^3 V^3 cells,
    and total variation of the sentences alone against exp(log_prob). The seed is fixed, so the test is
    deterministic; both thresholds would fail for a correct sampler with probability below 1e-3."""
    hmm = tiny_hmm(5, zeros=True)
    hmm = HMM(hmm.initial, hmm.transition, hmm.emission, length=3)
    n = 100_000
    corpus = hmm.sample(n, seed=7)
    assert corpus.tokens.dtype == corpus.lengths.dtype == corpus.latents["states"].dtype == np.int32
    np.testing.assert_array_equal(corpus.lengths, 3)
    z, x = corpus.latents["states"], corpus.tokens
    observed = np.zeros((K,) * 3 + (V,) * 3)
    np.add.at(observed, (z[:, 0], z[:, 1], z[:, 2], x[:, 0], x[:, 1], x[:, 2]), 1)
    expected = np.einsum(
        "a,ab,bc,ad,be,cf->abcdef", hmm.initial, hmm.transition, hmm.transition, *[hmm.emission] * 3
    ) * n
    assert observed[expected == 0].sum() == 0  # zero-probability events never drawn
    possible = expected > 0
    chi2 = ((observed - expected)[possible] ** 2 / expected[possible]).sum()
    assert scipy.stats.chi2.sf(chi2, possible.sum() - 1) > 1e-3

    sentences = np.array(list(itertools.product(range(V), repeat=3)), dtype=np.int32)
    sentences = np.pad(sentences, ((0, 0), (0, T - 3)), constant_values=PAD)  # the compiled [8, T] shape
    with jax.enable_x64(True):
        p = np.exp(hmm.log_prob(sentences, np.full(len(sentences), 3), chunk_size=8))
    np.testing.assert_allclose(p.sum(), 1.0, atol=1e-12)
    counts = observed.sum(axis=(0, 1, 2)).ravel()  # same order as itertools.product
    tv = 0.5 * np.abs(counts / n - p).sum()
    # E[TV] <= 0.5 * sum sqrt(p (1 - p) / n) <= 0.5 * sqrt(64 / n) = 0.0126 (Cauchy-Schwarz, 64 sentences),
    # and by McDiarmid P(TV > E[TV] + 0.0074) <= exp(-2 n 0.0074^2) < 2e-5.
    assert tv < 0.02


def test_sample_is_deterministic_and_prefix_consistent():
    hmm = random_hmm(0)
    a, b, c = hmm.sample(1000, seed=3), hmm.sample(1000, seed=3), hmm.sample(10, seed=3)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.tokens[:10], c.tokens)
    np.testing.assert_array_equal(a.latents["states"][:10], c.latents["states"])
    assert not np.array_equal(a.tokens, hmm.sample(1000, seed=4).tokens)
    assert a.tokens.shape == (1000, 16) and a.tokens.max() < 200 and a.tokens.min() >= 0
    assert len(hmm.sample(0, seed=0)) == 0


def test_task_labels():
    hmm = tiny_hmm(0)
    corpus = hmm.sample(8, seed=1)
    with jax.enable_x64(True):
        for k in (0, 2, 3):
            labels = hmm.task_labels(corpus.tokens, corpus.lengths, k)
            ref = [brute_force(hmm, list(x))[2][k].argmax() for x in corpus.tokens]
            np.testing.assert_array_equal(labels, ref)
    sampled = hmm.task_labels(corpus.tokens, corpus.lengths, 2, "sampled", states=corpus.latents["states"])
    np.testing.assert_array_equal(sampled, corpus.latents["states"][:, 2])
    assert sampled.dtype == np.int32
    with pytest.raises(ValueError, match="needs states"):
        hmm.task_labels(corpus.tokens, corpus.lengths, 2, "sampled")
    with pytest.raises(ValueError, match="task position"):
        hmm.task_labels(corpus.tokens, corpus.lengths, T)
    with pytest.raises(ValueError, match="unknown task definition"):
        hmm.task_labels(corpus.tokens, corpus.lengths, 1, "released")


def test_random_hmm_structure():
    hmm = random_hmm(0, leakage=0.05, emission_leakage=0.02)
    assert (hmm.num_states, hmm.vocab_size, hmm.max_length) == (100, 200, 16)
    for p in (hmm.initial, hmm.transition, hmm.emission):
        assert (p > 0).all()
        np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-12)
    state_block, word_block = np.arange(100) // 10, np.arange(200) // 20
    in_block_trans = (hmm.transition * (state_block[:, None] == state_block)).sum(1)
    in_block_emit = (hmm.emission * (state_block[:, None] == word_block)).sum(1)
    # in-block mass = (1 - leakage) + leakage * (block size / total)
    np.testing.assert_allclose(in_block_trans, 0.95 + 0.05 * 0.1)
    np.testing.assert_allclose(in_block_emit, 0.98 + 0.02 * 0.1)
    same, other = random_hmm(0, leakage=0.05, emission_leakage=0.02), random_hmm(1)
    np.testing.assert_array_equal(hmm.transition, same.transition)
    np.testing.assert_array_equal(hmm.emission, same.emission)
    assert not np.allclose(hmm.transition, other.transition)
    strict = random_hmm(0, num_states=6, vocab_size=9, num_blocks=3, leakage=0.0, emission_leakage=0.0)
    assert strict.transition[0, 2:].sum() == 0 and strict.emission[0, 3:].sum() == 0


def test_validation():
    good = tiny_hmm(0)
    bad_rows = good.transition.copy()
    bad_rows[1] *= 1.1
    with pytest.raises(ValueError, match="transition rows must sum to 1"):
        HMM(good.initial, bad_rows, good.emission, T)
    negative = good.emission.copy()
    negative[0, :2] += [0.5, -0.5]
    with pytest.raises(ValueError, match="negative"):
        HMM(good.initial, good.transition, negative, T)
    with pytest.raises(ValueError, match="initial rows must sum to 1"):
        HMM(good.initial * 2, good.transition, good.emission, T)
    with pytest.raises(ValueError, match="emission must have shape"):
        HMM(good.initial, good.transition, good.emission[:2], T)
    with pytest.raises(ValueError, match="transition must have shape"):
        HMM(good.initial, good.transition[:, :2], good.emission, T)
    with pytest.raises(ValueError, match="length"):
        HMM(good.initial, good.transition, good.emission, 0)
    with pytest.raises(ValueError, match="lengths must lie"):
        good.conditionals(np.zeros((2, T), np.int32), np.array([T + 1, 1]))
    with pytest.raises(ValueError, match=">= 0"):
        good.log_prob(-np.ones((2, T), np.int32), np.array([T, 1]))
    with pytest.raises(ValueError, match="integers"):
        good.log_prob(np.zeros((2, T)), np.array([T, 1]))
    assert good.transition.flags.writeable is False
    nearly = HMM(good.initial, good.transition * (1 + 1e-8), good.emission, T)  # within tolerance
    np.testing.assert_allclose(nearly.transition.sum(-1), 1.0, rtol=0, atol=1e-15)


def test_row_sampler_table_matches_counting_thresholds():
    """`RowSampler`'s column for (row r, draw u) is #{thresholds[r] <= u} (its definition, counted here by brute
    force), whether its table answers or the binary search does: rows with zeros, with many near-zero entries
    crowded into one bucket, and draws exactly at, just below and just above thresholds."""
    from flatlm.languages.row_sampler import RowSampler

    rng = np.random.default_rng(0)
    p = rng.random((6, 40))
    p[rng.random(p.shape) < 0.3] = 0.0
    p[0, :30], p[0, 30:] = 1e-15, 1.0  # 30 columns within one bucket of row 0
    p[1] = 0.0
    p[1, 17] = 1.0  # a single possible column
    p /= p.sum(1, keepdims=True)
    s = RowSampler(p)
    cdf = np.cumsum(p, axis=1)
    thresholds = np.rint((cdf / cdf[:, -1:])[:, :-1] * 2.0**52).astype(np.int64)
    rows = rng.integers(0, 6, 20000)
    u = rng.integers(0, 1 << 52, 20000)
    at = thresholds[rows[:3000], rng.integers(0, 39, 3000)]  # at a threshold, one below, one above
    u[:3000] = np.clip(at + rng.integers(-1, 2, 3000), 0, (1 << 52) - 1)
    u[3000:4000] = rng.integers(0, 1 << 20, 1000)  # row 0's crowded first bucket for its rows
    expect = (thresholds[rows] <= u[:, None]).sum(1)
    got = s(rows, u)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expect)
    assert (s.table < 0).any() and (s.table >= 0).mean() > 0.9  # both paths exercised
    assert set(np.unique(got[rows == 1])) == {17} and not (p[rows, got] == 0).any()  # never a zero entry
