"""Flatness-seeking objectives (train.flat): SAM, label-noise SGD and the Tr(H) penalty, against hand-written
references on a tiny BERT, and one short training run per method through the CLI."""

from __future__ import annotations

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, run_cli
from jax.flatten_util import ravel_pytree

from flatlm.config import load_config
from flatlm.errors import UserError
from flatlm.models import Bert, BertConfig
from flatlm.models.losses import mlm_loss, sample_labels
from flatlm.train import flat_objectives as flat
from flatlm.train import validate_config

V, T, B = 7, 6, 8


@pytest.fixture(scope="module")
def tiny():
    cfg = BertConfig(num_words=V, max_len=T, d_model=8, num_layers=1, num_heads=1, d_ff=16, dropout=0.0,
                     attention_dropout=0.0)
    model = Bert(cfg)
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens)["params"])
    mask = jnp.zeros((B, T), bool).at[jnp.arange(B), jnp.arange(B) % T].set(True)
    batch = {"tokens": jnp.where(mask, V + 1, tokens), "targets": tokens, "weights": mask.astype(jnp.float32),
             "rng": jax.random.key(7)}
    return model.apply, params, batch


_mlm_loss = jax.jit(mlm_loss, static_argnums=2)  # the references' loss, compiled whole (op by op: ~30 ms an op)


def _jit_obj(obj):
    """jit(obj) with the apply function static: one program, not ~20 eager ops per call."""
    return jax.jit(obj, static_argnums=(2,))


def _jit_vg(obj):
    """jit(value_and_grad(obj)) with the apply function static (eager dispatch of these graphs is slow)."""
    return jax.jit(jax.value_and_grad(obj, has_aux=True), static_argnums=(2,))


HEAD_KEYS = ("final_ln", "head_bias", "head_dense", "head_dense_bias", "head_ln")  # the tiny BERT's head, by hand


def _without_head(tree):
    """`tree` with the tiny BERT's head parameters zeroed (the "encoder" blocks' part)."""
    return {k: jax.tree.map(jnp.zeros_like, v) if k in HEAD_KEYS else v for k, v in tree.items()}


@functools.partial(jax.jit, static_argnums=(0, 4))
def _sam_reference(apply_fn, params, batch, rho, encoder_only=False):
    g = jax.grad(mlm_loss)(params, batch, apply_fn)
    g = _without_head(g) if encoder_only else g
    norm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))
    shifted = jax.tree.map(lambda p, x: p + rho * x / norm, params, g)
    return mlm_loss(shifted, batch, apply_fn), jax.grad(mlm_loss)(shifted, batch, apply_fn)


def test_sam_gradient_is_the_gradient_at_the_ascent_point(tiny):
    apply_fn, params, batch = tiny
    obj = flat.make_objective(flat.FlatConfig(method="sam", rho=0.1))
    (loss, aux), grads = _jit_vg(obj)(params, batch, apply_fn, None)
    want_loss, want_grads = _sam_reference(apply_fn, params, {k: batch[k] for k in ("tokens", "targets", "weights")},
                                           0.1)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5) and float(aux["train/sam_sharpness"]) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, want_grads)


def test_sam_on_the_encoder_perturbs_only_the_encoder(tiny):
    """blocks="encoder": the ascent step is the batch gradient's non-head part, normalised over it; every parameter
    (the head's too) gets the gradient at that point."""
    apply_fn, params, batch = tiny
    obj = flat.make_objective(flat.FlatConfig(method="sam", rho=0.1, blocks="encoder"))
    (loss, _), grads = _jit_vg(obj)(params, batch, apply_fn, None)
    data = {k: batch[k] for k in ("tokens", "targets", "weights")}
    want_loss, want_grads = _sam_reference(apply_fn, params, data, 0.1, True)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert float(loss) != pytest.approx(float(_sam_reference(apply_fn, params, data, 0.1)[0]), rel=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, want_grads)


