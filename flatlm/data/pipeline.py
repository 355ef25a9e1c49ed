"""grain input pipelines: shuffled, masked, batched MLM batches for this process, with checkpointable state.

`train_iterator` returns a grain DatasetIterator whose position is saved with the model
(`grain.checkpoint.CheckpointSave`), so a resumed run sees exactly the batches it would have seen.
Two sources: a tfds corpus (shuffled per epoch) or an on-the-fly stream from the sampler, deterministic in
(seed, step, row), for corpora too large to store. Both build a whole batch per grain element with vectorised
numpy (gather from the corpus's memory-mapped arrays, `builder.corpus_arrays`; masks from `RowHash`), never a
Python call per sentence: `benchmarks/startup_pipeline.py` holds the rate against an accelerator's step.
Either way the global batch of a step does not depend on the
number of processes: each process reads its contiguous share of the rows (`local_rows`), and N processes train
exactly like one.
"""

from __future__ import annotations

from collections.abc import Iterator

import grain
import numpy as np

from flatlm.config import LEGACY_STREAM_BLOCK
from flatlm.data.builder import corpus_arrays, read_items
from flatlm.data.masking import BlockGenerators, RowHash, mask_batch
from flatlm.languages.base import sample_blocks


class _CorpusRows(grain.transforms.Map):
    """Step i -> rows [lo, hi) of global batch i of the corpus stream, gathered and masked in one go.

    The stream is the corpus shuffled anew each epoch (epoch e: permutation of rng (seed, e)), concatenated; batch
    i is stream positions [i B, (i + 1) B), so batches run across epoch ends and every sentence is seen once per
    epoch. A sentence's mask is drawn by `RowHash(seed, stream position)`, or `RowHash(seed, corpus row)` with
    `fixed_masks` (one mask per sentence for the whole run): the global batch is the same for any number of
    processes."""

    def __init__(self, tokens_NT, lengths_N, batch_size: int, lo: int, hi: int, seed: int, mask_kw: dict,
                 fixed_masks: bool = False):
        self.tokens_NT, self.lengths_N = tokens_NT, lengths_N
        self.batch_size, self.lo, self.hi, self.seed, self.mask_kw = batch_size, lo, hi, seed, mask_kw
        self.fixed_masks = fixed_masks
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2 + self.batch_size // len(self.lengths_N):  # the epochs one batch spans
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths_N))
        return self._perms[epoch]

    def map(self, index: int) -> dict:
        pos_B = int(index) * self.batch_size + np.arange(self.lo, self.hi, dtype=np.int64)
        epoch_B, offset_B = np.divmod(pos_B, len(self.lengths_N))
        rows_B = np.empty_like(pos_B)
        for epoch in np.unique(epoch_B):
            at = epoch_B == epoch
            rows_B[at] = self._perm(int(epoch))[offset_B[at]]
        order = np.argsort(rows_B)  # gather from the memory map in file order
        tokens_BT = np.empty((len(rows_B), self.tokens_NT.shape[1]), np.int32)
        lengths_B = np.empty(len(rows_B), np.int32)
        tokens_BT[order], lengths_B[order] = self.tokens_NT[rows_B[order]], self.lengths_N[rows_B[order]]
        return mask_batch(tokens_BT, lengths_B, rng=RowHash(self.seed, rows_B if self.fixed_masks else pos_B),
                          last_use=True, **self.mask_kw)


class _SampleRows(grain.transforms.Map):
    """Step i -> rows [lo, hi) of the global batch of step i, sampled from the language and masked.

    Row r of step i belongs to block r // `block` (`data.stream_block` rows), sampled by one call of the
    language's vectorised sampler and masked with seeds (seed, i, block): a row's content depends on (seed, step,
    row, block size) only, so the global batch is the same for every number of processes; a process samples only
    the blocks that hold its rows (whole blocks: a share smaller than a block samples rows it drops)."""

    def __init__(self, language, batch_size: int, lo: int, hi: int, seed: int, mask_kw: dict, block: int):
        self.language, self.batch_size, self.lo, self.hi = language, batch_size, lo, hi
        self.seed, self.mask_kw, self.block = seed, mask_kw, block

    def map(self, index: int) -> dict:
        first = self.lo // self.block
        blocks = range(first, (self.hi - 1) // self.block + 1)
        sizes = [min(self.block, self.batch_size - block * self.block) for block in blocks]
        seeds = [np.random.SeedSequence([self.seed, int(index), block]).generate_state(2) for block in blocks]
        corpus = sample_blocks(self.language, sizes, [int(s[0]) for s in seeds], latents=False)  # tokens, lengths
        rng = BlockGenerators([np.random.default_rng(int(s[1])) for s in seeds], sizes)  # each block its own masks
        batch = mask_batch(corpus.tokens.astype(np.int32), corpus.lengths.astype(np.int32), rng=rng, last_use=True,
                           **self.mask_kw)
        rows = slice(self.lo - first * self.block, self.hi - first * self.block)
        return {k: v[rows] for k, v in batch.items()}


def local_rows(batch_size: int, process_index: int, process_count: int) -> tuple[int, int]:
    """[lo, hi): the rows of every global batch that process `process_index` reads (contiguous, equal shares)."""
    local = batch_size // process_count
    return process_index * local, (process_index + 1) * local


def train_dataset(data_config, num_words: int, seed: int, source=None, language=None,
                  process_index: int = 0, process_count: int = 1) -> grain.MapDataset:
    """Infinite MapDataset of this process's rows of the global masked batches.

    Global batch i is the same for any number of processes (its rows depend on the seed, i and the row only);
    process p reads only its rows `local_rows(...)` of it. tfds: see `_CorpusRows`; stream: see `_SampleRows`."""
    mask_kw = dict(num_words=num_words, masking=data_config.masking, mask_prob=data_config.mask_prob,
                   max_predictions=data_config.max_predictions)
    if data_config.source == "stream":
        lo, hi = local_rows(data_config.batch_size, process_index, process_count)
        return grain.MapDataset.range(0, 2**62).map(
            _SampleRows(language, data_config.batch_size, lo, hi, seed, mask_kw,
                        getattr(data_config, "stream_block", LEGACY_STREAM_BLOCK)))
    tokens_NT, lengths_N = corpus_arrays(source)
    lo, hi = local_rows(data_config.batch_size, process_index, process_count)
    return grain.MapDataset.range(0, 2**62).map(
        _CorpusRows(tokens_NT, lengths_N, data_config.batch_size, lo, hi, seed, mask_kw,
                    fixed_masks=bool(getattr(data_config, "fixed_masks", False))))


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
        items = read_items(source, list(range(start, min(start + batch_size, n))))
        yield {k: np.stack([it[k] for it in items]) for k in items[0]}
