"""Adversarial meta-objective: the closed-form head against numpy, the meta-gradient against finite differences,
lam = 0 against plain AdamW, the downstream batches, the config checks. Training with it (the effect at the same
loss, sharding, the train loop): test_adversarial_training.py."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO

from flatlm.data.masking import mask_batch
from flatlm.evaluate.features import gaussian_projection
from flatlm.languages import hmm
from flatlm.models import Bert, BertConfig
from flatlm.train import adversarial as adv
from flatlm.train.step import mlm_objective, train_step

# ------------------------------------------------------------------------------------------ closed-form head


def _np_ridge(x_NF, y_NC, rho):
    return np.linalg.solve(x_NF.T @ x_NF + rho * np.eye(x_NF.shape[1]), x_NF.T @ y_NC)


def _np_predict(x1_NF, labels1_N, x2_MF, num_classes, ridge, normalize):
    """Independent numpy reference of `closed_form_predict` (primal solve on explicit normalised features)."""
    y1_NC = np.eye(num_classes)[labels1_N]
    rho = ridge * x1_NF.shape[0]
    if normalize == "none":
        return x2_MF @ _np_ridge(x1_NF, y1_NC, rho)
    mean_F = x1_NF.mean(0)
    c1, c2 = x1_NF - mean_F, x2_MF - mean_F
    var_F = (c1**2).mean(0)
    scale = np.sqrt(var_F.mean()) if normalize == "global" else np.sqrt(var_F + adv._VAR_FLOOR * var_F.mean())
    ybar_C = y1_NC.mean(0)
    return (c2 / scale) @ _np_ridge(c1 / scale, y1_NC - ybar_C, rho) + ybar_C


@pytest.mark.parametrize("n,f", [(40, 10), (10, 40)], ids=["primal", "dual"])
def test_closed_form_head_equals_numpy_ridge(n, f):
    rng = np.random.default_rng(0)
    x1, x2 = rng.normal(size=(n, f)) * 3.0 + 1.0, rng.normal(size=(7, f)) * 3.0 + 1.0
    y = rng.normal(size=(n, 3))
    labels = rng.integers(0, 4, n)
    predict = lambda x1, lab, x2, normalize: adv.closed_form_predict(x1, lab, x2, num_classes=4, ridge=0.3,
                                                                     normalize=normalize)

    @jax.jit
    def heads(x1, y, x2, labels):
        w = adv.ridge_head(x1, y, 0.7)
        return w, adv.ridge_predict(x1, y, x2, 0.7), {m: predict(x1, labels, x2, m) for m in adv.NORMALIZATIONS}

    with jax.enable_x64(True):
        w, pred, by_mode = jax.device_get(heads(x1, y, x2, labels))
    np.testing.assert_allclose(w, _np_ridge(x1, y, 0.7), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(pred, x2 @ _np_ridge(x1, y, 0.7), rtol=1e-10, atol=1e-12)
    for normalize, got in by_mode.items():
        want = _np_predict(x1, labels, x2, 4, 0.3, normalize)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11, err_msg=normalize)
    # float32 (the training dtype) stays close to the float64 answer
    w32 = heads(*(np.asarray(a, np.float32) for a in (x1, y, x2)), labels)[0]
    assert w32.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(w32), _np_ridge(x1, y, 0.7), rtol=2e-3, atol=2e-4)


def test_head_loss_values():
    pred = np.asarray([[0.9, 0.1, 0.0], [0.2, 0.3, 0.5]], np.float32)
    labels = np.asarray([0, 1])

    @jax.jit
    def losses(pred, labels):
        return (adv.head_loss(pred, labels, "squared"),
                adv.head_loss(pred, labels, "squared", chance_C=jnp.asarray([0.5, 0.5, 0.0])),
                adv.head_loss(pred, labels, "ce", ce_scale=2.0))

    (sq, acc), (capped, _), (ce, _) = jax.device_get(losses(pred, labels))
    assert np.isclose(sq, ((0.01 + 0.01) + (0.04 + 0.49 + 0.25)) / 2)
    assert acc == 0.5
    # capped at the chance head (label frequencies [0.5, 0.5, 0]): row 0 is better than chance, row 1 worse
    assert np.isclose(capped, (0.02 + 0.5) / 2)
    logp = pred * 2 - np.log(np.exp(pred * 2).sum(1, keepdims=True))
    assert np.isclose(ce, -(logp[0, 0] + logp[1, 1]) / 2, rtol=1e-6)


# ------------------------------------------------------------------------------------------ meta-gradient

V, T = 6, 4  # tiny language for the gradient checks


def _tiny_bert(dtype="float32", d_model=8, dropout=0.0, layers=1, heads=2, words=V, length=T):
    cfg = BertConfig(num_words=words, max_len=length + 1, d_model=d_model, num_layers=layers, num_heads=heads,
                     dropout=dropout, attention_dropout=dropout, dtype=dtype, param_dtype=dtype)
    model = Bert(cfg)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((2, length), jnp.int32))["params"])
    return model, params


def _random_down_batch(rng, d1, d2, num_classes):
    return {"down1_tokens": rng.integers(0, V, (d1, T)).astype(np.int32),
            "down1_labels": rng.integers(0, num_classes, d1).astype(np.int32),
            "down2_tokens": rng.integers(0, V, (d2, T)).astype(np.int32),
            "down2_labels": rng.integers(0, num_classes, d2).astype(np.int32)}


def _unit_direction(tree, seed):
    """A random direction of unit norm shaped like `tree` (numpy: eager jax.random would compile per shape)."""
    rng = np.random.default_rng(seed)
    v = [rng.normal(size=np.shape(x)) for x in jax.tree.leaves(tree)]
    norm = np.sqrt(sum(np.sum(a**2) for a in v))
    return jax.tree.unflatten(jax.tree.structure(tree), [jnp.asarray(a / norm, jnp.result_type(x))
                                                          for a, x in zip(v, jax.tree.leaves(tree))])


def _directional(fn, x, v, eps):
    """(<grad fn(x), v> by reverse mode, the central difference along v, |grad|, grad); jit it."""
    grad = jax.grad(fn)(x)
    analytic = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grad), jax.tree.leaves(v)))
    shift = lambda s: jax.tree.map(lambda a, d: a + s * eps * d, x, v)
    return analytic, (fn(shift(1.0)) - fn(shift(-1.0))) / (2 * eps), optax.global_norm(grad), grad


# (d1, loss, normalize, projection_dim) on F = 32 features (or 16 projected); d1 < F is the kernel form.
FEATURE_CASES = [(8, "squared", "global", 0), (40, "squared", "none", 0), (8, "ce", "feature", 0),
                 (40, "ce", "global", 0), (8, "squared", "none", 16), (40, "ce", "feature", 16)]


@pytest.mark.parametrize("d1,loss,normalize,proj", FEATURE_CASES, ids=str)
def test_meta_gradient_through_the_solve_matches_finite_differences(d1, loss, normalize, proj):
    """Gradient of the D2 loss w.r.t. the D1 and D2 features (all of the head's dependence on psi), float64."""
    rng = np.random.default_rng(d1 + proj)
    d2, f = 12, 32
    labels1, labels2 = rng.integers(0, 3, d1), rng.integers(0, 3, d2)
    with jax.enable_x64(True):
        x_KF = jnp.asarray(rng.normal(size=(d1 + d2, f)) + 0.5)
        proj_FP = jnp.asarray(rng.normal(size=(f, proj)) / 4) if proj else None

        def d2_loss(x_KF):
            x = x_KF @ proj_FP if proj else x_KF
            pred = adv.closed_form_predict(x[:d1], labels1, x[d1:], num_classes=3, ridge=0.05, normalize=normalize)
            return adv.head_loss(pred, labels2, loss, ce_scale=3.0)[0]

        analytic, numeric, gnorm, grad_KF = jax.jit(_directional, static_argnums=(0, 3))(
            d2_loss, x_KF, _unit_direction(x_KF, d1), 1e-5)
        analytic, numeric, gnorm = float(analytic), float(numeric), float(gnorm)
        reaches_d1 = float(np.abs(np.asarray(grad_KF)[:d1]).max())
    assert reaches_d1 > 1e-4  # the gradient reaches D1 through the solve
    assert abs(analytic - numeric) <= 1e-7 * gnorm, (analytic, numeric)


# (d1, loss, normalize, projection_dim) through the tiny Bert: F = T * d_model = 32 (or 16 projected).
MODEL_CASES = [(8, "squared", "global", 0), (40, "ce", "feature", 16)]


@pytest.mark.parametrize("d1,loss,normalize,proj", MODEL_CASES, ids=["dual-squared", "primal-ce-projected"])
def test_meta_gradient_wrt_model_params_matches_finite_differences(d1, loss, normalize, proj):
    """The meta-gradient w.r.t. the Bert parameters: of the D2 loss alone (first case) and of the whole objective
    L_mlm - lam * l_D2 through `make_objective`, dropout off (second case).

    float64 parameters and activations; Bert's attention softmax runs in float32 whatever the dtype, which
    caps the agreement near 1e-5 relative (eps = 1e-3 balances that against the O(eps^2) truncation); the
    solve itself is checked to 1e-7 by the feature-level test above.
    """
    rng = np.random.default_rng(d1)
    with jax.enable_x64(True):
        model, params = _tiny_bert("float64")
        cfg = adv.AdversarialConfig(lam=0.5, ridge=0.05, d1_size=d1, d2_size=12, loss=loss, normalize=normalize,
                                    projection_dim=proj, num_classes=3, ce_scale=3.0, cap_at_chance=False)
        batch = mask_batch(rng.integers(0, V, (6, T)), np.full(6, T), V, rng)
        batch.update(_random_down_batch(rng, d1, 12, 3))
        objective = adv.make_objective(cfg)
        if d1 < T * 8:
            fn = lambda p: adv.downstream_terms(cfg, model.apply, p, batch)[0]
        else:
            fn = lambda p: objective(p, batch, model.apply, None)[0]
            loss, aux = jax.jit(lambda p: objective(p, batch, model.apply, None))(params)
            np.testing.assert_allclose(float(loss), float(aux["train/mlm_loss"] - 0.5 * aux["train/adv_d2_loss"]),
                                       rtol=1e-12)
        analytic, numeric, gnorm, _ = jax.jit(_directional, static_argnums=(0, 3))(
            fn, params, _unit_direction(params, d1), 1e-3)
        analytic, numeric, gnorm = float(analytic), float(numeric), float(gnorm)
    assert gnorm > 1e-2  # not trivially zero
    assert abs(analytic - numeric) <= 1e-3 * abs(numeric) + 1e-6 * gnorm, (analytic, numeric)


def test_projection_is_the_probes_matrix():
    """probe_features flattens [B, T, D] to [B, T * D] and projects with the probe's Gaussian matrix."""
    table = np.random.default_rng(0).normal(size=(V, 8)).astype(np.float32)
    embed = lambda variables, tokens, method: variables["params"][tokens]  # a stand-in apply_fn: [B, T, 8]
    tokens = np.random.default_rng(1).integers(0, V, (5, T)).astype(np.int32)
    raw, got = jax.jit(lambda p: (adv.probe_features(embed, p, tokens),
                                  adv.probe_features(embed, p, tokens, projection_dim=16, projection_seed=3)))(table)
    np.testing.assert_array_equal(np.asarray(raw), table[tokens].reshape(5, T * 8))
    want = table[tokens].reshape(5, T * 8).astype(np.float64) @ np.asarray(gaussian_projection(T * 8, 16, 3))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ lam = 0


def test_lambda_zero_reproduces_plain_adamw():
    """Several jitted train steps with dropout: lam = 0 (skipped, or monitored) == mlm_objective to 1e-7."""
    rng = np.random.default_rng(0)
    model, params = _tiny_bert(d_model=16, dropout=0.1)
    opt = optax.adamw(3e-3, b1=0.9, b2=0.98, eps=1e-6, weight_decay=0.01)
    objectives = {
        "plain": mlm_objective,
        "lam0": adv.make_objective(adv.AdversarialConfig(lam=0.0)),
        "lam0-monitor": adv.make_objective(adv.AdversarialConfig(lam=0.0, monitor=True, num_classes=3, d1_size=8,
                                                                 d2_size=8)),
    }
    batches = []
    for _ in range(4):
        b = mask_batch(rng.integers(0, V, (16, T)), np.full(16, T), V, rng)
        b.update(_random_down_batch(rng, 8, 8, 3))
        batches.append(b)
    final, metrics = {}, {}
    for name, objective in objectives.items():
        step = jax.jit(functools.partial(train_step, apply_fn=model.apply, optimizer=opt, seed=0,
                                         objective=objective, dropout=True))
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": jax.jit(opt.init)(params)}
        for b in batches:
            state, m = step(state, b)
        final[name], metrics[name] = state["params"], m
    final = jax.device_get(final)  # compared in numpy: no op-by-op compiles per leaf shape
    for name in ("lam0", "lam0-monitor"):
        diff = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), final["plain"], final[name])
        assert max(jax.tree.leaves(diff)) <= 1e-7, (name, diff)
        assert np.isclose(float(metrics[name]["train/loss"]), float(metrics["plain"]["train/loss"]), atol=1e-7)
    assert max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), jax.device_get(params),
                                            final["plain"]))) > 1e-3  # training moved
    assert "train/adv_d2_acc" in metrics["lam0-monitor"] and "train/adv_d2_acc" not in metrics["lam0"]


