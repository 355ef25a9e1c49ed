"""tfds corpus builder and grain pipelines: contents, determinism, resumable position, host sharding."""

from __future__ import annotations

import numpy as np
import pytest

from flatlm.data import builder, pipeline, tasks
from flatlm.errors import UserError
from flatlm.languages import make_language
from flatlm.languages.hmm import random_hmm

SPEC = dict(name="hmm", seed=0, num_states=5, vocab_size=7, length=6, num_blocks=1, rules_file="")


def test_corpus_builder_writes_splits_with_exact_conditionals(tmp_path):
    b = builder.build(SPEC, str(tmp_path), train_size=300, eval_size=40, seed=0, quiet=True)
    src = builder.data_sources(b)
    assert len(src["train"]) == 300 and len(src["validation"]) == 40
    lang = make_language(SPEC)
    ex = src["validation"][:40] if False else [src["validation"][i] for i in range(40)]
    tokens = np.stack([e["tokens"] for e in ex])
    lengths = np.array([e["length"] for e in ex])
    q_stored = np.stack([e["conditionals"] for e in ex])
    np.testing.assert_allclose(q_stored, lang.conditionals(tokens, lengths), atol=1e-6)
    assert src["train"][0]["conditionals"].shape == (0, 7)  # train stores no conditionals
    assert "latent_states" in ex[0]
    # building again reuses the data (same files, nothing rewritten)
    files = sorted(p.stat().st_mtime_ns for p in tmp_path.rglob("*.array_record*"))
    builder.build(SPEC, str(tmp_path), train_size=300, eval_size=40, seed=0, quiet=True)
    assert files == sorted(p.stat().st_mtime_ns for p in tmp_path.rglob("*.array_record*"))


def test_built_corpora_and_tasks_do_not_keep_their_language(tmp_path):
    """tfds keeps every builder it made alive (its `info` is an unbounded lru_cache), so a language left on one kept
    the programs it compiled for the process's life (an experiment over many seeds ran out of memory mappings).
    After building, no corpus or task builder holds one; `language` makes it again when asked. Only the builders
    made here are looked at: an earlier test in the same process may have asked one of its own for its language
    (test_faults_checkpoints' size estimate does), and those stay alive too."""
    import gc

    kinds = (builder.FlatlmCorpus, tasks.FlatlmTask)
    earlier = [o for o in gc.get_objects() if isinstance(o, kinds)]  # held, so no new builder can reuse an id
    b = builder.build(SPEC, str(tmp_path), train_size=30, eval_size=10, seed=0, quiet=True)
    tasks.build_task(SPEC, "k2", str(tmp_path), (20, 10, 10), seed=0, quiet=True)
    gc.collect()
    seen = {id(o) for o in earlier}
    alive = [o for o in gc.get_objects() if isinstance(o, kinds) and id(o) not in seen]
    assert {type(o) for o in alive} == set(kinds)  # tfds still holds both builders...
    assert [o for o in alive if "_language" in vars(o)] == []  # ...but neither holds a language
    assert b.language.vocab_size == SPEC["vocab_size"]


class _Data:
    source = "tfds"
    batch_size = 8
    masking = "single"
    mask_prob = 0.15
    max_predictions = 5
    num_workers = 0


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_iterator_resumes_from_saved_state(tmp_path):
    b = builder.build(SPEC, str(tmp_path), train_size=50, eval_size=10, seed=0, quiet=True)
    src = builder.data_sources(b)["train"]
    it = pipeline.train_iterator(_Data, 7, seed=3, source=src)
    _take(it, 4)
    state = it.get_state()
    expected = _take(it, 10)  # crosses an epoch boundary (50 / 8)
    it2 = pipeline.train_iterator(_Data, 7, seed=3, source=src)
    it2.set_state(state)
    for a, e in zip(_take(it2, 10), expected):
        for k in a:
            np.testing.assert_array_equal(a[k], e[k])
    # epochs are reshuffled
    it3 = pipeline.train_iterator(_Data, 7, seed=3, source=src)
    seen = np.concatenate([x["targets"] for x in _take(it3, 12)])
    assert not np.array_equal(seen[:48], seen[50:98])


def test_processes_get_disjoint_shards(tmp_path):
    b = builder.build(SPEC, str(tmp_path), train_size=64, eval_size=8, seed=0, quiet=True)
    src = builder.data_sources(b)["train"]

    class Global(_Data):
        batch_size = 16

    rows = []
    for p in range(2):
        it = pipeline.train_iterator(Global, 7, seed=0, source=src, process_index=p, process_count=2)
        first_epoch = np.concatenate([x["targets"] for x in _take(it, 4)])  # 4 x 8 rows = 32 = shard size
        assert first_epoch.shape == (32, 6)
        rows.append({r.tobytes() for r in first_epoch})
    all_rows = {src[i]["tokens"].tobytes() for i in range(64)}
    assert rows[0] | rows[1] <= all_rows
    # disjoint unless the corpus holds duplicate sentences
    dup = 64 - len(all_rows)
    assert len(rows[0] & rows[1]) <= dup