def test_sam_with_one_ascent_group_per_sentence_averages_per_sentence_sam(tiny):
    apply_fn, params, batch = tiny
    obj = flat.make_objective(flat.FlatConfig(method="sam", rho=0.1, ascent_groups=B))
    loss, _ = jax.jit(obj, static_argnums=(2,))(params, batch, apply_fn, None)
    per = [_sam_reference(apply_fn, params, {k: batch[k][i:i + 1] for k in ("tokens", "targets", "weights")},
                          0.1)[0] for i in range(B)]
    assert float(loss) == pytest.approx(float(np.mean(per)), rel=1e-5)


def test_sam_groups_weight_their_predictions_and_draw_their_own_dropout(tiny):
    """Audit regressions. (1) Groups with 2, 0, 1, 3 predictions: the objective is the prediction-weighted mean of
    the groups' SAM losses (it was their plain mean, so as rho -> 0 it was not the batch's MLM loss); the logged
    MLM loss is the batch's. (2) With dropout every group draws its own mask: identical sentences, one per group,
    give the mean of their losses under split keys (one shared key dropped the same units in every group)."""
    apply_fn, params, batch = tiny
    rows = {k: batch[k][:4] for k in ("tokens", "targets", "weights")}
    w = np.zeros((4, T), np.float32)
    w[0, :2] = w[2, 3] = w[3, 1:4] = 1.0
    rows = {**rows, "weights": jnp.asarray(w), "tokens": jnp.where(w > 0, V + 1, rows["targets"])}
    obj = flat.make_objective(flat.FlatConfig(method="sam", rho=0.1, ascent_groups=4))
    loss, aux = jax.jit(obj, static_argnums=(2,))(params, rows, apply_fn, None)
    per = [float(_sam_reference(apply_fn, params, {k: v[i:i + 1] for k, v in rows.items()}, 0.1)[0]) if w[i].sum()
           else 0.0 for i in range(4)]
    assert float(loss) == pytest.approx(np.dot(w.sum(1), per) / w.sum(), rel=1e-5)
    assert float(aux["train/mlm_loss"]) == pytest.approx(float(_mlm_loss(params, rows, apply_fn)), rel=1e-6)

    cfg = BertConfig(num_words=V, max_len=T, d_model=8, num_layers=1, num_heads=1, d_ff=16, dropout=0.3,
                     attention_dropout=0.0)
    model = Bert(cfg)
    same = {k: jnp.repeat(batch[k][:1], 4, axis=0) for k in ("tokens", "targets", "weights")}
    key = jax.random.key(5)
    _, aux = jax.jit(obj, static_argnums=(2,))(params, same, model.apply, key)
    want = np.mean([float(_mlm_loss(params, {k: v[:1] for k, v in same.items()}, model.apply, k))
                    for k in jax.random.split(key, 4)])
    assert float(aux["train/mlm_loss"]) == pytest.approx(want, rel=1e-5)
    assert want != pytest.approx(float(_mlm_loss(params, {k: v[:1] for k, v in same.items()}, model.apply, key)),
                                 rel=1e-3)  # the shared key's value, what the old code logged


