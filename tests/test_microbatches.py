"""Gradient accumulation (`train.microbatches`, flatlm.train.step.accumulated_grad): the whole batch's loss,
gradient and aux metrics from slices of it, less memory, and a training run that equals the unsplit one."""

from __future__ import annotations

import functools
import json
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, run_cli

from flatlm.config import base_config
from flatlm.data.masking import mask_batch
from flatlm.models import Bert, model_config
from flatlm.train import optim
from flatlm.train.step import accumulated_grad, microbatch, mlm_objective, train_step

V, T, B = 30, 12, 32


@pytest.fixture(scope="module")
def setup():
    c = base_config()
    c.model.update(d_model=32, num_layers=2, dropout=0.0, attention_dropout=0.0)
    model = Bert(model_config(c.model, V, T))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, (B, T))
    batch = mask_batch(tokens, rng.integers(3, T + 1, B), V, rng, masking="bert")
    batch["weights"][3::8] = 0.0  # one slice of 8 (rows 3, 11, 19, 27) predicts nothing
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((2, T), jnp.int32))["params"])
    return model, params, jax.tree.map(jnp.asarray, batch)


def test_microbatch_slices_are_strided_rows():
    x = jnp.arange(12).reshape(6, 2)
    np.testing.assert_array_equal(microbatch(x, 3), [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]])
    with pytest.raises(ValueError, match="does not split into 4"):
        microbatch(x, 4)


@pytest.mark.parametrize("k", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_accumulated_gradient_is_the_whole_batchs(setup, k):
    """Slices hold different numbers of masked tokens (one none): the loss and gradient must still be the whole
    batch's weighted mean, not the mean of the slices' means."""
    model, params, batch = setup
    counts = [float(batch["weights"][m::k].sum()) for m in range(k)]
    assert len(set(counts)) > 1 and (k != 8 or 0.0 in counts), counts
    (loss1, _), g1 = jax.jit(lambda p, b: jax.value_and_grad(mlm_objective, has_aux=True)(p, b, model.apply, None))(
        params, batch)
    (loss_k, _), g_k = jax.jit(lambda p, b: accumulated_grad(mlm_objective, k)(p, b, model.apply, None))(params, batch)
    grad = jax.jit(jax.grad(lambda p, b: mlm_objective(p, b, model.apply, None)[0]))
    slice_grads = [grad(params, {name: x[m::k] for name, x in batch.items()}) for m in range(k)]
    naive = jax.tree.map(lambda *g: sum(g) / k, *slice_grads)  # equal weights (optax.MultiSteps): not the batch's
    assert max(float(jnp.abs(a - b).max() / jnp.abs(b).max())
               for a, b in zip(jax.tree.leaves(naive), jax.tree.leaves(g1))) > 0.01
    assert float(loss_k) == pytest.approx(float(loss1), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g_k), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)


