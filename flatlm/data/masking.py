"""MLM masking of a batch of sentences (vectorised numpy, deterministic given a numpy Generator or `RowHash`).

"single": one position per sentence, uniform over its words, replaced by the mask id (the paper's setting,
          which matches the exact loss: every position masked in turn).
"bert":   each word selected with probability `mask_prob`, at most `max_predictions` per sentence (at least
          one), selected words -> mask 80%, random word 10%, kept 10% (the released scripts).
"""

from __future__ import annotations

import numpy as np

from flatlm.languages.base import special_ids


class RowHash:
    """A stand-in for a numpy Generator in `mask_batch` whose draws for row b depend only on (seed, ids_B[b]).

    Draw j of a row is splitmix64 of (seed, row id, call number, j): one vectorised numpy expression for the whole
    batch, so a sentence's mask depends on its position in the global stream alone (not on the batch, the process
    or the number of processes that read it), at ~1 us a row instead of a Generator per sentence (~25 us).
    """

    def __init__(self, seed: int, ids_B: np.ndarray):
        self.key = _splitmix(np.uint64(seed & (2**64 - 1)) ^ np.uint64(0x5EED5EED))
        self.ids_B = np.asarray(ids_B, np.uint64)
        self.calls = 0

    def _bits(self, shape) -> np.ndarray:
        shape = (shape,) if np.isscalar(shape) else tuple(shape)
        B, cols = shape[0], int(np.prod(shape[1:], dtype=np.int64))
        if B != self.ids_B.size:
            raise ValueError(f"RowHash has {self.ids_B.size} rows, asked for {B}")
        self.calls += 1
        with np.errstate(over="ignore"):
            x = (self.ids_B[:, None] * np.uint64(0x9E3779B97F4A7C15) ^ self.key
                 ^ (np.uint64(self.calls) << np.uint64(40)) ^ np.arange(cols, dtype=np.uint64)[None, :])
        return _splitmix(x).reshape(shape)

    def random(self, shape) -> np.ndarray:
        """Uniform [0, 1) floats of `shape` (leading axis: the rows), 53 random bits each."""
        return (self._bits(shape) >> np.uint64(11)).astype(np.float64) * 2.0**-53

    def integers(self, low: int, high: int, size) -> np.ndarray:
        """Integers in [low, high) of `size` (bias below 2^-40 for ranges under 2^13)."""
        return low + np.floor(self.random(size) * (high - low)).astype(np.int64)


class BlockGenerators:
    """A stand-in for a numpy Generator in `mask_batch` over a batch made of blocks of rows: block b (`sizes[b]`
    consecutive rows) draws from `rngs[b]`, so its rows are masked as `mask_batch` on that block alone with
    `rngs[b]` masks them (every draw of `mask_batch` has the rows as its leading axis). The stream source masks a
    batch of `data.stream_block`-row blocks, each with its own generator, in one call."""

    def __init__(self, rngs, sizes):
        self.rngs, self.sizes = list(rngs), [int(n) for n in sizes]

    def _split(self, shape, draw) -> np.ndarray:
        shape = (shape,) if np.isscalar(shape) else tuple(shape)
        if shape[0] != sum(self.sizes):
            raise ValueError(f"BlockGenerators has {sum(self.sizes)} rows, asked for {shape[0]}")
        return np.concatenate([draw(r, (n,) + shape[1:]) for r, n in zip(self.rngs, self.sizes, strict=True)])

    def random(self, shape) -> np.ndarray:
        """Uniform [0, 1) floats of `shape` (leading axis: the rows), block b's from its generator."""
        return self._split(shape, lambda r, s: r.random(s))

    def integers(self, low: int, high: int, size) -> np.ndarray:
        """Integers in [low, high) of `size` (leading axis: the rows), block b's from its generator."""
        return self._split(size, lambda r, s: r.integers(low, high, size=s))


def _splitmix(x):
    """splitmix64's finalizer on uint64 (arrays or scalars): a bijection with full avalanche."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def mask_batch(tokens_BT: np.ndarray, lengths_B: np.ndarray, num_words: int, rng: np.random.Generator | RowHash,
               masking: str = "single", mask_prob: float = 0.15, max_predictions: int = 5,
               last_use: bool = False) -> dict:
    """Returns the MLM batch dict: tokens (masked input), targets (original), weights (1 at predictions) and
    positions [B, P] (P = 1 for "single", max_predictions for "bert"): every prediction's position in its row.

    `last_use=True`: the caller draws nothing more from `rng`, so "single" masking skips the random-word draw
    whose values it never uses (the same batch; the input pipelines' case). The default keeps a shared
    Generator's stream as it always was (`Run.mlm_batches` masks batch after batch with one)."""
    ids = special_ids(num_words)
    B, T = tokens_BT.shape
    pos_T = np.arange(T)
    valid_BT = pos_T[None, :] < lengths_B[:, None]
    if masking == "single":  # the chosen position is the row's only prediction (position 0 in an empty row)
        chosen_B = np.floor(rng.random(B) * np.maximum(lengths_B, 1)).astype(np.int64)
        selected_BT = (pos_T[None, :] == chosen_B[:, None]) & valid_BT
        replace_BT, random_BT = selected_BT, None  # no random words; the draw below keeps a shared stream
        positions_BP = chosen_B[:, None]
    elif masking == "bert":
        # Random priorities; the `max_predictions` smallest below mask_prob are selected, and the
        # smallest always is, so every sentence has between 1 and max_predictions predictions.
        u_BT = np.where(valid_BT, rng.random((B, T)), np.inf)
        rank_BT = np.argsort(np.argsort(u_BT, axis=1), axis=1)
        selected_BT = valid_BT & (rank_BT < max_predictions) & ((u_BT < mask_prob) | (rank_BT == 0))
        action_BT = rng.random((B, T))
        replace_BT = selected_BT & (action_BT < 0.8)
        random_BT = selected_BT & (action_BT >= 0.8) & (action_BT < 0.9)
        # the selected positions first (ascending), then unselected ones: the MLM head runs only there
        positions_BP = np.argsort(~selected_BT, axis=1, kind="stable")[:, :min(max_predictions, T)]
    else:
        raise ValueError(f"unknown masking {masking!r}")
    inputs_BT = np.where(replace_BT, ids.mask, tokens_BT)
    if random_BT is not None or not last_use:
        words_BT = rng.integers(0, num_words, size=(B, T))
        inputs_BT = inputs_BT if random_BT is None else np.where(random_BT, words_BT, inputs_BT)
    return {
        "tokens": inputs_BT.astype(np.int32),
        "targets": tokens_BT.astype(np.int32),
        "weights": selected_BT.astype(np.float32),
        "positions": positions_BP.astype(np.int32),
    }
