"""Bidirectional LSTM MLM model (the paper's HMM experiments): embed -> L x BiLSTM -> dense head over V words."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from flatlm.languages.base import special_ids
from flatlm.models.bert import at_position, at_positions, check_depth


@dataclasses.dataclass(frozen=True)
class LSTMConfig:
    """d_hidden per direction (paper: 128..1024), num_layers (paper: 4..16)."""

    num_words: int
    max_len: int
    d_hidden: int = 128
    num_layers: int = 4
    d_embed: int = 0  # 0 -> d_hidden
    dropout: float = 0.1
    dtype: str = "float32"
    param_dtype: str = "float32"

    @property
    def vocab_size(self) -> int:
        """Embedding rows: the V words plus pad, mask and cls."""
        return special_ids(self.num_words).vocab_size

    @property
    def embed_dim(self) -> int:
        """Token embedding size (d_embed, default d_hidden)."""
        return self.d_embed or self.d_hidden


class BiLSTM(nn.Module):
    """`__call__(tokens) -> logits[B, T, V]`; `features(tokens) -> hidden[B, T, 2 * d_hidden]`."""

    cfg: LSTMConfig

    def setup(self):
        c = self.cfg
        pdt = jnp.dtype(c.param_dtype)
        init = lambda names: nn.with_logical_partitioning(nn.initializers.normal(0.02), names)
        self.tok_embed = self.param("tok_embed", init(("vocab", "embed")), (c.vocab_size, c.embed_dim), pdt)
        cell = lambda: nn.OptimizedLSTMCell(c.d_hidden, dtype=jnp.dtype(c.dtype), param_dtype=pdt)
        self.layers = [
            nn.Bidirectional(nn.RNN(cell()), nn.RNN(cell()), name=f"bilstm_{i}") for i in range(c.num_layers)
        ]
        self.head = nn.Dense(
            c.num_words, dtype=jnp.dtype(c.dtype), param_dtype=pdt,
            kernel_init=init(("mlp", "vocab")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab",)),
            name="head",
        )
        self.drop = nn.Dropout(c.dropout)

    def features(self, tokens_BT, deterministic: bool = True, num_layers: int | None = None):
        """Per-token hidden states [B, T, 2 * d_hidden] of the last bidirectional layer (lengths from padding); with
        `num_layers=k`, of the k-th (1-based): the probe of an inner layer (`eval.probe.layers`)."""
        c = self.cfg
        lengths_B = jnp.sum(tokens_BT != special_ids(c.num_words).pad, axis=1)
        x = jnp.take(self.tok_embed, tokens_BT, axis=0).astype(jnp.dtype(c.dtype))
        for layer in self.layers[:check_depth(num_layers, c.num_layers)]:
            x = self.drop(layer(x, seq_lengths=lengths_B), deterministic=deterministic)
        return x

    def logits_at(self, tokens_NT, positions_N):
        """MLM logits [N, V] at one position per sequence (the exact loss masks one position per copy): the
        head runs only there."""
        return self.head(at_position(self.features(tokens_NT), positions_N))

    def __call__(self, tokens_BT, deterministic: bool = True, positions_BP=None):
        """MLM logits [B, T, V] over the language's words (dropout on iff not `deterministic`); with
        `positions_BP` only at those positions, [B, P, V] (as `Bert`)."""
        return self.head(at_positions(self.features(tokens_BT, deterministic), positions_BP))