def test_label_noise_redraws_the_chosen_fraction_of_targets(tiny):
    apply_fn, params, batch = tiny
    clean = _mlm_loss(params, batch, apply_fn)
    none = _jit_obj(flat.make_objective(flat.FlatConfig(method="label_noise", noise_p=0.0)))
    assert float(none(params, batch, apply_fn, None)[0]) == pytest.approx(float(clean), rel=1e-6)
    k_pick, k_draw = jax.random.split(batch["rng"])
    for source in ("uniform", "model"):
        obj = _jit_obj(flat.make_objective(flat.FlatConfig(method="label_noise", noise_p=1.0, noise_source=source)))
        if source == "uniform":
            drawn = jax.random.randint(k_draw, batch["targets"].shape, 0, V)
        else:
            drawn = sample_labels(k_draw, apply_fn({"params": params}, batch["tokens"]))  # its law: test_fisher.py
        want = _mlm_loss(params, {**batch, "targets": drawn}, apply_fn)
        loss, aux = obj(params, batch, apply_fn, None)
        assert float(loss) == pytest.approx(float(want), rel=1e-5) and float(aux["train/noisy_fraction"]) == 1.0
    # with `positions` (the head at the predicted positions only) the model's draws are the same labels as above;
    # two positions per row, the second one unpredicted, whose draw must not count
    order = np.argsort(~np.asarray(batch["weights"] > 0), axis=1, kind="stable")[:, :2]
    at = {**batch, "positions": jnp.asarray(order, jnp.int32)}
    for p in (0.5, 1.0):
        obj = _jit_obj(flat.make_objective(flat.FlatConfig(method="label_noise", noise_p=p, noise_source="model")))
        got, want = obj(params, at, apply_fn, None)[0], obj(params, batch, apply_fn, None)[0]
        assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert float(got) != pytest.approx(float(clean), rel=1e-3)  # the draws moved the loss: the check has teeth


@pytest.mark.slow
def test_trace_penalty_estimates_the_exact_trace(tiny):
    apply_fn, params, batch = tiny
    flat_p, unravel = ravel_pytree(params)
    hessian = np.asarray(jax.hessian(lambda v: mlm_loss(unravel(v), batch, apply_fn))(flat_p))
    # layer 0's MLP block by hand: its weights and its LayerNorm (the penalty's "layer_0/mlp")
    mask = {**jax.tree.map(jnp.zeros_like, params),
            "layer_0": {k: jax.tree.map(lambda x, on=k in ("mlp", "mlp_ln"): jnp.full_like(x, on), v)
                        for k, v in params["layer_0"].items()}}
    in_block = np.asarray(ravel_pytree(mask)[0]).astype(bool)
    assert 0 < in_block.sum() < in_block.size
    penalty = jax.jit(flat.hutchinson_penalty, static_argnames=("apply_fn", "probes", "blocks"))
    for blocks, exact in (("all", float(np.trace(hessian))), ("layer_0/mlp", float(np.diag(hessian)[in_block].sum()))):
        samples = np.array([float(penalty(params, batch, apply_fn, jax.random.key(s), 64, blocks))
                            for s in range(8)])
        assert abs(samples.mean() - exact) < 4 * samples.std(ddof=1) / np.sqrt(len(samples)) + 1e-3 * abs(exact)


@pytest.mark.slow
def test_trace_penalty_adds_gamma_times_the_estimate(tiny):
    apply_fn, params, batch = tiny
    obj = flat.make_objective(flat.FlatConfig(method="trace_penalty", gamma=0.5, probes=4))
    (loss, aux), grads = _jit_vg(obj)(params, batch, apply_fn, None)
    assert float(loss) == pytest.approx(float(_mlm_loss(params, batch, apply_fn) + 0.5 * aux["train/trace_estimate"]),
                                        rel=1e-5)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(grads))


def test_bad_flat_configs_are_one_line_errors(tiny):
    for bad in (dict(method="adam"), dict(rho=0.0), dict(noise_p=1.5), dict(noise_source="x"),
                dict(ascent_groups=3), dict(method="label_noise", blocks="encoder"), dict(method="sam", blocks=""),
                dict(method="sam", blocks="all,head"), dict(method="none", blocks="head")):
        with pytest.raises(UserError):
            flat.validate(flat.FlatConfig(**bad), batch_size=64)
    flat.validate(flat.FlatConfig(method="trace_penalty", blocks="embed, layer_0/attn"), batch_size=64)
    config = load_config(f"{REPO}/configs/hmm_mlm.py:tiny")
    config.train.flat.update(method="sam", blocks="layer_0/attn")
    validate_config(config)
    config.model.update(kind="bert", num_layers=2)
    config.train.update(steps=200)
    validate_config(config)
    config.train.stacking.stages = ((1, 100), (2, 100))
    with pytest.raises(UserError, match="train.stacking adds stage by stage"):
        validate_config(config)
    config.train.flat.blocks = "encoder"
    validate_config(config)
    apply_fn, params, batch = tiny
    words = "'layer_7/mlp', not a block of this model; its blocks: head, layer_0/attn, layer_0/mlp, embed"
    with pytest.raises(UserError, match=words):
        flat.make_objective(flat.FlatConfig(method="sam", blocks="embed,layer_7/mlp"))(params, batch, apply_fn, None)