def test_aux_metrics_are_token_weighted_means_and_slices_draw_their_own_randomness(setup):
    """aux = the whole batch's weighted mean of the targets; each slice reads fold_in(rng, m) and fold_in(key, m)."""
    model, params, batch = setup
    seen = []

    def objective(p, b, apply_fn, key):
        w = b["weights"]
        aux = {"mean_target": jnp.sum(w * b["targets"]) / jnp.maximum(jnp.sum(w), 1.0),
               "rng": jax.random.uniform(b["rng"]), "key": jax.random.uniform(key)}
        seen.append(b["tokens"].shape)
        return mlm_objective(p, b, apply_fn, None)[0], aux

    rng, key = jax.random.key(1), jax.random.key(2)
    (_, aux), _ = accumulated_grad(objective, 4)(params, {**batch, "rng": rng}, model.apply, key)
    w = np.asarray(batch["weights"])
    assert float(aux["mean_target"]) == pytest.approx(float((w * batch["targets"]).sum() / w.sum()), rel=1e-6)
    counts = np.array([w[m::4].sum() for m in range(4)])
    for name, base in (("rng", rng), ("key", key)):
        draws = np.array([float(jax.random.uniform(jax.random.fold_in(base, m))) for m in range(4)])
        assert float(aux[name]) == pytest.approx(float((counts * draws).sum() / counts.sum()), rel=1e-5)
    assert (B // 4, T) in seen  # the objective saw slices of 8 rows


def test_train_steps_with_and_without_microbatches_agree(setup):
    """Three SGD steps (whose updates are linear in the gradient, unlike Adam's first step) from the same state."""
    model, params, batch = setup
    c = base_config()
    c.train.update(optimizer="sgd", lr=0.5, warmup_frac=0.0, schedule="constant", weight_decay=0.0)
    opt = optim.optimizer(c.train)
    finals = {}
    for k in (1, 4):
        step = jax.jit(functools.partial(train_step, apply_fn=model.apply, optimizer=opt, seed=0, dropout=False,
                                         microbatches=k))
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt.init(params)}
        for _ in range(3):
            state, metrics = step(state, batch)
        finals[k] = (state, metrics)
    (s1, m1), (s4, m4) = finals[1], finals[4]
    assert float(m4["train/loss"]) == pytest.approx(float(m1["train/loss"]), rel=1e-5)
    assert float(m4["train/grad_norm"]) == pytest.approx(float(m1["train/grad_norm"]), rel=1e-4)
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(params)))
    assert moved > 1e-3
    for a, b in zip(jax.tree.leaves(s4["params"]), jax.tree.leaves(s1["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_microbatches_cut_the_steps_temporary_memory(setup):
    """XLA's buffer assignment of the compiled step (a compile statistic, not a timing): 4 slices of 64 rows need
    well under half the temporaries of one batch of 256."""
    model, params, _ = setup
    rng = np.random.default_rng(1)
    big = mask_batch(rng.integers(0, V, (256, T)), np.full(256, T), V, rng, masking="bert")
    opt = optim.optimizer(base_config().train)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt.init(params)}
    temp = {}
    for k in (1, 4):
        step = jax.jit(functools.partial(train_step, apply_fn=model.apply, optimizer=opt, seed=0, microbatches=k))
        temp[k] = step.lower(state, big).compile().memory_analysis().temp_size_in_bytes
    assert temp[4] < 0.5 * temp[1], temp


@pytest.mark.slow  # make test: test_train_steps_with_and_without_microbatches_agree
def test_a_run_with_microbatches_logs_the_unsplit_runs_losses(tmp_path):
    """`flatlm train` end to end (tiny HMM, dropout off, SGD): the same training losses with 1 and 4 slices."""
    tiny = str(REPO / "configs" / "hmm_mlm.py") + ":tiny"
    common = ["--config.model.dropout=0.0", "--config.model.attention_dropout=0.0", "--config.train.steps=6",
              "--config.train.log_every=1", "--config.train.eval_every=6", "--config.checkpoint.every=6",
              "--config.train.optimizer=sgd", "--config.train.lr=0.1", "--quiet"]
    losses = {}
    for k in (1, 4):
        wd = tmp_path / f"k{k}"
        proc = run_cli("train", "--config", tiny, "--workdir", str(wd), f"--config.train.microbatches={k}", *common)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
        losses[k] = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses[1]) == 6
    np.testing.assert_allclose(losses[4], losses[1], rtol=1e-5)


def test_label_noise_objective_accumulates(setup):
    """Label noise (`train.flat`), the other objective microbatches accept: with noise_p 0 its accumulated gradient
    is the plain batch gradient; with noise_p 1 and uniform draws the loss moves and every target is redrawn."""
    from flatlm.train.flat_objectives import FlatConfig, label_noise_objective

    model, params, batch = setup
    b = {**batch, "rng": jax.random.key(3)}
    (loss1, _), g1 = jax.jit(lambda p, x: jax.value_and_grad(mlm_objective, has_aux=True)(p, x, model.apply, None))(
        params, batch)
    quiet = label_noise_objective(FlatConfig(method="label_noise", noise_p=0.0))
    (loss_k, aux), g_k = jax.jit(lambda p, x: accumulated_grad(quiet, 4)(p, x, model.apply, None))(params, b)
    assert float(loss_k) == pytest.approx(float(loss1), rel=1e-6) and float(aux["train/noisy_fraction"]) == 0.0
    for x, y in zip(jax.tree.leaves(g_k), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-7)
    loud = label_noise_objective(FlatConfig(method="label_noise", noise_p=1.0, noise_source="uniform"))
    (loss_n, aux), _ = jax.jit(lambda p, x: accumulated_grad(loud, 4)(p, x, model.apply, None))(params, b)
    assert float(aux["train/noisy_fraction"]) == 1.0 and abs(float(loss_n) - float(loss1)) > 1e-4


# XLA's words on an H100 at batch 4096, L12-H768 (benchmarks/results/h100-2026-11-27/log_default.txt)
H100_OOM = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 51.75GiB with allocator GPU_0_bfc on device 0. "
            "[tf-allocator-allocation-error=''] [executable_name='jit_train_step']")