def test_stream_is_deterministic_in_seed_step_and_process():
    lang = make_language(SPEC)

    class Stream(_Data):
        source = "stream"

    a = _take(pipeline.train_iterator(Stream, 7, seed=1, language=lang), 3)
    b = _take(pipeline.train_iterator(Stream, 7, seed=1, language=lang), 3)
    c = _take(pipeline.train_iterator(Stream, 7, seed=1, language=lang, process_index=1, process_count=2), 3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["tokens"], y["tokens"])
    assert not np.array_equal(a[0]["targets"], a[1]["targets"])  # steps differ
    assert c[0]["targets"].shape == (4, 6) and not np.array_equal(a[0]["targets"][:4], c[0]["targets"])


@pytest.mark.parametrize("block", [1, 3, 8, 512])
def test_stream_global_batch_is_the_same_for_any_process_count(block):
    """With blocks of any size (not dividing the batch or a process's share too), the processes' rows
    concatenated are the one-process batch; the block size is part of the data."""
    lang = make_language(SPEC)

    class Stream(_Data):
        source, stream_block = "stream", block

    whole = _take(pipeline.train_iterator(Stream, 7, seed=1, language=lang), 2)
    for count in (2, 4):
        parts = [_take(pipeline.train_iterator(Stream, 7, seed=1, language=lang, process_index=p,
                                               process_count=count), 2) for p in range(count)]
        for step in range(2):
            for k in whole[step]:
                np.testing.assert_array_equal(np.concatenate([p[step][k] for p in parts]), whole[step][k])
    if block < 8:  # the batch (8 rows) is one block at 8 and at 512: the same draws
        Stream.stream_block = 8
        assert not np.array_equal(_take(pipeline.train_iterator(Stream, 7, seed=1, language=lang), 1)[0]["tokens"],
                                  whole[0]["tokens"])


@pytest.mark.parametrize("name", ["pcfg", "hmm"])
@pytest.mark.parametrize("block, count", [(3, 1), (3, 2), (512, 1)])
def test_stream_batches_sampled_in_one_pass_are_the_per_block_batches(name, block, count):
    """A language with `sample_blocks` (the PCFG, the HMM) samples a stream batch's blocks in one pass: every row
    the same as a language offering only `sample` gets, one call per block (the reference), for one process and
    two."""
    from flatlm.languages.pcfg import random_grammar

    lang = random_grammar(0) if name == "pcfg" else random_hmm(0, num_states=6, vocab_size=8, length=6, num_blocks=2)

    class PerBlock:  # the language without `sample_blocks`: the pipeline calls `sample` once per block
        def __getattr__(self, name):
            if name == "sample_blocks":
                raise AttributeError(name)
            return getattr(lang, name)

    class Stream(_Data):
        source, stream_block, batch_size = "stream", block, 8

    for p in range(count):
        kw = dict(seed=1, process_index=p, process_count=count)
        got = _take(pipeline.train_iterator(Stream, lang.vocab_size, language=lang, **kw), 2)
        want = _take(pipeline.train_iterator(Stream, lang.vocab_size, language=PerBlock(), **kw), 2)
        for g, w in zip(got, want, strict=True):
            assert g.keys() == w.keys()
            for k in g:
                np.testing.assert_array_equal(g[k], w[k], err_msg=k)


def test_hmm_task_names_are_the_papers_one_based_variables():
    """A.1: task-k classifies the k-th hidden variable (1-based); k<i> is the 0-based position i."""
    assert [tasks.hmm_position(t) for t in ("task-1", "task-6", "task-10", "k0", "k5")] == [0, 5, 9, 0, 5]
    for bad in ("task-0", "task-x", "6", "A"):
        with pytest.raises(ValueError):
            tasks.hmm_position(bad)
    hmm = random_hmm(0, num_states=6, vocab_size=8, length=6, num_blocks=2)
    a = tasks.sample_task(hmm, "hmm", "task-6", 50, seed=3)
    b = tasks.sample_task(hmm, "hmm", "k5", 50, seed=3)
    np.testing.assert_array_equal(a["label"], b["label"])
    with pytest.raises(UserError, match="task-1 .. task-6"):
        tasks.check_task(hmm, "hmm", "task-7")


def test_quiet_task_builds_print_nothing(tmp_path, capfd):
    """`--quiet` (issue 16 item 7): building a downstream task's splits prints no tfds banner or progress bar."""
    spec = {"name": "hmm", "seed": 0, "num_states": 6, "vocab_size": 8, "length": 6, "num_blocks": 2}
    out = tasks.build_task(spec, "k2", str(tmp_path), (40, 10, 10), seed=0, quiet=True)
    captured = capfd.readouterr()
    assert len(out["train"]["label"]) == 40
    assert "Downloading and preparing" not in captured.err + captured.out and "examples" not in captured.err


