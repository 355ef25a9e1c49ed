"""MLM masking of a batch of sentences (vectorised numpy, deterministic given a numpy Generator).

"single": one position per sentence, uniform over its words, replaced by the mask id (the paper's setting,
          which matches the exact loss: every position masked in turn).
"bert":   each word selected with probability `mask_prob`, at most `max_predictions` per sentence (at least
          one), selected words -> mask 80%, random word 10%, kept 10% (the released scripts).
"""

from __future__ import annotations

import numpy as np

from flatlm.languages.base import special_ids


def mask_batch(tokens_BT: np.ndarray, lengths_B: np.ndarray, num_words: int, rng: np.random.Generator,
               masking: str = "single", mask_prob: float = 0.15, max_predictions: int = 5) -> dict:
    """Returns the MLM batch dict: tokens (masked input), targets (original), weights (1 at predictions)."""
    ids = special_ids(num_words)
    B, T = tokens_BT.shape
    pos_T = np.arange(T)
    valid_BT = pos_T[None, :] < lengths_B[:, None]
    if masking == "single":
        chosen_B = np.floor(rng.random(B) * np.maximum(lengths_B, 1)).astype(np.int64)
        selected_BT = (pos_T[None, :] == chosen_B[:, None]) & valid_BT
        replace_BT = selected_BT
        random_BT = np.zeros_like(selected_BT)
    elif masking == "bert":
        # Random priorities; the `max_predictions` smallest below mask_prob are selected, and the
        # smallest always is, so every sentence has between 1 and max_predictions predictions.
        u_BT = np.where(valid_BT, rng.random((B, T)), np.inf)
        rank_BT = np.argsort(np.argsort(u_BT, axis=1), axis=1)
        selected_BT = valid_BT & (rank_BT < max_predictions) & ((u_BT < mask_prob) | (rank_BT == 0))
        action_BT = rng.random((B, T))
        replace_BT = selected_BT & (action_BT < 0.8)
        random_BT = selected_BT & (action_BT >= 0.8) & (action_BT < 0.9)
    else:
        raise ValueError(f"unknown masking {masking!r}")
    inputs_BT = np.where(replace_BT, ids.mask, tokens_BT)
    inputs_BT = np.where(random_BT, rng.integers(0, num_words, size=(B, T)), inputs_BT)
    return {
        "tokens": inputs_BT.astype(np.int32),
        "targets": tokens_BT.astype(np.int32),
        "weights": selected_BT.astype(np.float32),
    }