# ------------------------------------------------------------------------------------------ batches


def _tiny_hmm():
    return hmm.random_hmm(0, num_states=8, vocab_size=16, length=8, num_blocks=2)


def test_downstream_batches_deterministic_disjoint_resumable_and_sharded():
    lang = _tiny_hmm()
    first = lambda it, n: [next(it) for _ in range(n)]
    a = first(adv.downstream_batches(lang, 3, 6, 4, seed=7), 4)
    b = first(adv.downstream_batches(lang, 3, 6, 4, seed=7), 4)
    c = first(adv.downstream_batches(lang, 3, 6, 4, seed=8), 1)
    resumed = first(adv.downstream_batches(lang, 3, 6, 4, seed=7, start=2), 2)
    for x, y in zip(a, b):
        assert all(np.array_equal(x[k], y[k]) for k in adv.DOWN_KEYS)
    for x, y in zip(a[2:], resumed):
        assert all(np.array_equal(x[k], y[k]) for k in adv.DOWN_KEYS)
    assert not np.array_equal(a[0]["down1_tokens"], c[0]["down1_tokens"])
    assert not np.array_equal(a[0]["down1_tokens"], a[1]["down1_tokens"])
    x = a[0]
    assert x["down1_tokens"].shape == (6, 8) and x["down2_tokens"].shape == (4, 8)
    assert all(x[k].dtype == np.int32 for k in adv.DOWN_KEYS)
    # labels are the generating state at position k of exactly these sentences
    corpus = lang.sample(10, seed=adv._derived_seed(7, 0, adv._TAG_STEP))
    np.testing.assert_array_equal(np.concatenate([x["down1_tokens"], x["down2_tokens"]]), corpus.tokens)
    np.testing.assert_array_equal(np.concatenate([x["down1_labels"], x["down2_labels"]]),
                                  corpus.latents["states"][:, 3])
    # pooled: D1 and D2 are distinct rows of the pool (unique sentences here), and processes split each batch
    pool_tokens = np.arange(50 * 8, dtype=np.int32).reshape(50, 8)
    pool = first(adv.pool_batches(pool_tokens, np.arange(50) % 5, 6, 4, seed=1), 3)
    for p in pool:
        rows1, rows2 = p["down1_tokens"][:, 0] // 8, p["down2_tokens"][:, 0] // 8
        assert len(set(rows1) | set(rows2)) == 10
        np.testing.assert_array_equal(p["down1_labels"], rows1 % 5)
    halves = [first(adv.pool_batches(pool_tokens, np.arange(50) % 5, 6, 4, seed=1, process_index=i,
                                     process_count=2), 3) for i in range(2)]
    for j in range(3):
        for k in adv.DOWN_KEYS:
            np.testing.assert_array_equal(np.concatenate([halves[0][j][k], halves[1][j][k]]), pool[j][k])
    posterior = next(adv.downstream_batches(lang, 3, 6, 4, seed=7, definition="posterior", pool_size=20))
    assert posterior["down1_labels"].max() < 8
    cfg = adv.AdversarialConfig(task="k3", d1_size=6, d2_size=4, seed=7, num_classes=8)
    assert all(np.array_equal(next(adv.downstream_iterator(cfg, lang))[k], a[0][k]) for k in adv.DOWN_KEYS)
    with pytest.raises(ValueError):
        adv.downstream_batches(lang, 8, 6, 4, seed=0)
    with pytest.raises(ValueError):
        adv.pool_batches(pool_tokens[:9], np.zeros(9), 6, 4, seed=0)
    with pytest.raises(ValueError):
        adv.downstream_batches(lang, 3, 5, 4, seed=0, process_count=2)


