"""Linear probe: learns linear labels, stays at chance on random ones, seeds are independent of vmap."""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flatlm.evaluate import cache, features, probe
from flatlm.evaluate.probe import ProbeConfig
from flatlm.models import Bert, BertConfig

FAST = ProbeConfig(epochs=15, batch_size=128, num_seeds=2)


def _linear_data(seed, n, num_classes=4, dim=32, noise=0.5):
    rng = np.random.default_rng(seed)
    y_N = rng.integers(0, num_classes, n)
    x_NF = rng.normal(size=(num_classes, dim))[y_N] + noise * rng.normal(size=(n, dim))
    return x_NF.astype(np.float32), y_N


def _splits(x_NF, y_N, n_train):
    return {"train": x_NF[:n_train], "test": x_NF[n_train:]}, {"train": y_N[:n_train], "test": y_N[n_train:]}


def test_probe_reaches_100_percent_on_linearly_encoded_labels():
    feats, labels = _splits(*_linear_data(0, 2000), 1500)
    out = probe.run_probe(feats, labels, FAST, progress=False)
    json.dumps(out)  # JSON-able
    assert out["num_classes"] == 4 and out["feature_dim"] == 32
    assert len(out["accuracy"]["test"]["per_seed"]) == 2
    assert out["accuracy"]["train"]["mean"] >= 0.99
    assert out["accuracy"]["test"]["mean"] >= 0.99


def test_probe_is_at_chance_on_random_labels():
    rng = np.random.default_rng(1)
    n_train, n_test, C = 1000, 2000, 4
    x_NF = rng.normal(size=(n_train + n_test, 32)).astype(np.float32)
    y_N = rng.integers(0, C, n_train + n_test)
    out = probe.run_probe(*_splits(x_NF, y_N, n_train), FAST, progress=False)
    # chance 1/C; the std of a test accuracy is sqrt(p(1-p)/n) ~ 0.0097: allow 5 of them
    assert abs(out["accuracy"]["test"]["mean"] - 1 / C) < 5 * np.sqrt(0.25 * 0.75 / n_test)


def test_gaussian_projection_is_deterministic_per_seed():
    a = features.gaussian_projection(64, 16, seed=3)
    np.testing.assert_array_equal(a, features.gaussian_projection(64, 16, seed=3))
    assert a.shape == (64, 16)
    assert not np.allclose(a, features.gaussian_projection(64, 16, seed=4))
    assert abs(float(jnp.mean(jnp.sum(a * a, axis=1))) - 1.0) < 0.3  # rows have unit norm on average


def test_seeds_give_different_heads():
    x_NF, y_N = _linear_data(2, 600)
    heads, loss_SE = probe.fit_heads(x_NF, y_N, FAST, num_classes=4, progress=False)
    assert heads.w_SFC.shape == (2, 32, 4) and loss_SE.shape == (2, FAST.epochs)
    assert not np.allclose(heads.w_SFC[0], heads.w_SFC[1])


def test_vmapped_seeds_equal_separate_runs():
    """Seed s gives the same head and accuracy whether it trains alone or vmapped beside others."""
    x_NF, y_N = _linear_data(3, 700, noise=1.5)
    cfg = ProbeConfig(epochs=4, batch_size=64, num_seeds=3, seed=7, dropout=0.1)  # tail batch: 700 % 64 != 0
    together, loss_together = probe.fit_heads(x_NF, y_N, cfg, num_classes=4, progress=False)
    acc_together = probe.head_accuracy(together, x_NF, y_N)
    for i, seed in enumerate(cfg.seeds):
        alone, loss_alone = probe.fit_heads(x_NF, y_N, cfg, num_classes=4, seeds=[seed], progress=False)
        np.testing.assert_allclose(alone.w_SFC[0], together.w_SFC[i], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(alone.b_SC[0], together.b_SC[i], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(loss_alone[0], loss_together[i], rtol=1e-5)
        assert probe.head_accuracy(alone, x_NF, y_N)[0] == acc_together[i]


@pytest.fixture(scope="module")
def tiny_bert():
    T = 6
    model = Bert(BertConfig(num_words=10, max_len=T + 1, d_model=16, num_layers=1, num_heads=2))
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, T), jnp.int32))["params"])
    return model, params, T


def test_extract_features_concatenates_all_positions(tiny_bert):
    model, params, T = tiny_bert
    tokens_NT = np.random.default_rng(0).integers(0, 10, (11, T)).astype(np.int32)
    x_NF = features.extract_features(model.apply, params, tokens_NT, batch_size=4, progress=False)  # 11 = 4 + 4 + 3
    h_NTD = jax.jit(model.apply, static_argnames="method")({"params": params}, tokens_NT, method="features")
    np.testing.assert_allclose(x_NF, np.asarray(h_NTD).reshape(11, T * 16), rtol=1e-5, atol=1e-5)
    x_NP = features.extract_features(model.apply, params, tokens_NT, batch_size=4, projection_dim=8,
                                     projection_seed=1, progress=False)
    np.testing.assert_allclose(x_NP, x_NF @ np.asarray(features.gaussian_projection(T * 16, 8, 1)),
                               rtol=1e-4, atol=1e-4)


def test_cached_features_roundtrip(tiny_bert, tmp_path, monkeypatch):
    model, params, T = tiny_bert
    tokens_NT = np.random.default_rng(1).integers(0, 10, (9, T)).astype(np.int32)
    kw = dict(step=100, split="val", batch_size=4, projection_dim=8, progress=False)
    first = cache.cached_features(str(tmp_path), model.apply, params, tokens_NT, **kw)
    path = cache.feature_cache_path(str(tmp_path), 100, "val", 8, 0)
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # no temporary file left behind

    calls = []
    real = features.extract_features
    monkeypatch.setattr(features, "extract_features", lambda *a, **k: calls.append(1) or real(*a, **k))
    np.testing.assert_array_equal(cache.cached_features(str(tmp_path), model.apply, params, tokens_NT, **kw), first)
    assert calls == []  # served from the cache
    cache.cached_features(str(tmp_path), model.apply, params, tokens_NT[:5], **kw)
    assert calls == [1]  # other tokens under the same key: recomputed


def test_probe_checkpoint_leaves_params_untouched(tiny_bert, tmp_path):
    model, params, T = tiny_bert
    rng = np.random.default_rng(2)
    tokens = {s: rng.integers(0, 10, (n, T)).astype(np.int32) for s, n in (("train", 64), ("val", 32))}
    labels = {s: t[:, 0] % 2 for s, t in tokens.items()}
    before = jax.tree.map(np.array, params)
    out = probe.probe_checkpoint(model.apply, params, tokens, labels,
                                 ProbeConfig(epochs=2, num_seeds=2, projection_dim=8), step=5,
                                 cache_dir=str(tmp_path), progress=False)
    json.dumps(out)
    assert set(out["accuracy"]) == {"train", "val"} and out["step"] == 5
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, params))
