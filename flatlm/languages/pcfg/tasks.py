"""Downstream tasks A, B, C on a PCFG (Section 3.2, Appendix A.1): classify the nonterminal of a span that starts
the sentence. Label spaces, the span each task labels, the argmax with the released code's tie-breaking, and
sampling of sentences within a length range; `PCFG.task_labels` puts them together with the chart kernels.

Three definitions of a label:
  "released" (default; the authors' generate_downstream.py): argmax of the prefix's inside probability
      P(A =>* x_0..x_{k-1}), k = length / 4 / 2 for tasks A / B / C; task A over the root's children only.
  "posterior": argmax_A P(A spans [0, k) | x) by inside-outside, the same spans as "released".
  "paper" (the paper's text, A.1): y = argmax_s Pr(s | x), s over all 50 nonterminals (50-way), for the span of
      L = 32 / 16 / 8 words from the sentence's start for tasks A / B / C (min(L, length) for shorter sentences),
      scored by the posterior. Where no nonterminal spans exactly [0, k) every score is 0 and the label is 0
      (the released tie rule); `PCFG.task_labels` callers can count such rows (scores all 0).
The released definition is the default because the paper's numbers come from the released code.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from flatlm.languages.base import Corpus

TASKS = ("A", "B", "C")
TASK_PREFIX = {"B": 4, "C": 2}  # released generate_downstream.py: inside_partial(sent, grammar, 4 / 2)
PAPER_SPAN = {"A": 32, "B": 16, "C": 8}  # the paper's text (A.1): span length L of tasks A, B, C
DEFINITIONS = ("released", "posterior", "paper")


def check_task(task: str) -> None:
    """Raise ValueError unless `task` is one of TASKS."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def check_definition(definition: str) -> None:
    """Raise ValueError unless `definition` is one of DEFINITIONS."""
    if definition not in DEFINITIONS:
        raise ValueError(f"definition must be one of {DEFINITIONS}, got {definition!r}")


def label_ids(task: str, root_N: np.ndarray, definition: str = "released") -> np.ndarray:
    """int[K] the nonterminal each label id stands for: task A the root's children (root[A] > 0, in order),
    B and C all N nonterminals; under the paper's definition every task is N-way (A.1: "50-way")."""
    check_task(task)
    check_definition(definition)
    if task == "A" and definition != "paper":
        return np.flatnonzero(root_N > 0)
    return np.arange(root_N.size)


def span_ends(task: str, lengths_n: np.ndarray, prefix: int | None = None, definition: str = "released"
              ) -> np.ndarray:
    """int[n] k: the labelled span is [0, k). Task A: the whole sentence; B: 4, C: 2 words (or `prefix`);
    the paper's definition: min(L, length) with L = 32 / 16 / 8.

    Raises ValueError for a prefix on task A, or a sentence shorter than the prefix.
    """
    if definition == "paper":
        k = PAPER_SPAN[task] if prefix is None else int(prefix)
        return np.minimum(lengths_n.astype(np.int64), k)
    if task == "A":
        if prefix is not None:
            raise ValueError("task A always uses the whole sentence; prefix applies to B and C")
        return lengths_n.astype(np.int64)
    k = TASK_PREFIX[task] if prefix is None else int(prefix)
    if k < 1 or np.any(lengths_n < k):
        raise ValueError(f"task {task} needs sentences of at least {k} words")
    return np.full(len(lengths_n), k)


def best_label(score_nN: np.ndarray, ids_K: np.ndarray) -> np.ndarray:
    """int32[n] argmax over the label ids of score[:, ids], ties (within rounding) to the lowest label id.

    Scores within relative 1e-5 (float32; 1e-10 for float64) of the best count as tied, so that
    mathematically equal scores resolve the same way whatever the rounding of the scaled chart.
    """
    score_nK = score_nN[:, ids_K].astype(np.float64)
    tol = 1e-10 if score_nN.dtype == np.float64 else 1e-5  # rounding of the scaled chart
    best_n1 = score_nK.max(1, keepdims=True)
    return np.argmax(score_nK >= best_n1 * (1 - tol), axis=1).astype(np.int32)


def sample_lengths(sample: Callable[[int, int], Corpus], n: int, seed: int, p: float, min_length: int,
                   max_length: int) -> Corpus:
    """n sentences with min_length <= length <= max_length, by rejection from `sample(count, seed)`.

    `p` is the probability of that length range (> 0): each round draws 10% more than the expected need.
    """
    rng = np.random.default_rng(seed)
    parts, have = [], 0
    while have < n:
        c = sample(int((n - have) / p * 1.1) + 16, int(rng.integers(2**31)))
        keep = (c.lengths >= min_length) & (c.lengths <= max_length)
        parts.append(Corpus(c.tokens[keep], c.lengths[keep], {k: v[keep] for k, v in c.latents.items()}))
        have += int(keep.sum())
    return Corpus(
        tokens=np.concatenate([c.tokens for c in parts])[:n],
        lengths=np.concatenate([c.lengths for c in parts])[:n],
        latents={k: np.concatenate([c.latents[k] for c in parts])[:n] for k in parts[0].latents},
    )
