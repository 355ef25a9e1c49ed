"""PCFG language: exact inference against independent float64 recursions over parse trees, brute force over
candidate words and whole sentence sets, sampling against exact probabilities, task labels against a
per-sentence CKY (the references: tests/pcfg_reference.py; sampling's draws, parse trees, rules files, construction and
random grammars: tests/test_pcfg_grammar.py)."""

import itertools
import os

import jax
import numpy as np
import pytest
from pcfg_reference import (
    dense_pcfg,
    garbage_padded,
    layered_pcfg,
    ref_conditionals,
    ref_inside,
    ref_length_distribution,
    ref_prob,
    ref_span_joint,
    sentences_of,
)

from flatlm.errors import UserError
from flatlm.languages.base import special_ids
from flatlm.languages.pcfg import PCFG, dense_grammar, random_grammar


@pytest.fixture(scope="module")
def dense():
    return dense_pcfg()


@pytest.fixture(scope="module")
def layered():
    return layered_pcfg()


def test_reference_probabilities_sum_to_length_distribution(dense):
    """Sanity of the references: summing P(x) over all 4^l strings gives P(length = l)."""
    ref = ref_length_distribution(dense, 3)
    for L in (1, 2, 3):
        total = sum(ref_prob(dense, list(x)) for x in itertools.product(range(4), repeat=L))
        assert total == pytest.approx(ref[L], rel=1e-12)


# ---- exact inference --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dense", "layered"])
def test_log_prob_and_conditionals_float64_match_parse_tree_sums(name, request):
    g = request.getfixturevalue(name)
    rng = np.random.default_rng(3)
    corpus = g.sample(12, seed=1)
    tokens, lengths = corpus.tokens.copy(), corpus.lengths.copy()
    # Add an impossible sentence for the layered grammar (its middle symbols each emit one word), a one-word
    # sentence, an empty one, and a masked (unobserved) word.
    tokens[0, :3], lengths[0] = rng.integers(0, g.vocab_size, 3), 3
    lengths[1] = 1
    lengths[2] = 0
    tokens[3, 1] = special_ids(g.vocab_size).mask
    lengths[3] = max(lengths[3], 2)
    tokens = garbage_padded(rng, tokens, lengths, g.vocab_size)
    tokens[3, 1] = special_ids(g.vocab_size).mask
    with jax.enable_x64(True):
        log_prob = g.log_prob(tokens, lengths)
        q = g.conditionals(tokens, lengths)
    assert log_prob.dtype == q.dtype == np.float64
    assert q.shape == (12, g.max_length, g.vocab_size)
    for b, words in enumerate(sentences_of(tokens, lengths, g.vocab_size)):
        p = ref_prob(g, words)
        assert log_prob[b] == (pytest.approx(np.log(p), rel=1e-10) if p > 0 else -np.inf)
        np.testing.assert_allclose(q[b, : len(words)], ref_conditionals(g, words), rtol=1e-10, atol=1e-13)
        assert np.all(q[b, len(words):] == 0)


@pytest.mark.parametrize("name", ["dense", "layered"])
def test_conditionals_float32_relative_1e5(name, request):
    g = request.getfixturevalue(name)
    corpus = g.sample(16, seed=2)
    q = g.conditionals(corpus.tokens, corpus.lengths)
    assert q.dtype == np.float32
    for b, words in enumerate(sentences_of(corpus.tokens, corpus.lengths, g.vocab_size)):
        ref = ref_conditionals(g, words)
        np.testing.assert_allclose(q[b, : len(words)], ref, rtol=1e-5, atol=1e-5 * ref.max())