def test_config_validation():
    for bad in (dict(loss="hinge"), dict(normalize="pca"), dict(lam=-1.0), dict(ridge=0.0),
                dict(pool_size=10), dict(label_definition="map"), dict(start_step=-1)):
        with pytest.raises(ValueError):
            adv.validate(adv.AdversarialConfig(**bad))
    with pytest.raises(ValueError, match="num_classes"):
        adv.make_objective(adv.AdversarialConfig(lam=1.0, num_classes=0))
    assert adv.AdversarialConfig(task="k10").position == 10
    assert adv.AdversarialConfig(task="task-10").position == 9  # the paper's task-10: the 10th variable, 1-based
    with pytest.raises(ValueError):
        adv.task_position("A")


@pytest.mark.parametrize("override,match", [
    ("loss=hinge", "train.adversarial.loss"), ("normalize=pca", "train.adversarial.normalize"),
    ("ridge=0.0", "ridge must be positive"), ("d1_size=0", "d1_size must be positive"),
    ("pool_size=10", "pool_size=10 is smaller"), ("start_step=60", "start_step=60 must be in"),
    ("d2_size=7", "d2_size=7 is not divisible by the data axis"),
])
def test_config_errors_name_the_field_and_the_fix(override, match):
    from flatlm.config import apply_overrides, load_config
    from flatlm.errors import UserError
    from flatlm.train.loop import validate

    c = apply_overrides(load_config(str(REPO / "configs" / "hmm_mlm.py") + ":tiny"),
                        ["--config.train.adversarial.lam=1.0", f"--config.train.adversarial.{override}"])
    with pytest.raises(UserError, match=match):
        validate(c, num_devices=2)
