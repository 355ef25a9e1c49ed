"""BERT/LSTM MLM models: shapes, tied head over V words, padding invariance, pre/post-LN, Table 3 shapes."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flatlm.models import TABLE3, TABLE4, Bert, BertConfig, BiLSTM, LSTMConfig

V, T = 11, 7


def _init(model, tokens):
    return nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens)["params"])


@functools.cache  # equal models share one jitted apply
def _apply(model):
    """`model.apply` as compiled programs: op by op, one test compiled hundreds of tiny ones (~30 ms each)."""
    return jax.jit(model.apply, static_argnames=("method", "deterministic", "num_layers"))


@pytest.mark.parametrize("ln_mode", ["pre", "post"])
def test_bert_shapes_and_padding_invariance(ln_mode):
    cfg = BertConfig(num_words=V, max_len=T, d_model=64, num_layers=2, ln_mode=ln_mode)
    model = Bert(cfg)
    tokens = jnp.array([[1, 2, 3, 12, 4, V, V], [5, 6, 7, 8, 9, 10, 0]], jnp.int32)  # 12 = mask id
    params = _init(model, tokens)
    logits = _apply(model)({"params": params}, tokens)
    assert logits.shape == (2, T, V)  # words only
    h = _apply(model)({"params": params}, tokens, method=Bert.features)
    assert h.shape == (2, T, 64)
    # padded keys are ignored: changing the padding length does not change real positions (row 0 has 5 words; the
    # old check compared two inputs equal to `tokens` and could not fail)
    np.testing.assert_allclose(_apply(model)({"params": params}, tokens[:, :5])[0], logits[0, :5], atol=1e-6)
    # ...while a real word there would: the check can fail
    assert np.abs(_apply(model)({"params": params}, tokens.at[0, 5].set(7))[0, :5] - logits[0, :5]).max() > 1e-4
    # attention: a real token's change does reach other positions
    changed = tokens.at[0, 0].set(9)
    assert np.abs(_apply(model)({"params": params}, changed)[0, 2] - logits[0, 2]).max() > 1e-4


def test_bert_head_is_tied_to_input_embeddings():
    cfg = BertConfig(num_words=V, max_len=T, d_model=64, num_layers=1, dropout=0.0)
    model = Bert(cfg)
    tokens = jnp.zeros((1, T), jnp.int32)
    params = _init(model, tokens)
    assert params["tok_embed"].shape == (V + 3, 64)  # words + pad, mask, cls
    assert "head_bias" in params and params["head_bias"].shape == (V,)
    grads = jax.grad(lambda p: _apply(model)({"params": p}, tokens)[0, 0, 3])(params)
    assert np.abs(grads["tok_embed"][3]).sum() > 0  # output row 3 uses input embedding row 3
    h = _apply(model)({"params": params}, tokens, method=Bert.features)
    z = jax.nn.gelu(h @ params["head_dense"] + params["head_dense_bias"], approximate=True)
    mu, var = z.mean(-1, keepdims=True), z.var(-1, keepdims=True)
    z = (z - mu) / jnp.sqrt(var + cfg.ln_eps) * params["head_ln"]["norm"]["scale"] + params["head_ln"]["norm"]["bias"]
    manual = z @ params["tok_embed"][:V].T + params["head_bias"]
    np.testing.assert_allclose(_apply(model)({"params": params}, tokens), manual, atol=1e-5)


def test_table3_and_table4_are_the_papers():
    # A.3 Table 3 and B.3 Table 4 as printed: d-model / n-head / #layers (d-inter 4 d-model; see TABLE4's comment)
    table3 = [(64, 1, 1), (128, 2, 4), (192, 3, 5), (256, 4, 6), (512, 8, 8), (768, 12, 12), (1024, 16, 16),
              (1280, 20, 20), (1536, 24, 24)]
    table4 = [(128, 2, 4), (192, 3, 5), (320, 5, 6), (384, 6, 7), (640, 10, 12), (960, 15, 16), (1920, 30, 20)]
    for table, rows in ((TABLE3, table3), (TABLE4, table4)):
        assert len(table) == len(rows)
        for name, (d, heads, layers) in zip(table, rows, strict=True):
            cfg = BertConfig.from_shape(name, num_words=200, max_len=33)
            assert (cfg.d_model, cfg.heads, cfg.num_layers) == (d, heads, layers)
            assert cfg.head_dim == 64 and cfg.ff == 4 * d and name == f"L{layers}-H{d}"
    assert [4 * d for d, _, _ in table3] == [256, 512, 768, 1024, 2048, 3072, 4096, 5120, 6144]
    shapes = jax.eval_shape(
        lambda: Bert(BertConfig.from_shape("L6-H256", num_words=200, max_len=33)).init(
            jax.random.key(0), jnp.zeros((1, 33), jnp.int32)))
    n = sum(x.size for x in jax.tree.leaves(nn.unbox(shapes)))
    d, L = 256, 6
    expected = (203 + 33) * d + L * (12 * d * d + 13 * d) + (d * d + d) + 2 * d + 2 * d + 200
    assert n == expected


def test_dropout_changes_output_only_in_training():
    cfg = BertConfig(num_words=V, max_len=T, d_model=64, num_layers=1, dropout=0.5)
    model = Bert(cfg)
    tokens = jnp.ones((2, T), jnp.int32)
    params = _init(model, tokens)
    a = _apply(model)({"params": params}, tokens)
    b = _apply(model)({"params": params}, tokens, deterministic=False, rngs={"dropout": jax.random.key(1)})
    assert np.abs(a - b).max() > 1e-3
    np.testing.assert_array_equal(a, _apply(model)({"params": params}, tokens))


def test_lstm_is_bidirectional_and_respects_lengths():
    cfg = LSTMConfig(num_words=V, max_len=T, d_hidden=16, num_layers=2, dropout=0.0)
    model = BiLSTM(cfg)
    tokens = jnp.array([[1, 2, 3, 4, V, V, V]], jnp.int32)
    params = _init(model, tokens)
    out = _apply(model)({"params": params}, tokens)
    assert out.shape == (1, T, V)
    assert _apply(model)({"params": params}, tokens, method=BiLSTM.features).shape == (1, T, 32)
    # a later word changes an earlier position (backward direction) and an earlier word a later one
    later = tokens.at[0, 3].set(7)
    assert np.abs(_apply(model)({"params": params}, later)[0, 0] - out[0, 0]).max() > 1e-6
    earlier = tokens.at[0, 0].set(7)
    assert np.abs(_apply(model)({"params": params}, earlier)[0, 3] - out[0, 3]).max() > 1e-6
    # the padding does not leak into real positions: same as the unpadded sentence
    np.testing.assert_allclose(_apply(model)({"params": params}, tokens[:, :4])[0], out[0, :4], atol=1e-6)


@pytest.mark.parametrize("kind", ["bert-pre", "bert-post", "lstm"])
def test_mlm_loss_at_positions_is_the_full_head_loss(kind):
    """`mlm_loss` with `positions` (the head at the predicted positions only) gives the loss and gradient of the
    head over every position (the reference), dropout on with the same key and off."""
    from flatlm.data.masking import mask_batch
    from flatlm.models.losses import mlm_loss

    if kind == "lstm":
        model = BiLSTM(LSTMConfig(num_words=V, max_len=T, d_hidden=8, num_layers=1, dropout=0.1))
    else:
        model = Bert(BertConfig(num_words=V, max_len=T, d_model=16, num_layers=1, num_heads=2, dropout=0.1,
                                attention_dropout=0.1, ln_mode=kind[5:]))
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, T + 1, size=9)
    tokens = np.where(np.arange(T)[None] < lengths[:, None], rng.integers(0, V, (9, T)), V)
    batch = mask_batch(tokens, lengths, V, rng, masking="bert", mask_prob=0.4, max_predictions=3)
    assert batch["positions"].shape == (9, 3)
    full = {k: v for k, v in batch.items() if k != "positions"}
    params = _init(model, jnp.asarray(tokens))
    loss_and_grad = jax.jit(jax.value_and_grad(mlm_loss), static_argnums=2)
    for key in (None, jax.random.key(5)):
        (want, g_want), (got, g_got) = (loss_and_grad(params, b, model.apply, key) for b in (full, batch))
        assert float(got) == pytest.approx(float(want), rel=1e-6)
        flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])  # noqa: E731
        np.testing.assert_allclose(flat(g_got), flat(g_want), rtol=1e-5, atol=1e-7)
    # a batch whose positions miss a weighted one (built by hand) gives a non-finite loss, not a smaller sum
    assert (batch["weights"].sum(1) > 1).any()
    dropped = {**batch, "positions": batch["positions"][:, 1:]}
    assert np.isnan(float(jax.jit(mlm_loss, static_argnums=2)(params, dropped, model.apply)))


@pytest.mark.parametrize("kind", ["bert-pre", "bert-post", "lstm"])
def test_logits_at_is_the_full_forward_at_that_position(kind):
    """`logits_at` (the exact loss's path: the head at one position per copy) equals the full forward's logits
    at that position, for every position of every sequence (the reference: head at all T, then indexed)."""
    if kind == "lstm":
        model = BiLSTM(LSTMConfig(num_words=V, max_len=T, d_hidden=8, num_layers=2))
    else:
        model = Bert(BertConfig(num_words=V, max_len=T, d_model=16, num_layers=2, num_heads=2,
                                ln_mode=kind[5:]))
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, T + 1, size=5)
    tokens = jnp.asarray(np.where(np.arange(T)[None] < lengths[:, None], rng.integers(0, V, (5, T)), V))
    params = _init(model, tokens)
    want_BTV = np.asarray(_apply(model)({"params": params}, tokens))
    copies_NT, pos_N = jnp.repeat(tokens, T, axis=0), jnp.tile(jnp.arange(T), 5)
    got_NV = np.asarray(_apply(model)({"params": params}, copies_NT, pos_N, method="logits_at"))
    assert got_NV.shape == (5 * T, V)
    np.testing.assert_allclose(got_NV, want_BTV.reshape(5 * T, V), rtol=1e-5, atol=1e-6)
    # a shifted position picks a different row: the test can tell positions apart
    assert np.abs(got_NV[1] - want_BTV[0, 0]).max() > 1e-4


@pytest.mark.parametrize("kind", ["bert-pre", "bert-post", "lstm"])
def test_features_of_an_inner_layer_are_those_of_the_model_cut_there(kind):
    """`features(num_layers=1)` of a 2-layer model (the probe of an inner layer, eval.probe.layers) equals the
    features of a separately built 1-layer model holding the same embeddings and first layer; the pre-LN model's
    final LN is not applied to the cut stream (it belongs to the last layer); num_layers=2 is the full model."""
    if kind == "lstm":
        make = lambda n: BiLSTM(LSTMConfig(num_words=V, max_len=T, d_hidden=8, num_layers=n))  # noqa: E731
    else:
        make = lambda n: Bert(BertConfig(num_words=V, max_len=T, d_model=16, num_layers=n, num_heads=2,  # noqa: E731
                                         ln_mode=kind[5:], dropout=0.0, attention_dropout=0.0))
    rng = np.random.default_rng(2)
    lengths = rng.integers(2, T + 1, size=4)
    tokens = jnp.asarray(np.where(np.arange(T)[None] < lengths[:, None], rng.integers(0, V, (4, T)), V))
    params = _init(make(2), tokens)
    params = jax.jit(lambda p: jax.tree.map(
        lambda x: x + 0.1 * jax.random.normal(jax.random.key(3), x.shape, x.dtype), p))(params)
    got = np.asarray(_apply(make(2))({"params": params}, tokens, method="features", num_layers=1))
    second = "bilstm_1" if kind == "lstm" else "layer_1"
    cut = {k: v for k, v in params.items() if k != second}
    if kind == "bert-pre":  # the reference: a 1-layer model whose final LN is the identity
        cut["final_ln"] = jax.tree_util.tree_map_with_path(
            lambda path, x: jnp.ones_like(x) if path[-1].key == "scale" else jnp.zeros_like(x), cut["final_ln"])
    want = np.asarray(_apply(make(1))({"params": cut}, tokens, method="features"))
    if kind == "bert-pre":  # LN with unit scale still normalises: undo by comparing normalised streams
        norm = lambda h: (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-12)  # noqa: E731
        got = norm(got)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    full = _apply(make(2))({"params": params}, tokens, method="features")
    np.testing.assert_array_equal(_apply(make(2))({"params": params}, tokens, method="features", num_layers=2), full)
    assert np.abs(np.asarray(full) - np.asarray(_apply(make(2))({"params": params}, tokens, method="features",
                                                              num_layers=1))).max() > 1e-3
    with pytest.raises(ValueError, match="layers 1..2"):
        make(2).apply({"params": params}, tokens, method="features", num_layers=3)