def test_wide_blocks_contracted_by_dot_general_match_parse_tree_sums():
    """Blocks whose children both have more than chart._DENSE_BLOCK symbols sum their outer products over splits
    by one batched dot (and the outside pass contracts them by einsum): float64 against the parse-tree sums,
    float32 to 1e-5, for a dense N=20 grammar with masked words and sentences of every length."""
    from flatlm.languages.pcfg import chart

    g = dense_grammar(1, num_nonterminals=chart._DENSE_BLOCK + 4, num_words=3, emit_prob=0.4, max_length=5,
                      batch_size=8, bucket_lengths=False)
    assert chart.has_wide_blocks(g._plan(5)), "the grammar must exercise the dot_general path"
    rng = np.random.default_rng(4)
    lengths = np.array([5, 5, 4, 3, 2, 1, 5, 3], np.int32)
    tokens = garbage_padded(rng, rng.integers(0, g.vocab_size, (8, 5)), lengths, g.vocab_size)
    tokens[1, 2] = tokens[6, 0] = special_ids(g.vocab_size).mask  # masked words inside the sentences
    q32 = g.conditionals(tokens, lengths)
    with jax.enable_x64(True):
        log_prob, q = g.log_prob(tokens, lengths), g.conditionals(tokens, lengths)
    for b, words in enumerate(sentences_of(tokens, lengths, g.vocab_size)):
        ref = ref_conditionals(g, words)
        assert log_prob[b] == pytest.approx(np.log(ref_prob(g, words)), rel=1e-10)
        np.testing.assert_allclose(q[b, : len(words)], ref, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(q32[b, : len(words)], ref, rtol=1e-5, atol=1e-5 * ref.max())


def test_widths_with_equal_rule_tables_share_one_array():
    """A dense grammar's widths 2..T all use the whole rule table: the plan holds it once (not T - 1 copies), and
    that one array is the grammar's binary rules as [B * C, A], padded by zero columns for the inside pass."""
    g = dense_grammar(0, max_length=12)
    plan = g._plan(12)
    N = g.num_nonterminals
    for name in ("G", "G_in"):
        assert len({id(a) for a in plan.consts[name].values()}) == 1
        assert sorted(plan.consts[name]) == list(range(2, 13))
    G_PN = np.asarray(plan.consts["G"][2])
    np.testing.assert_array_equal(G_PN, g.binary.reshape(N, N * N).T.astype(np.float32))
    G_in = np.asarray(plan.consts["G_in"][7])
    np.testing.assert_array_equal(G_in[:, :N], G_PN)
    assert G_in.shape[1] % 16 == 0 and np.all(G_in[:, N:] == 0)


def test_gemm_autotuning_kept_for_charts_with_wide_blocks_only():
    """XLA:GPU's dot autotuning tripled the released-shape chart's compile time for nothing and sped the dense one's
    batched matmuls up 2.7x (H100): each chart compiles with the options of its kind, chosen from its plan."""
    from flatlm import compile_options
    from flatlm.languages.pcfg import chart

    released, dense = random_grammar(0), dense_grammar(0, max_length=6)
    assert not chart.has_wide_blocks(released._plan(32))  # blocks of at most 10 symbols
    assert all(chart.has_wide_blocks(dense._plan(T)) for T in range(2, 7))
    assert released._engine.fn("conditionals", 32).options == compile_options.CHART_SMALL_DOTS
    assert dense._engine.fn("conditionals", 6).options == compile_options.CHART
    assert compile_options.CHART_SMALL_DOTS["xla_gpu_autotune_level"] == 0


def test_chart_level_comes_from_the_environment_and_reaches_the_compiler(monkeypatch):
    """$FLATLM_CHART_XLA_LEVEL (make test's 0) replaces the charts' LLVM level, and only that option; unset, the
    charts keep `CHART`'s; a bad value is a UserError naming it (one line from the CLI). The engine passes the
    result to XLA."""
    from flatlm import compile_options
    from flatlm.languages.pcfg import engine

    monkeypatch.delenv(compile_options.CHART_LEVEL_ENV, raising=False)
    assert compile_options.chart_options(compile_options.CHART) == compile_options.CHART
    assert compile_options.CHART["xla_backend_optimization_level"] == 2
    monkeypatch.setenv(compile_options.CHART_LEVEL_ENV, "0")
    assert compile_options.chart_options(compile_options.CHART_SMALL_DOTS) == {
        **compile_options.CHART_SMALL_DOTS, "xla_backend_optimization_level": 0}
    seen = []
    real = engine.compile_lowered
    monkeypatch.setattr(engine, "compile_lowered", lambda lowered, options: seen.append(options) or real(lowered,
                                                                                                        options))
    g = dense_grammar(1, num_nonterminals=2, num_words=3, max_length=2, batch_size=4, bucket_lengths=False)
    assert np.isfinite(g.log_prob(np.array([[0, 1]], np.int32), np.array([2]))).all()
    assert seen and all(o["xla_backend_optimization_level"] == 0 for o in seen)
    monkeypatch.setenv(compile_options.CHART_LEVEL_ENV, "fast")
    with pytest.raises(UserError, match="FLATLM_CHART_XLA_LEVEL='fast': use an LLVM level 0-3"):
        compile_options.chart_options(compile_options.CHART)


def test_log_prob_of_every_string_sums_to_length_distribution(dense, layered):
    """Enumerate every string of each length: sum_x P(x) = P(length), for the JAX inside pass (log_prob),
    the all-ones-leaf pass (length_distribution) and the numpy recursion."""
    for g, L in ((dense, 4), (layered, 2)):
        exact = g.length_distribution()
        np.testing.assert_allclose(exact, ref_length_distribution(g, g.max_length), rtol=1e-5, atol=1e-9)
        for n in range(1, L + 1):
            strings = np.array(list(itertools.product(range(g.vocab_size), repeat=n)), np.int32)
            tokens = np.full((len(strings), g.max_length), g.vocab_size, np.int32)
            tokens[:, :n] = strings
            total = np.exp(g.log_prob(tokens, np.full(len(strings), n, np.int32)).astype(np.float64)).sum()
            assert total == pytest.approx(exact[n], rel=1e-5)


def test_sampled_conditionals_are_consistent(layered):
    """q[x_t] > 0 for sampled sentences, rows sum to 1, padding rows are 0, and the expected surprisal
    E[-log q_t(x_t)] equals the expected entropy of q_t (x_t is a draw from q_t given x_-t)."""
    g = layered
    corpus = g.sample(2000, seed=5)
    q = g.conditionals(corpus.tokens, corpus.lengths)
    inside = np.arange(g.max_length)[None, :] < corpus.lengths[:, None]
    qx = np.take_along_axis(q, np.minimum(corpus.tokens, g.vocab_size - 1)[..., None], -1)[..., 0]
    assert np.all(qx[inside] > 0)
    np.testing.assert_allclose(q.sum(-1)[inside], 1.0, atol=1e-5)
    assert np.all(q[~inside] == 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(q > 0, q * np.log(q), 0.0).sum(-1)
        surprisal = np.where(inside, -np.log(np.where(inside, qx, 1.0)), 0.0)
    diff = (surprisal - np.where(inside, entropy, 0.0)).sum(1)  # per sentence: independent draws
    assert abs(diff.mean()) < 3 * diff.std() / np.sqrt(len(diff))


def test_sample_length_histogram_matches_exact_distribution(layered):
    exact = layered.length_distribution()
    corpus = layered.sample(40000, seed=7)
    counts = np.bincount(corpus.lengths, minlength=len(exact))
    n = len(corpus)
    assert counts.sum() == n and counts[0] == 0
    expected = n * exact
    assert np.all(np.abs(counts - expected) <= 4.5 * np.sqrt(expected + 1))
    assert exact.sum() == pytest.approx(1.0, abs=1e-5)


def test_length_two_batches_and_bucketing_agree_with_reference(layered):
    """Length 2 with several rows (a past XLA:CPU miscompile), and length-bucketed chunking = one chunk."""
    bucketed = PCFG(layered.root, layered.binary, layered.emit, batch_size=8)
    corpus = layered.sample(400, seed=3)
    two = corpus.tokens[corpus.lengths == 2][:6, :2]
    assert len(two) == 6
    q2 = bucketed.conditionals(two, np.full(6, 2))  # a chart of exactly 2 words, 8 rows
    for b in range(len(two)):
        np.testing.assert_allclose(q2[b], ref_conditionals(layered, list(two[b])), rtol=1e-5, atol=1e-7)
    # 16 sentences sorted by length into two chunks of 8, each with a chart of 8 words (length 2 among them)
    pick = np.concatenate([np.flatnonzero(corpus.lengths == 2)[:6], np.flatnonzero(corpus.lengths >= 5)[:10]])
    tokens = garbage_padded(np.random.default_rng(0), corpus.tokens[pick], corpus.lengths[pick], 8)
    np.testing.assert_allclose(bucketed.conditionals(tokens, corpus.lengths[pick]),
                               layered.conditionals(tokens, corpus.lengths[pick]), rtol=1e-5, atol=1e-7)


def test_every_chunk_is_padded_to_the_batch_so_a_sentence_gets_the_same_bits_in_any_call(layered):
    """A last, smaller chunk is padded to the grammar's batch, within a call and across calls: one compiled program
    per chart size (a chart compiles in seconds, padded rows cost microseconds), and a sentence's conditionals are
    bitwise the same whichever call, and whichever calls before it, it comes in (`Engine.run`)."""
    corpus = layered.sample(64, seed=5)
    tokens, lengths = corpus.tokens[:11], corpus.lengths[:11]
    grammars = {}
    for name, first in (("padded", 11), ("small", 3)):  # "small" runs 3 sentences first
        g = PCFG(layered.root, layered.binary, layered.emit, batch_size=8, bucket_lengths=False)
        grammars[name] = (g, g.conditionals(tokens[:first], lengths[:first]))
    g, q_11 = grammars["padded"]
    q_3 = g.conditionals(tokens[8:], lengths[8:])  # after the 8 + 3 call: the chart's batch of 8 again
    assert [len(fn.executables) for fn in g._engine._fns.values()] == [1]  # 11 = 8 + 3 and then 3: one batch
    np.testing.assert_array_equal(q_3, q_11[8:])
    np.testing.assert_array_equal(grammars["small"][1], q_11[:3])  # 3 of 8 rows and 8 of 8: the same bits
    for b, words in enumerate(sentences_of(tokens, lengths, 8)[8:]):
        np.testing.assert_allclose(q_3[b, : len(words)], ref_conditionals(layered, words), rtol=1e-5, atol=1e-7)


def test_chunks_run_in_threads_give_the_sequential_bits_in_input_order(layered):
    """`Engine.workers` chunks at once (threads on the CPU backend; `default_workers` = this process's cores):
    bitwise the outputs of one chunk after another, every output of a multi-output kernel in the input order, with
    length-bucketed charts of several sizes, in float64 under jax x64 (a thread-local setting: the threads must see
    the caller's). Float32 with 1 and 2 workers: test_host_transfer.py (the same bits either way)."""
    from flatlm.languages.pcfg import engine

    assert engine.default_workers() == (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                        else os.cpu_count())
    g = PCFG(layered.root, layered.binary, layered.emit, batch_size=4)  # bucketed: charts of 4 and 8 words
    corpus = layered.sample(30, seed=21)
    tokens, lengths = corpus.tokens, corpus.lengths
    assert len({engine.bucket(int(n)) for n in lengths}) >= 2
    with jax.enable_x64(True):
        out = {}
        for workers in (1, 3):
            g._engine.workers = workers
            out[workers] = (g.conditionals(tokens, lengths), g.span_posteriors(tokens, lengths),
                            g.log_prob(tokens, lengths))
    assert out[3][0].dtype == out[3][1].dtype == np.float64
    for a, b in zip(out[1], out[3]):
        np.testing.assert_array_equal(a, b)
    for b, words in enumerate(sentences_of(tokens, lengths, layered.vocab_size)[:5]):
        np.testing.assert_allclose(out[3][0][b, : len(words)], ref_conditionals(layered, words), rtol=1e-9,
                                   atol=1e-12)


def test_span_posteriors_and_prefix_inside(layered):
    corpus = layered.sample(10, seed=13)
    post = layered.span_posteriors(corpus.tokens, corpus.lengths)
    prefix = layered.prefix_inside(corpus.tokens, corpus.lengths)
    T, N = layered.max_length, layered.num_nonterminals
    assert post.shape == (10, T, T + 1, N) and prefix.shape == (10, T, N)
    for b, words in enumerate(sentences_of(corpus.tokens, corpus.lengths, 8)[:5]):
        n = len(words)
        assert post[b, 0, n].sum() == pytest.approx(1.0, abs=1e-5)  # the root spans the sentence
        assert post[b].sum() == pytest.approx(2 * n - 1, abs=1e-4)  # a binary tree has 2n - 1 nodes
        inside, p = ref_inside(layered, words), ref_prob(layered, words)
        for k in range(1, n + 1):
            with np.errstate(divide="ignore"):
                np.testing.assert_allclose(prefix[b, k - 1], np.log(inside[(0, k)]), rtol=1e-5, atol=1e-5)
        for i, j in [(0, 2), (1, n), (0, n - 1), (n - 2, n)]:
            for A in range(N):
                assert post[b, i, j, A] == pytest.approx(ref_span_joint(layered, words, A, i, j) / p, abs=1e-5)


# ---- downstream tasks -------------------------------------------------------------------------------------


def cky_labels(g: PCFG, words, task: str, definition: str) -> int:
    """Per-sentence float64 reference of the released (argmax inside) and posterior task labels."""
    n = len(words)
    k = {"A": n, "B": 4, "C": 2}[task]
    ids = np.flatnonzero(g.root) if task == "A" else np.arange(g.num_nonterminals)
    if definition == "released":
        score = ref_inside(g, words)[(0, k)]
    else:
        score = np.array([ref_span_joint(g, words, A, 0, k) for A in range(g.num_nonterminals)])
    score = score[ids]  # ties (and all-zero) -> the first label, as the released dict order
    return int(np.argmax(score >= score.max() * (1 - 1e-9)))


@pytest.mark.parametrize("definition", ["released", "posterior"])
def test_task_labels_match_per_sentence_cky(layered, definition):
    n = 300 if definition == "released" else 64  # the posterior reference is slow Python
    corpus, labels = layered.sample_task(n, seed=17, task="B", definition=definition)
    assert corpus.lengths.min() >= 5 and corpus.lengths.max() <= 31 and labels.dtype == np.int32
    sentences = sentences_of(corpus.tokens, corpus.lengths, 8)
    for task in ("A", "B", "C"):
        got = labels if task == "B" else layered.task_labels(corpus.tokens, corpus.lengths, task, definition)
        want = [cky_labels(layered, words, task, definition) for words in sentences]
        np.testing.assert_array_equal(got, want)
        assert got.max() < layered.num_labels(task)
    assert layered.num_labels("A") == 3 and layered.num_labels("B") == layered.num_nonterminals
    assert layered.label_names("A") == ["S1", "S2", "S3"]


def test_paper_definition_is_the_span_posterior_over_all_nonterminals(layered):
    """A.1's text: y = argmax_s Pr(s | x) for the span of min(L, length) words from the start, 50-way (here N-way)."""
    corpus = layered.sample(40, seed=23)
    keep = corpus.lengths >= 3
    tokens, lengths = corpus.tokens[keep], corpus.lengths[keep]
    sentences = sentences_of(tokens, lengths, 8)
    N = layered.num_nonterminals
    for task, prefix in (("A", None), ("C", 3)):
        got = layered.task_labels(tokens, lengths, task, "paper", prefix=prefix)
        want = []
        for words in sentences:
            k = min(len(words), {"A": 32, "C": 3}[task])
            score = np.array([ref_span_joint(layered, words, A, 0, k) for A in range(N)])
            want.append(int(np.argmax(score >= score.max() * (1 - 1e-9))))
        np.testing.assert_array_equal(got, want)
    assert layered.num_labels("A", "paper") == N and layered.num_labels("A") == 3


def test_task_labels_validation(layered):
    corpus = layered.sample(20, seed=1)
    with pytest.raises(ValueError, match="at least 4 words"):
        layered.task_labels(corpus.tokens, np.minimum(corpus.lengths, 3), "B")
    with pytest.raises(ValueError, match="task must be one of"):
        layered.task_labels(corpus.tokens, corpus.lengths, "D")
    with pytest.raises(ValueError, match="definition"):
        layered.task_labels(corpus.tokens, corpus.lengths, "A", definition="gold")
