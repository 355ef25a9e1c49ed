"""MLM models. They know nothing about optimizers, checkpoints or meshes beyond logical axis names."""

from __future__ import annotations

from flatlm.config import check_choice, check_positive
from flatlm.errors import UserError
from flatlm.models.bert import SHAPES, TABLE3, TABLE4, Bert, BertConfig
from flatlm.models.lstm import BiLSTM, LSTMConfig

__all__ = ["SHAPES", "TABLE3", "TABLE4", "Bert", "BertConfig", "BiLSTM", "LSTMConfig", "make_model", "model_config",
           "validate_config", "bert_dims", "depth"]

KINDS = ("bert", "lstm")
DTYPES = ("float32", "bfloat16", "float16", "float64")


def bert_dims(model) -> tuple[int, int]:
    """(d_model, heads) of a config's `model` section (a Table 3/4 `shape` overrides d_model; 0 heads: d / 64)."""
    d = SHAPES[model.shape][1] if model.shape else model.d_model
    return d, model.num_heads or max(1, d // 64)


def depth(model) -> int:
    """Number of layers of a config's `model` section (a Table 3/4 `shape` overrides num_layers)."""
    return SHAPES[model.shape][0] if model.kind == "bert" and model.shape else model.num_layers


def validate_config(model) -> None:
    """Check a config's `model` section; one line naming `model.<field>` on failure."""
    check_choice(model.kind, KINDS, "model.kind")
    check_choice(model.ln_mode, ("pre", "post"), "model.ln_mode")
    check_choice(model.dtype, DTYPES, "model.dtype")
    check_choice(model.param_dtype, DTYPES, "model.param_dtype")
    check_positive(model, "model", "num_layers", *(("d_model",) if model.kind == "bert" else ("d_hidden",)))
    for field in ("num_heads", "d_ff"):
        if model[field] < 0:
            raise UserError(f"config.model.{field} must be >= 0 (0: the default), got {model[field]}")
    if not 0 <= model.dropout < 1 or not 0 <= model.attention_dropout < 1:
        raise UserError("config.model.dropout and attention_dropout must be in [0, 1)")
    if model.shape and model.shape not in SHAPES:
        raise UserError(f"config.model.shape={model.shape!r} is unknown; choose a Table 3/4 shape: {', '.join(SHAPES)}")
    if model.kind == "bert":
        d, heads = bert_dims(model)
        if d % heads:
            raise UserError(f"config.model.d_model={d} is not divisible by num_heads={heads}")


def model_config(model, num_words: int, max_len: int) -> BertConfig | LSTMConfig:
    """The model dataclass for a config's `model` section."""
    if model.kind == "bert":
        layers, d = SHAPES[model.shape] if model.shape else (model.num_layers, model.d_model)
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
    """The Flax module for a model dataclass (Bert or BiLSTM)."""
    return Bert(cfg) if isinstance(cfg, BertConfig) else BiLSTM(cfg)
