"""Function-preserving width growth of the BiLSTM (flatlm.flatness.grow_lstm) and the flatness runner on it."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flatlm.errors import UserError
from flatlm.flatness import grow_lstm
from flatlm.flatness.fisher import fisher_trace
from flatlm.models import BiLSTM, LSTMConfig
from flatlm.models.losses import mlm_loss


def _model(d: int, layers: int = 2, d_embed: int = 0):
    cfg = LSTMConfig(num_words=7, max_len=6, d_hidden=d, num_layers=layers, d_embed=d_embed, dropout=0.0)
    return cfg, BiLSTM(cfg)


@pytest.mark.parametrize("k,d_embed", [(2, 0), pytest.param(3, 0, marks=pytest.mark.slow),
                                       pytest.param(2, 5, marks=pytest.mark.slow)])
def test_grown_bilstm_computes_the_same_logits(k, d_embed):
    small_cfg, small = _model(4, d_embed=d_embed)
    tokens = jax.random.randint(jax.random.key(1), (5, 6), 0, 10)
    tokens = tokens.at[0, 4:].set(7)  # a padded sentence (pad = V)
    # every step compiled whole: op by op, the BiLSTM's forward compiled ~130 tiny programs
    params = nn.unbox(jax.jit(small.init)(jax.random.key(0), tokens)["params"])
    params = jax.jit(lambda p: jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(2), x.shape), p))(
        params)  # not at init
    big_cfg = grow_lstm.grown_lstm_config(small_cfg, 4 * k)
    grown = grow_lstm.embed_lstm(params, small_cfg, big_cfg)
    want = jax.jit(small.apply)({"params": params}, tokens)
    got = jax.jit(BiLSTM(big_cfg).apply)({"params": grown}, tokens)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    big_shapes = jax.tree.map(lambda x: x.shape, nn.unbox(jax.eval_shape(BiLSTM(big_cfg).init, jax.random.key(0),
                                                                         tokens)["params"]))
    assert jax.tree.map(lambda x: x.shape, grown) == big_shapes


def test_depth_and_non_multiple_widths_are_refused():
    cfg, _ = _model(4)
    params = nn.unbox(BiLSTM(cfg).init(jax.random.key(0), jnp.zeros((1, 6), jnp.int32))["params"])
    with pytest.raises(UserError, match="depth cannot grow"):
        grow_lstm.embed_lstm(params, cfg, grow_lstm.grown_lstm_config(cfg, 8, num_layers=3))
    with pytest.raises(UserError, match="not a multiple"):
        grow_lstm.embed_lstm(params, cfg, grow_lstm.grown_lstm_config(cfg, 6))


@pytest.mark.slow
def test_flatness_of_a_grown_bilstm_is_finite_and_its_loss_unchanged():
    """The Fisher trace works on the BiLSTM and its grown view; the grown view has the same MLM loss."""
    cfg, small = _model(4, layers=1)
    tokens = jax.random.randint(jax.random.key(3), (8, 6), 0, 7)
    params = nn.unbox(small.init(jax.random.key(0), tokens)["params"])
    big_cfg = grow_lstm.grown_lstm_config(cfg, 8)
    grown = grow_lstm.embed_lstm(params, cfg, big_cfg)
    mask = jnp.zeros((8, 6), bool).at[:, 2].set(True)
    batch = {"tokens": jnp.where(mask, 8, tokens), "targets": tokens, "weights": mask.astype(jnp.float32)}
    loss = lambda model, p: mlm_loss(p, batch, model.apply)
    assert float(loss(BiLSTM(big_cfg), grown)) == pytest.approx(float(loss(small, params)), abs=1e-5)
    for model, p in ((small, params), (BiLSTM(big_cfg), grown)):
        est = fisher_trace(model.apply, p, [batch], jax.random.key(0), num_draws=4)
        assert np.isfinite(est.mean) and est.mean > 0
