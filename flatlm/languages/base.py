"""The interface every language implements, and the token-id convention shared by data and models."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """Special token ids; they come after the language's V words (ids 0..V-1)."""

    pad: int
    mask: int
    cls: int

    @property
    def vocab_size(self) -> int:
        """Size of the model's input embedding: V words + pad, mask, cls."""
        return self.cls + 1


def special_ids(num_words: int) -> SpecialIds:
    """pad = V, mask = V + 1, cls = V + 2."""
    return SpecialIds(pad=num_words, mask=num_words + 1, cls=num_words + 2)


@dataclasses.dataclass
class Corpus:
    """A batch of sentences from a language.

    tokens: int32[n, T] word ids, padded with `pad` (= V) beyond each length.
    lengths: int32[n] number of words of each sentence.
    latents: language-specific latent variables (e.g. HMM hidden states int32[n, T]; PCFG parse trees).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    latents: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class Language(Protocol):
    """What the data pipeline, the evaluators and the lookup-table baseline need from a language."""

    vocab_size: int
    max_length: int

    def sample(self, n: int, seed: int) -> Corpus:
        """n sentences, deterministic in `seed`: tokens int32[n, T] (padded), lengths int32[n], latents."""
        ...

    def log_prob(self, tokens, lengths):
        """Exact log P(x) in nats, float[n]."""
        ...

    def conditionals(self, tokens, lengths):
        """Exact q[n, T, V] with q[b, t, w] = P(x_t = w | x_-t) for t < lengths[b], 0 beyond."""
        ...
