"""grain input pipelines: shuffled, masked, batched MLM batches for this process, with checkpointable state.

`train_iterator` returns a grain DatasetIterator whose position is saved with the model
(`grain.checkpoint.CheckpointSave`), so a resumed run sees exactly the batches it would have seen.
Two sources: a tfds corpus (shuffled per epoch) or an on-the-fly stream from the sampler, deterministic in
(seed, step, row), for corpora too large to store. Either way the global batch of a step does not depend on the
number of processes: each process reads its contiguous share of the rows (`local_rows`), and N processes train
exactly like one.
"""

from __future__ import annotations

from collections.abc import Iterator

import grain
import numpy as np

from flatlm.data.masking import mask_batch

STREAM_BLOCK = 8  # rows sampled (and masked) together by the stream source, seeded by (seed, step, block)


class _MaskRow(grain.transforms.RandomMap):
    """One sentence -> its MLM example; grain seeds the rng by the sentence's index in the global stream."""

    def __init__(self, num_words: int, masking: str, mask_prob: float, max_predictions: int):
        self.kw = dict(num_words=num_words, masking=masking, mask_prob=mask_prob, max_predictions=max_predictions)

    def random_map(self, ex: dict, rng: np.random.Generator) -> dict:
        out = mask_batch(np.asarray(ex["tokens"])[None], np.asarray(ex["length"]).reshape(1), rng=rng, **self.kw)
        return {k: v[0] for k, v in out.items()}


class _SampleRows(grain.transforms.Map):
    """Step i -> rows [lo, hi) of the global batch of step i, sampled from the language and masked.

    Row r of step i belongs to block r // STREAM_BLOCK, sampled and masked with seeds (seed, i, block): a row's
    content depends on (seed, step, row) only, so the global batch is the same for every number of processes;
    a process samples only the blocks that hold its rows."""

    def __init__(self, language, batch_size: int, lo: int, hi: int, seed: int, mask_kw: dict):
        self.language, self.batch_size, self.lo, self.hi = language, batch_size, lo, hi
        self.seed, self.mask_kw = seed, mask_kw

    def map(self, index: int) -> dict:
        first, parts = self.lo // STREAM_BLOCK, []
        for block in range(first, (self.hi - 1) // STREAM_BLOCK + 1):
            size = min(STREAM_BLOCK, self.batch_size - block * STREAM_BLOCK)
            seeds = np.random.SeedSequence([self.seed, int(index), block]).generate_state(2)
            corpus = self.language.sample(size, seed=int(seeds[0]))
            parts.append(mask_batch(corpus.tokens.astype(np.int32), corpus.lengths.astype(np.int32),
                                    rng=np.random.default_rng(int(seeds[1])), **self.mask_kw))
        rows = slice(self.lo - first * STREAM_BLOCK, self.hi - first * STREAM_BLOCK)
        return {k: np.concatenate([p[k] for p in parts])[rows] for k in parts[0]}


def _select(ex: dict) -> dict:
    return {"tokens": ex["tokens"], "length": ex["length"]}


def local_rows(batch_size: int, process_index: int, process_count: int) -> tuple[int, int]:
    """[lo, hi): the rows of every global batch that process `process_index` reads (contiguous, equal shares)."""
    local = batch_size // process_count
    return process_index * local, (process_index + 1) * local


def train_dataset(data_config, num_words: int, seed: int, source=None, language=None,
                  process_index: int = 0, process_count: int = 1) -> grain.MapDataset:
    """Infinite MapDataset of this process's rows of the global masked batches.

    Global batch i is the same for any number of processes (its rows depend on the seed, i and the row only);
    process p reads only its rows `local_rows(...)` of it. tfds: the corpus is shuffled per epoch into one stream
    of sentences, each masked with an rng seeded by its position in that stream; batch i is stream rows
    [i * B, (i + 1) * B). Stream: see `_SampleRows`."""
    local = data_config.batch_size // process_count
    mask_kw = dict(num_words=num_words, masking=data_config.masking, mask_prob=data_config.mask_prob,
                   max_predictions=data_config.max_predictions)
    if data_config.source == "stream":
        lo, hi = local_rows(data_config.batch_size, process_index, process_count)
        return grain.MapDataset.range(0, 2**62).map(
            _SampleRows(language, data_config.batch_size, lo, hi, seed, mask_kw))
    ds = grain.MapDataset.source(source).seed(seed).shuffle().repeat().map(_select)  # a new order each epoch
    ds = ds.seed(seed + 1).random_map(_MaskRow(**mask_kw))
    # chunk c of `local` rows is rows [(c mod P) * local, ...) of global batch c // P: take every P-th chunk
    return ds.batch(local, drop_remainder=True)[process_index::process_count]


def train_iterator(data_config, num_words: int, seed: int, **kw) -> grain.DatasetIterator:
    """A checkpointable grain iterator over `train_dataset(...)` (its position is saved with the model)."""
    ds = train_dataset(data_config, num_words, seed, **kw).to_iter_dataset(
        grain.ReadOptions(num_threads=max(1, data_config.num_workers), prefetch_buffer_size=2)
    )
    return iter(ds)


def eval_batches(source, batch_size: int, limit: int | None = None,
                 process_index: int = 0, process_count: int = 1) -> Iterator[dict]:
    """Validation examples in order, batched (the last batch may be short), this process's share only."""
    n = len(source) if limit is None else min(limit, len(source))
    for start in range(process_index * batch_size, n, batch_size * process_count):
        idx = list(range(start, min(start + batch_size, n)))
        items = source.__getitems__(idx) if hasattr(source, "__getitems__") else [source[i] for i in idx]
        yield {k: np.stack([it[k] for it in items]) for k in items[0]}