def test_microbatches_that_fit():
    from flatlm.train import microbatches_that_fit

    gib = 2**30
    assert microbatches_that_fit(51.75 * gib, 30 * gib, 4096, 1) == 2  # 51.75 / 2 <= 30
    assert microbatches_that_fit(51.75 * gib, 10 * gib, 4096, 1) == 8  # 6 does not divide 4096
    assert microbatches_that_fit(51.75 * gib, 10 * gib, 4096, 2) == 16  # the allocation was made at 2 slices
    assert microbatches_that_fit(51.75 * gib, 60 * gib, 4096, 1) == 2  # it failed anyway (fragmentation): more
    assert microbatches_that_fit(51.75 * gib, 1 * gib, 12, 1) is None  # 12 rows cannot be cut 52 ways


def test_the_train_step_out_of_device_memory_is_one_line_naming_the_fix(tmp_path, tiny_config, monkeypatch):
    """XLA's out-of-memory error from the step becomes a UserError (the CLI: one line, exit 2) that names
    train.microbatches, the mesh and the batch, a new workdir and this one's corpus; with the device's memory
    figures known it estimates the count. Any other runtime error is left as it is."""
    import jax

    from flatlm import errors
    from flatlm.errors import UserError
    from flatlm.train import loop

    def failing(message, when="run"):
        """A jitted step whose program raises the runtime's `message` when it runs, or when it compiles (the loop
        compiles the first step ahead, in a thread: flatlm.compile_options.compile_ahead)."""
        def raise_it(*args):
            raise jax.errors.JaxRuntimeError(message)

        class Step:
            def lower(self, *args):
                return types.SimpleNamespace(compile=raise_it if when == "compile" else lambda: None)

            def __call__(self, state, batch):
                raise_it()
        return lambda *args, **kwargs: Step()

    for when in ("run", "compile"):
        monkeypatch.setattr(loop, "jit_train_step", failing(H100_OOM, when))
        with pytest.raises(UserError) as info:
            loop.train_and_evaluate(tiny_config, str(tmp_path / when), progress=False)
        msg = str(info.value)
        assert "\n" not in msg and "Out of memory while trying to allocate 51.75GiB on device 0" in msg, msg
        assert "--config.train.microbatches=K with K > 1 dividing the 64 rows" in msg, msg  # CPU: no memory figures
        assert "new --workdir" in msg and f"--config.data.data_dir={tmp_path / when / 'data'}" in msg, msg

    class Device:
        def memory_stats(self):
            return {"bytes_limit": 20 * 2**30, "bytes_in_use": 4 * 2**30}

    monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
    from flatlm.train import out_of_memory_error

    err = out_of_memory_error(jax.errors.JaxRuntimeError(H100_OOM), tiny_config, 1, "/data")  # data axis 1
    assert "--config.train.microbatches=4 (estimated" in str(err)  # 51.75 / 16 GiB free -> 4 (3 does not divide 64)
    disk = "RESOURCE_EXHAUSTED: Out of memory? No space left on device [os_error_code='28'] jit_train_step"
    assert errors.device_out_of_memory(RuntimeError(disk)) is None
    assert out_of_memory_error(jax.errors.JaxRuntimeError("INTERNAL: boom in jit_train_step"), tiny_config, 1,
                               "/d") is None
    monkeypatch.undo()
    four = str(out_of_memory_error(jax.errors.JaxRuntimeError(H100_OOM), tiny_config, 4, "/d"))
    assert "K > 1 dividing the 16 rows" in four and "over a data axis of 4" in four, four  # a mesh: 64 / 4 rows
    monkeypatch.setattr(loop, "jit_train_step", failing("INTERNAL: something else"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        loop.train_and_evaluate(tiny_config, str(tmp_path / "b"), progress=False)
