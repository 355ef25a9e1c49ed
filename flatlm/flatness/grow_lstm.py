"""Function-preserving width growth of a trained BiLSTM (the paper's HMM model, A.3), so that its flatness can be
compared with a wider BiLSTM's in the same parameter space, as B.4 does for transformers.

Width x k (k = d_hidden' / d_hidden, an integer): every hidden unit is replicated k times, h' = tile(h) =
[h, h, ..., h] (and the cell state likewise). Each gate's pre-activation is sum_i x_i W_ij + sum_i h_i U_ij + b_j:
- kernels that read a replicated vector (the recurrent U, the next layer's input kernels, which read the concat
  [forward h, backward h] of the layer below, and the head) are tiled along their input axis and divided by k, so
  every dot product is unchanged;
- every kernel and bias is tiled along its output (gate-unit) axis, so the gates, the cell and h are replicated.
The token embedding (width d_embed, which defaults to d_hidden) is tiled k times when it follows d_hidden, and then
the first layer's input kernels are divided by k as well. Exact up to float summation order.

Depth cannot be grown exactly: a stacked LSTM has no residual path, and no LSTM layer computes the identity
(h = o * tanh(c) is bounded in (-1, 1) and saturating), so `embed_lstm` refuses a deeper target in one line.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from flatlm.errors import UserError
from flatlm.models.lstm import LSTMConfig

_GATES = "ifgo"


def grown_lstm_config(small: LSTMConfig, d_hidden: int, num_layers: int | None = None) -> LSTMConfig:
    """`small` at width `d_hidden` (an embedding that follows d_hidden grows with it); `num_layers` other than the
    small model's is refused by `embed_lstm`."""
    return dataclasses.replace(small, d_hidden=d_hidden, num_layers=num_layers or small.num_layers)


def _tile_in(w, k: int, halves: int = 1):
    """Tile a kernel [rows, out] along its input rows (`halves` blocks, e.g. forward/backward) and divide by k."""
    blocks = np.split(np.asarray(w), halves, axis=0)
    return np.concatenate([np.tile(b, (k, 1)) for b in blocks], axis=0) / k


def _tile_out(w, k: int):
    """Tile a kernel or bias along its last (output unit) axis."""
    w = np.asarray(w)
    return np.tile(w, (1,) * (w.ndim - 1) + (k,))


def embed_lstm(params, small: LSTMConfig, big: LSTMConfig) -> dict:
    """`params` of the BiLSTM `small` as parameters of `big` computing the same logits (width x k only)."""
    if big.num_layers != small.num_layers:
        raise UserError(f"BiLSTM depth cannot grow exactly ({small.num_layers} -> {big.num_layers} layers): a "
                        "stacked LSTM has no residual path; grow the width only (same num_layers)")
    if big.d_hidden % small.d_hidden or big.d_hidden < small.d_hidden:
        raise UserError(f"d_hidden {big.d_hidden} is not a multiple of the small model's {small.d_hidden}")
    if (big.num_words, big.max_len) != (small.num_words, small.max_len):
        raise UserError("the grown BiLSTM must keep num_words and max_len")
    k = big.d_hidden // small.d_hidden
    embed_follows = small.d_embed == 0
    if not embed_follows and big.d_embed != small.d_embed:
        raise UserError(f"d_embed {big.d_embed} differs from the small model's {small.d_embed}")
    p = jax.tree.map(np.asarray, params)
    out = {"tok_embed": np.tile(p["tok_embed"], (1, k)) if embed_follows else p["tok_embed"]}
    for i in range(small.num_layers):
        layer = {}
        for direction in ("forward_rnn", "backward_rnn"):
            cell = p[f"bilstm_{i}"][direction]["cell"]
            new = {}
            for g in _GATES:
                if i == 0:  # reads the embedding
                    w_in = _tile_in(cell[f"i{g}"]["kernel"], k) if embed_follows else cell[f"i{g}"]["kernel"]
                else:  # reads [forward h, backward h] of the layer below
                    w_in = _tile_in(cell[f"i{g}"]["kernel"], k, halves=2)
                new[f"i{g}"] = {"kernel": _tile_out(w_in, k)}
                new[f"h{g}"] = {"kernel": _tile_out(_tile_in(cell[f"h{g}"]["kernel"], k), k),
                                "bias": _tile_out(cell[f"h{g}"]["bias"], k)}
            layer[direction] = {"cell": new}
        out[f"bilstm_{i}"] = layer
    out["head"] = {"kernel": _tile_in(p["head"]["kernel"], k, halves=2), "bias": p["head"]["bias"]}
    dtype = p["tok_embed"].dtype
    return jax.tree.map(lambda x: x.astype(dtype), out)
