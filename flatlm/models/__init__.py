"""MLM models. They know nothing about optimizers, checkpoints or meshes beyond logical axis names."""

from __future__ import annotations

import jax.numpy as jnp

from flatlm.models.bert import TABLE3, Bert, BertConfig
from flatlm.models.lstm import BiLSTM, LSTMConfig

__all__ = ["TABLE3", "Bert", "BertConfig", "BiLSTM", "LSTMConfig", "make_model", "model_config", "logits_at"]


def model_config(model, num_words: int, max_len: int) -> BertConfig | LSTMConfig:
    """The model dataclass for a config's `model` section."""
    if model.kind == "bert":
        layers, d = TABLE3[model.shape] if model.shape else (model.num_layers, model.d_model)
        return BertConfig(
            num_words=num_words, max_len=max_len, d_model=d, num_layers=layers, num_heads=model.num_heads,
            d_ff=model.d_ff, ln_mode=model.ln_mode, dropout=model.dropout,
            attention_dropout=model.attention_dropout, gelu_approximate=model.gelu_approximate,
            dtype=model.dtype, param_dtype=model.param_dtype,
        )
    if model.kind == "lstm":
        return LSTMConfig(
            num_words=num_words, max_len=max_len, d_hidden=model.d_hidden, num_layers=model.num_layers,
            dropout=model.dropout, dtype=model.dtype, param_dtype=model.param_dtype,
        )
    raise ValueError(f"unknown model kind {model.kind!r}")


def make_model(cfg: BertConfig | LSTMConfig):
    return Bert(cfg) if isinstance(cfg, BertConfig) else BiLSTM(cfg)


def logits_at(model, params, tokens_NT, positions_N):
    """MLM logits [N, V] at one position per sequence (the Bert head runs only there)."""
    rows = jnp.arange(tokens_NT.shape[0])
    if isinstance(model, Bert):
        h_NTD = model.apply({"params": params}, tokens_NT, method=Bert.features)
        h_N1D = h_NTD[rows, positions_N][:, None, :]
        return model.apply({"params": params}, h_N1D, method=Bert.logits)[:, 0]
    return model.apply({"params": params}, tokens_NT)[rows, positions_N]