def test_row_hash_draws_depend_on_the_row_id_only_and_are_uniform():
    """`RowHash` (the pipeline's masks): a row's draws are the same in any batch that holds it, and the draws of
    200k rows pass a Kolmogorov-Smirnov test for U[0, 1) (and integers are uniform by chi-square)."""
    from scipy import stats

    from flatlm.data.masking import RowHash

    big = RowHash(7, np.arange(200_000)).random((200_000, 4))
    part = RowHash(7, np.arange(5_000, 9_000)[::-1]).random((4_000, 4))
    np.testing.assert_array_equal(part, big[5_000:9_000][::-1])
    assert stats.kstest(big.ravel(), "uniform").pvalue > 1e-3
    assert not np.array_equal(RowHash(8, np.arange(10)).random((10, 4)), big[:10])  # the seed matters
    counts = np.bincount(RowHash(7, np.arange(50_000)).integers(0, 20, (50_000, 2)).ravel(), minlength=20)
    assert stats.chisquare(counts).pvalue > 1e-3


def test_corpus_arrays_hold_the_train_split_and_are_rebuilt_from_the_records(tmp_path):
    """The arrays the builder saves are the train split's sentences (as a multiset); a corpus without them (built
    before they existed) gets them from its records once, and a truncated file is not trusted."""
    b = builder.build(SPEC, str(tmp_path), train_size=300, eval_size=10, seed=0, quiet=True)
    src = builder.data_sources(b)["train"]
    tokens, lengths = builder.corpus_arrays(src)
    records = sorted((bytes(src[i]["tokens"].astype(np.int32)), int(src[i]["length"])) for i in range(300))
    assert sorted((bytes(t.astype(np.int32)), int(n)) for t, n in zip(tokens, lengths)) == records
    tok_path = next(tmp_path.rglob("train-tokens.npy"))
    tok_path.unlink()
    again, lengths2 = builder.corpus_arrays(src)  # from the records, in index order, and saved
    assert [bytes(t.astype(np.int32)) for t in again] == [bytes(src[i]["tokens"].astype(np.int32)) for i in range(300)]
    assert tok_path.exists()
    np.save(tok_path, np.asarray(again)[:10])  # a stale or truncated file: read from the records again
    assert len(builder.corpus_arrays(src)[0]) == 300


def test_a_full_disk_while_saving_the_arrays_is_one_line_and_leaves_no_file(tmp_path, monkeypatch):
    """Out of space while writing the corpus arrays: DiskFull (one line), no array file and no temporary left."""
    import errno

    from flatlm.errors import DiskFull

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "save", full)
    with pytest.raises(DiskFull, match="out of disk space writing .*train-tokens.npy"):
        builder.save_arrays(tmp_path, "train", np.zeros((3, 4), np.int32), np.full(3, 4))
    assert list(tmp_path.iterdir()) == []


def test_fixed_masks_give_each_sentence_one_mask_and_full_batches_one_objective(tmp_path):
    """data.fixed_masks: a sentence's masked input, targets and weights are the same at every visit (keyed by its
    corpus row); by default they are drawn anew each epoch. With batch_size = train_size every step is the whole
    corpus under the same masks (in another order): a deterministic full-batch objective."""
    b = builder.build(SPEC, str(tmp_path), train_size=24, eval_size=8, seed=0, quiet=True)
    src = builder.data_sources(b)["train"]
    corpus = {i: src[i]["tokens"].tobytes() for i in range(24)}
    assert len(set(corpus.values())) == 24, "the test needs distinct sentences"
    row_of = {v: k for k, v in corpus.items()}

    class Bert(_Data):
        masking = "bert"
        batch_size = 6

    def visits(data_cls, steps):
        """{corpus row: [(masked tokens, weights) at each visit]} over `steps` batches."""
        out: dict[int, list] = {}
        for x in _take(pipeline.train_iterator(data_cls, 7, seed=3, source=src), steps):
            for t, w, y in zip(x["tokens"], x["weights"], x["targets"]):
                out.setdefault(row_of[y.tobytes()], []).append((t.tobytes(), w.tobytes()))
        return out

    class Fixed(Bert):
        fixed_masks = True

    fixed, fresh = visits(Fixed, 16), visits(Bert, 16)  # 16 x 6 = 4 epochs of 24
    assert all(len(v) == 4 for v in fixed.values()) and len(fixed) == 24
    assert all(len(set(v)) == 1 for v in fixed.values())  # one mask per sentence
    assert sum(len(set(v)) > 1 for v in fresh.values()) >= 12  # default: masks change between epochs

    class FullBatch(Fixed):
        batch_size = 24

    batches = _take(pipeline.train_iterator(FullBatch, 7, seed=3, source=src), 3)
    as_set = lambda x: sorted(zip(*(map(bytes, x[k]) for k in ("tokens", "targets", "weights"))))  # noqa: E731
    assert as_set(batches[0]) == as_set(batches[1]) == as_set(batches[2])
    assert not np.array_equal(batches[0]["targets"], batches[1]["targets"])  # reshuffled, same multiset


def test_fixed_masks_need_the_tfds_source():
    from flatlm import data as data_lib
    from flatlm.config import base_config

    c = base_config().data
    c.fixed_masks, c.source = True, "stream"
    with pytest.raises(UserError, match="data.fixed_masks needs data.source=tfds"):
        data_lib.validate_config(c)
