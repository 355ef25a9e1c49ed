"""Tiny models and MLM batches shared by the flatness tests (float64 where exactness is checked)."""

from __future__ import annotations

import contextlib
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flatlm.languages.base import special_ids
from flatlm.models import bert as bert_module
from flatlm.models import losses as losses_module
from flatlm.models.bert import Bert, BertConfig
from flatlm.models.lstm import BiLSTM, LSTMConfig

V, T = 5, 4


def tiny_bert_config(dtype: str = "float64", **kw) -> BertConfig:
    base = dict(num_words=V, max_len=T, d_model=8, num_layers=1, num_heads=2, dropout=0.0, attention_dropout=0.0,
                dtype=dtype, param_dtype=dtype)
    base.update(kw)
    return BertConfig(**base)


def tiny_lstm_config(dtype: str = "float64") -> LSTMConfig:
    return LSTMConfig(num_words=V, max_len=T, d_hidden=4, num_layers=1, dropout=0.0, dtype=dtype, param_dtype=dtype)


def init(model: nn.Module, seed: int = 0, scale: float = 1.0):
    """Parameters as a plain dict; `scale` multiplies the weights so curvature is not tiny."""
    tokens = jnp.zeros((1, model.cfg.max_len), jnp.int32)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(seed), tokens)["params"])
    if scale == 1.0:
        return params
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x if "scale" in jax.tree_util.keystr(path) else x * scale, params)


def mlm_batch(seed: int, batch_size: int = 3, max_per_row: int = 2, num_words: int = V, length: int = T):
    """A random MLM batch: 1..max_per_row masked positions per row (mask id), one padded tail in row 0."""
    rng = np.random.default_rng(seed)
    ids = special_ids(num_words)
    targets = rng.integers(0, num_words, size=(batch_size, length))
    tokens = targets.copy()
    weights = np.zeros((batch_size, length), np.float32)
    targets[0, -1] = tokens[0, -1] = ids.pad
    for b in range(batch_size):
        valid = length - 1 if b == 0 else length
        pos = rng.choice(valid, size=rng.integers(1, max_per_row + 1), replace=False)
        weights[b, pos] = 1.0
        tokens[b, pos] = ids.mask
    return {"tokens": jnp.asarray(tokens, jnp.int32), "targets": jnp.asarray(targets, jnp.int32),
            "weights": jnp.asarray(weights)}


def tiny_bert(seed: int = 0, dtype: str = "float64", scale: float = 5.0, **kw):
    model = Bert(tiny_bert_config(dtype, **kw))
    return model, init(model, seed, scale)


def tiny_lstm(seed: int = 0, dtype: str = "float64", scale: float = 5.0):
    model = BiLSTM(tiny_lstm_config(dtype))
    return model, init(model, seed, scale)


@contextlib.contextmanager
def float64_everywhere():
    """Run flatlm's model and loss code in full float64 inside this context (x64 on).

    bert.py's attention softmax and losses.py's cross-entropy cast to `jnp.float32`, which caps float64 checks at
    ~1e-8 relative; here those modules see a `jnp` whose float32 is float64. Harmless once they promote instead.
    """
    proxy = types.SimpleNamespace(**{n: getattr(jnp, n) for n in dir(jnp) if not n.startswith("__")})
    proxy.float32 = jnp.float64
    saved = bert_module.jnp, losses_module.jnp
    bert_module.jnp = losses_module.jnp = proxy
    try:
        with jax.enable_x64(True):
            yield
    finally:
        bert_module.jnp, losses_module.jnp = saved


@contextlib.contextmanager
def fast_compile():
    """Compile with most XLA optimisations off (about half the compile time; these tests are compile-bound). Goes
    further than the suite's own flags (tests/conftest.py: LLVM -O0 and no expensive passes instead of -O1) and
    still pays on top of them: test_hessian.py + test_fisher.py 26 s with it, 37 s without (2026-11-27)."""
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", old)
