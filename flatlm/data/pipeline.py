"""grain input pipelines: shuffled, masked, batched MLM batches for this process, with checkpointable state.

`train_iterator` returns a grain DatasetIterator whose position is saved with the model
(`grain.checkpoint.CheckpointSave`), so a resumed run sees exactly the batches it would have seen.
Two sources: a tfds corpus (shuffled per epoch) or an on-the-fly stream from the sampler, deterministic in
(seed, step, process), for corpora too large to store.
"""

from __future__ import annotations

from collections.abc import Iterator

import grain
import numpy as np

from flatlm.data.masking import mask_batch


class _Mask(grain.transforms.RandomMap):
    def __init__(self, num_words: int, masking: str, mask_prob: float, max_predictions: int):
        self.kw = dict(num_words=num_words, masking=masking, mask_prob=mask_prob, max_predictions=max_predictions)

    def random_map(self, batch: dict, rng: np.random.Generator) -> dict:
        return mask_batch(batch["tokens"], batch["length"], rng=rng, **self.kw)


class _SampleBatch(grain.transforms.Map):
    """Index i -> a fresh batch sampled from the language, seeded by (seed, i, process)."""

    def __init__(self, language, size: int, seed: int, process_index: int):
        self.language, self.size, self.seed, self.process = language, size, seed, process_index

    def map(self, index: int) -> dict:
        seed = int(np.random.SeedSequence([self.seed, int(index), self.process]).generate_state(1)[0])
        corpus = self.language.sample(self.size, seed=seed)
        return {"tokens": corpus.tokens.astype(np.int32), "length": corpus.lengths.astype(np.int32)}


def _select(ex: dict) -> dict:
    return {"tokens": ex["tokens"], "length": ex["length"]}


def train_dataset(data_config, num_words: int, seed: int, source=None, language=None,
                  process_index: int = 0, process_count: int = 1) -> grain.MapDataset:
    """Infinite MapDataset of this process's masked batches (global batch / process_count rows each)."""
    local = data_config.batch_size // process_count
    mask = _Mask(num_words, data_config.masking, data_config.mask_prob, data_config.max_predictions)
    if data_config.source == "stream":
        ds = grain.MapDataset.range(0, 2**62).map(_SampleBatch(language, local, seed, process_index))
    else:
        ds = grain.MapDataset.source(source)[process_index::process_count]
        ds = ds.seed(seed).repeat().shuffle().map(_select).batch(local, drop_remainder=True)
    return ds.seed(seed + 1).random_map(mask)


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