def test_training_with_sam_logs_its_sharpness(tmp_path):
    """The loop picks train.flat's objective: a short SAM run logs the perturbed loss and its sharpness."""
    out = run_cli("train", "--config", f"{REPO}/configs/hmm_mlm.py:tiny", "--quiet", "--config.train.steps=4",
                  "--config.train.log_every=2", "--config.train.eval_every=4", "--config.checkpoint.every=4",
                  "--config.train.flat.method=sam", "--workdir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("train/sam_sharpness", -1) > 0 for r in rows)


def test_an_unknown_block_is_refused_before_anything_is_written(tmp_path, capsys):
    from flatlm.cli.main import main

    code = main(["train", "--config", f"{REPO}/configs/hmm_mlm.py:tiny", "--quiet", "--config.train.steps=4",
                 "--config.train.flat.method=sam", "--config.train.flat.blocks=embed,layer_9/attn",
                 "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "'layer_9/attn', not a block of this model; its blocks: " in err[0]
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sam", "label_noise", "trace_penalty", "trace_penalty:encoder"])
def test_training_with_each_method_runs_and_resumes_the_same(tmp_path, method):
    """20 steps straight vs 10 + 10 resumed: the same final metrics (randomness keyed by step)."""
    method, _, blocks = method.partition(":")
    args = ["train", "--config", f"{REPO}/configs/hmm_mlm.py:tiny", "--quiet", "--config.train.steps=20",
            "--config.train.eval_every=10", "--config.checkpoint.every=10", f"--config.train.flat.method={method}",
            f"--config.train.flat.blocks={blocks or 'all'}"]
    straight = run_cli(*args, "--workdir", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr[-2000:]
    first = run_cli(*args, "--workdir", str(tmp_path / "b"), env={"FLATLM_DEBUG_SIGKILL_AT_STEP": "11"})
    assert first.returncode != 0
    resumed = run_cli(*args, "--workdir", str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    last = lambda rs: [r for r in rs if r["step"] == 20 and "train/loss" in r][-1]["train/loss"]
    assert last(rows) == pytest.approx(last(rows_b), rel=1e-6)


@pytest.mark.parametrize("at_positions,fractional", [(False, False), (True, False), (False, True)],
                         ids=["head-everywhere", "head-at-positions", "fractional-weights"])
def test_fisher_penalty_estimates_the_exact_model_fisher_trace(tiny, at_positions, fractional):
    """E[penalty] = (1/n) sum_i w_i sum_y p(y | x_i) ||grad log p(y | x_i)||^2 over the masked positions (full
    Jacobian), n = sum_i w_i: the Fisher trace of the weighted mean loss; with the head over every position and (as
    training batches have it) at `positions` only: two unselected positions padded in, so the draws there must not
    count. Fractional weights (audit regression: the signs were scaled by w, which estimates sum w_i^2 F_i / n)."""
    apply_fn, params, batch = tiny
    if fractional:
        batch = {**batch, "weights": batch["weights"] * jnp.where(jnp.arange(B) == 0, 1.0, 0.25)[:, None]}
    if at_positions:
        order = np.argsort(~np.asarray(batch["weights"] > 0), axis=1, kind="stable")[:, :3]
        batch = {**batch, "positions": jnp.asarray(order, jnp.int32)}
    rows, cols = jnp.nonzero(batch["weights"])

    def logp(p):
        return jax.nn.log_softmax(apply_fn({"params": p}, batch["tokens"])[rows, cols])  # [n, V]

    @jax.jit  # one program (op by op: ~200 tiny ones)
    def exact_fisher(p):
        jac, probs = jax.jacrev(logp)(p), jnp.exp(logp(p))
        sq = sum(jnp.sum(g.reshape(*probs.shape, -1) ** 2, -1) for g in jax.tree.leaves(jac))
        w_n = batch["weights"][rows, cols]
        return jnp.sum(w_n[:, None] * probs * sq) / w_n.sum()

    exact = float(exact_fisher(params))
    penalty = jax.jit(flat.fisher_penalty, static_argnames=("apply_fn", "probes"))
    samples = np.array([float(penalty(params, batch, apply_fn, jax.random.key(s), 16)) for s in range(24)])
    assert abs(samples.mean() - exact) < 4 * samples.std(ddof=1) / np.sqrt(len(samples)), (samples.mean(), exact)
    assert samples.min() >= 0  # a sum of squares: the penalty cannot reward curvature of either sign


def _fisher_reference(params, apply_fn, tokens, key, w, probes, encoder_only, **run):
    """The Fisher penalty written out: mean over probes of ||grad sum_i eps_i log p(y_i | x_i)||^2 / n with the
    library's draws (labels from the forward's own logits with the first half of `key`, one sign vector per probe
    from the second); `run`: the apply function's keywords (positions, dropout)."""
    k_y, k_eps = jax.random.split(key)

    def one(k):  # one probe; mapped over the probes' keys (lax.map: one probe's program compiled, not `probes`)
        eps = jax.random.rademacher(k, w.shape, jnp.float32) * jnp.sqrt(w)

        def signed(q):
            logp = jax.nn.log_softmax(apply_fn({"params": q}, tokens, **run), axis=-1)
            y = sample_labels(k_y, jax.lax.stop_gradient(logp))
            return jnp.sum(eps * jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0])

        g = jax.grad(signed)(params)
        g = _without_head(g) if encoder_only else g
        return sum(jnp.sum(x * x) for x in jax.tree.leaves(g)) / w.sum()

    return jnp.mean(jax.lax.map(one, jax.random.split(k_eps, probes)))


# head everywhere: in make test through the penalty-on-the-loss test below (blocks "all", with dropout)
@pytest.mark.parametrize("at_positions", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["head-everywhere", "head-at-positions"])
def test_fisher_penalty_gradient_equals_reverse_over_reverse(tiny, at_positions):
    """The penalty's custom VJP (2 H_s g / n by one linearisation) against jax.grad of the plain formula, written
    out here with the same draws (labels from the forward's own logits, one sign vector per probe); with the head
    over every position (all blocks) and at `positions` only (the encoder's blocks: the head left out of the norm)."""
    apply_fn, params, batch = tiny
    key, probes, w, kw = jax.random.key(5), 2, batch["weights"], {}
    if at_positions:
        kw = {"positions_BP": jnp.asarray(np.argsort(~np.asarray(w > 0), axis=1, kind="stable")[:, :2], jnp.int32)}
        batch = {**batch, "positions": kw["positions_BP"]}
        w = jnp.take_along_axis(w, kw["positions_BP"], axis=1)

    def reference(p, encoder_only):
        return _fisher_reference(p, apply_fn, batch["tokens"], key, w, probes, encoder_only, **kw)

    for blocks in ("encoder",) if at_positions else ("all",):  # each of positions and the mask once: 2 compiles
        penalty = functools.partial(flat.fisher_penalty, batch=batch, apply_fn=apply_fn, key=key, probes=probes,
                                    blocks=blocks)
        value, grad = jax.jit(jax.value_and_grad(penalty))(params)
        want_value, want_grad = jax.jit(jax.value_and_grad(reference), static_argnums=1)(params, blocks == "encoder")
        assert float(value) == pytest.approx(float(want_value), rel=1e-5)
        got, want = ravel_pytree(grad)[0], ravel_pytree(want_grad)[0]
        assert float(jnp.abs(want).max()) > 0
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(jnp.abs(want).max()))
        if blocks == "encoder":  # the head's part is left out of the norm, and the head still gets a gradient
            assert float(value) < 0.9 * float(jax.jit(reference, static_argnums=1)(params, False))
            assert float(jnp.abs(ravel_pytree({k: grad[k] for k in HEAD_KEYS})[0]).max()) > 0


def _dropout_bert():
    """The tiny fixture's shapes with dropout 0.3 (so that a dropout key changes the forward pass)."""
    cfg = BertConfig(num_words=V, max_len=T, d_model=8, num_layers=1, num_heads=1, d_ff=16, dropout=0.3,
                     attention_dropout=0.3)
    model = Bert(cfg)
    return model.apply, nn.unbox(model.init(jax.random.key(3), jnp.zeros((B, T), jnp.int32))["params"])


@pytest.mark.parametrize("case", ["dropout-head-everywhere", "no-dropout-head-at-positions"])
def test_penalty_on_the_loss_forward_equals_autodiff_of_the_formula(tiny, case):
    """The trace penalty's shared pass (`fisher_penalized_loss`: the loss's backward inside the first probe's
    tangent pass) against jax.grad of L + gamma * mean_k ||grad signed_k||^2 / n written out with the same draws and
    the same dropout mask (reverse-over-reverse), 2 and 6 probes (the shared one and the others apart). With a
    dropout key and score_forward="loss"; without one (no dropout) the default takes the shared pass too."""
    apply_fn, params, batch = tiny
    dropout_key, kw, w, blocks = None, {}, batch["weights"], "all"
    if case.startswith("dropout"):
        apply_fn, params = _dropout_bert()
        dropout_key = jax.random.key(11)
    else:
        kw = {"positions_BP": jnp.asarray(np.argsort(~np.asarray(w > 0), axis=1, kind="stable")[:, :2], jnp.int32)}
        batch = {**batch, "positions": kw["positions_BP"]}
        w, blocks = jnp.take_along_axis(w, kw["positions_BP"], axis=1), "encoder"
    gamma, probes = 0.7, 2 if dropout_key is not None else 6  # 6: the probes after the shared one mapped (lax.map)
    run = dict(deterministic=dropout_key is None, rngs={} if dropout_key is None else {"dropout": dropout_key}, **kw)

    def reference(p):
        penalty = _fisher_reference(p, apply_fn, batch["tokens"], batch["rng"], w, probes, blocks == "encoder", **run)
        return mlm_loss(p, batch, apply_fn, dropout_key) + gamma * penalty

    cfg = flat.FlatConfig(method="trace_penalty", gamma=gamma, probes=probes, blocks=blocks,
                          score_forward="loss" if dropout_key is not None else "clean")
    (value, aux), grad = _jit_vg(flat.make_objective(cfg))(params, batch, apply_fn, dropout_key)
    want_value, want_grad = jax.jit(jax.value_and_grad(reference))(params)
    assert float(value) == pytest.approx(float(want_value), rel=1e-5)
    assert float(aux["train/mlm_loss"]) == pytest.approx(float(_mlm_loss(params, batch, apply_fn, dropout_key)),
                                                         rel=1e-6)
    got, want = ravel_pytree(grad)[0], ravel_pytree(want_grad)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(jnp.abs(want).max()))
    if dropout_key is not None:  # the clean score (the default) is another objective: the test can tell them apart
        clean = flat.make_objective(flat.FlatConfig(method="trace_penalty", gamma=gamma, probes=probes))
        other = ravel_pytree(_jit_vg(clean)(params, batch, apply_fn, dropout_key)[1])[0]
        assert float(jnp.abs(other - want).max()) > 100 * 1e-5 * float(jnp.abs(want).max())


def test_score_forward_is_checked(tiny):
    with pytest.raises(UserError, match="train.flat.score_forward"):
        flat.validate(flat.FlatConfig(method="trace_penalty", score_forward="dropout"), batch_size=64)
