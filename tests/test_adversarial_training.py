"""Adversarial meta-objective in training: a tiny adversarial run against a plain one at the same exact loss, the
step under data-parallel sharding, and the objective through `flatlm train`'s loop (warm start, monitor, resume,
PCFG downstream batches). The objective's pieces are checked in test_adversarial.py."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO, with_xla_defaults
from test_adversarial import _tiny_bert, _tiny_hmm

from flatlm.data.masking import mask_batch
from flatlm.evaluate.exact_loss import exact_loss
from flatlm.train import adversarial as adv
from flatlm.train.step import mlm_objective, train_step

# ------------------------------------------------------------------------------------------ the adversary works


def _effect_run(d_model: int, warm: int, steps: int, lam: float, ridge: float, seed: int = 0):
    """Plain MLM for `warm` steps, then `steps` more of plain MLM and, from the same state and on the same MLM
    batches, `steps` of the adversarial objective (task k4, D1/D2 of 64, capped squared loss). Returns the
    language, the model and {"plain": params, "adversarial": params}."""
    lang = _tiny_hmm()
    k, n_down, batch = 4, 64, 64
    model, params = _tiny_bert(d_model=d_model, words=lang.vocab_size, length=lang.max_length)
    opt = optax.adamw(3e-3, b1=0.9, b2=0.98, eps=1e-6, weight_decay=0.01)
    cfg = adv.AdversarialConfig(lam=lam, ridge=ridge, d1_size=n_down, d2_size=n_down, task=f"k{k}",
                                num_classes=lang.num_states, seed=seed)
    jit_step = lambda objective: jax.jit(functools.partial(
        train_step, apply_fn=model.apply, optimizer=opt, seed=seed, objective=objective, dropout=False))
    rng = np.random.default_rng(seed)

    def mlm_batches(n, offset):
        for i in range(n):
            corpus = lang.sample(batch, seed=1_000_000 * (seed + 1) + offset + i)
            yield mask_batch(corpus.tokens, corpus.lengths, lang.vocab_size, rng)

    plain = jit_step(mlm_objective)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt.init(params)}
    for b in mlm_batches(warm, 0):
        state, _ = plain(state, b)
    phase2 = list(mlm_batches(steps, warm))
    out = {}
    for name in ("plain", "adversarial"):
        step = plain if name == "plain" else jit_step(adv.make_objective(cfg))
        down = adv.downstream_iterator(cfg, lang, start=warm)
        s = state
        for b in phase2:
            s, _ = step(s, {**b, **next(down)} if name == "adversarial" else b)
        out[name] = s["params"]
    return lang, model, out


def _d2_style_accuracy(lang, model, params_by_name, k=4, n=64, pairs=32, seed=12345):
    """Mean accuracy of a closed-form head (ridge 1.0, global normalisation) fitted on held-out D1-sized batches
    and scored on held-out D2-sized batches (a seed that no training batch uses)."""
    it = adv.downstream_batches(lang, k, n, n, seed=seed)
    held = [next(it) for _ in range(pairs)]
    stack = {key: jnp.asarray(np.stack([h[key] for h in held])) for key in adv.DOWN_KEYS}

    @jax.jit
    def accuracy(params):
        def one(b):
            x1 = adv.probe_features(model.apply, params, b["down1_tokens"])
            x2 = adv.probe_features(model.apply, params, b["down2_tokens"])
            pred = adv.closed_form_predict(x1, b["down1_labels"], x2, num_classes=lang.num_states, ridge=1.0)
            return jnp.mean(jnp.argmax(pred, -1) == b["down2_labels"])
        return jnp.mean(jax.vmap(one)(stack))

    return {name: float(accuracy(p)) for name, p in params_by_name.items()}


def _exact(lang, model, params_by_name, n=256):
    corpus = lang.sample(n, seed=424242)
    q = lang.conditionals(corpus.tokens, corpus.lengths)
    batches = [{"tokens": corpus.tokens, "length": corpus.lengths, "conditionals": q}]
    return {name: exact_loss(model.apply, p, batches, num_subsets=2) for name, p in params_by_name.items()}


@pytest.mark.slow  # the claim at tiny scale; make test: the C3 notebook's code, the meta-gradient tests
def test_adversarial_objective_lowers_downstream_accuracy_at_the_same_pretraining_loss(request):
    """Tiny HMM (8 states, 16 words, length 8), Bert d_model 16, task k4: 300 plain steps, then 600 steps plain
    vs adversarial (lam 10, ridge 3, capped squared loss). Asserted: the accuracy of a closed-form head on
    held-out D1/D2-style batches drops by >= 0.08 (seen 0.36 -> 0.19), and the exact pre-training loss stays
    within 0.03 nats (1.5%) of the plain run's (seen +0.009).

    The drop is a transition: the encoder learns to swamp the label-bearing directions of its features with
    label-free variance, which the ridge head (and the AdamW probe, see the slow test) then cannot use. When it
    happens depends on the seed: seeds 0 and 1 get there within 400 steps, seed 2 after ~1400, seed 3 not within
    600 (before it, the drop is ~0.02 at an unchanged loss); this test pins seed 0, the slow test runs seed 2.
    It also depends on the compiler's rounding: compiled with XLA:CPU's fusion emitters off and LLVM -O1 (the
    suite's setting, tests/conftest.py) the same seed had not reached it by step 600 (0.361 -> 0.346, 2026-11-27),
    so this test runs with XLA's default flags, as it was written. Scored every 100 steps up to 1500 (same day): with
    the defaults the drop is 0.09 at step 100 and 0.15-0.18 from step 200 on; with the suite's flags 0.013-0.020
    up to step 1300, 0.048 at 1400, 0.163 at 1500 (exact-loss gaps up to 0.022 and 0.032 nats:
    benchmarks/results/cpu-2026-11-27-c/adversarial_transition.txt).
    """
    if not with_xla_defaults(request):
        return
    lang, model, params = _effect_run(d_model=16, warm=300, steps=600, lam=10.0, ridge=3.0, seed=0)
    acc = _d2_style_accuracy(lang, model, params)
    loss = _exact(lang, model, params)
    assert acc["adversarial"] <= acc["plain"] - 0.08, (acc, loss)
    assert abs(loss["adversarial"]["loss"] - loss["plain"]["loss"]) <= 0.03, (loss, acc)
    assert loss["plain"]["kl"] < 0.05  # the plain run is near the optimum, so "same loss" means something


@pytest.mark.slow
@pytest.mark.parametrize("seed,steps,probe_drop", [(0, 600, 0.08), (2, 1500, None)], ids=["seed0", "seed2"])
def test_adversarial_objective_lowers_linear_probe_accuracy_slow(seed, steps, probe_drop, request):
    """The fast test's run scored by `flatlm.evaluate.probe` too (AdamW softmax probe on standardised features,
    2000 held-out training sentences, 2000 test sentences; seen 0.41 -> 0.27), and a late-transition seed run
    for 1500 steps (closed-form head seen 0.37 -> 0.19 at an unchanged loss). Right after its transition the
    standardised AdamW probe is not fooled yet (seen 0.41 -> 0.41), so for seed 2 only the closed-form head's
    drop is asserted. With XLA's default flags, as the fast test (its rounding decides when the transition comes)."""
    if not with_xla_defaults(request):
        return
    from flatlm.evaluate import probe
    from flatlm.evaluate.features import extract_features

    lang, model, params = _effect_run(d_model=16, warm=300, steps=steps, lam=10.0, ridge=3.0, seed=seed)
    loss = _exact(lang, model, params)
    acc = _d2_style_accuracy(lang, model, params)
    assert acc["adversarial"] <= acc["plain"] - 0.08, (acc, loss)
    assert abs(loss["adversarial"]["loss"] - loss["plain"]["loss"]) <= 0.03, (loss, acc)
    if probe_drop is None:
        return
    train, test = lang.sample(2000, seed=777), lang.sample(2000, seed=778)
    labels = {"train": train.latents["states"][:, 4], "test": test.latents["states"][:, 4]}
    probe_acc = {}
    for name, p in params.items():
        feats = {split: extract_features(model.apply, p, c.tokens, progress=False)
                 for split, c in (("train", train), ("test", test))}
        out = probe.run_probe(feats, labels, probe.ProbeConfig(epochs=30, num_seeds=2), num_classes=8,
                              progress=False)
        probe_acc[name] = out["accuracy"]["test"]["mean"]
    assert probe_acc["adversarial"] <= probe_acc["plain"] - probe_drop, (probe_acc, loss)


@pytest.mark.slow  # a fresh interpreter with 2 simulated devices: ~45 s of CPU, most of it import and compile
def test_adversarial_step_under_data_parallel_sharding():
    """Two simulated CPU devices: the jitted adversarial train step with the batch (MLM and D1/D2) sharded over
    the data axis gives the parameters and metrics of the unsharded step."""
    from conftest import run_python

    run_python("""
        import functools
        import numpy as np, jax, jax.numpy as jnp, optax, flax.linen as nn
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from flatlm.data.masking import mask_batch
        from flatlm.models import Bert, BertConfig
        from flatlm.train import adversarial as adv
        from flatlm.train.step import train_step
        assert jax.device_count() == 2
        model = Bert(BertConfig(num_words=6, max_len=5, d_model=8, num_layers=1, num_heads=2, dropout=0.0,
                                attention_dropout=0.0))
        params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((2, 4), jnp.int32))["params"])
        opt = optax.sgd(0.1)  # params differ by lr * grad differences (Adam's first step would amplify noise)
        cfg = adv.AdversarialConfig(lam=1.0, d1_size=8, d2_size=8, num_classes=3)
        step = functools.partial(train_step, apply_fn=model.apply, optimizer=opt, seed=0,
                                 objective=adv.make_objective(cfg), dropout=False)
        rng = np.random.default_rng(0)
        batch = mask_batch(rng.integers(0, 6, (8, 4)), np.full(8, 4), 6, rng)
        batch.update(down1_tokens=rng.integers(0, 6, (8, 4)).astype(np.int32),
                     down1_labels=rng.integers(0, 3, 8).astype(np.int32),
                     down2_tokens=rng.integers(0, 6, (8, 4)).astype(np.int32),
                     down2_labels=rng.integers(0, 3, 8).astype(np.int32))
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt.init(params)}
        ref, ref_m = jax.jit(step)(state, batch)
        mesh = Mesh(np.asarray(jax.devices()).reshape(2, 1), ("data", "model"))
        rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        sharded = jax.device_put(batch, data)
        assert len(sharded["down1_tokens"].addressable_shards) == 2
        out, m = jax.jit(step, in_shardings=(rep, data), out_shardings=(rep, rep))(state, sharded)
        diff = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), ref["params"],
                                                out["params"])))
        assert diff < 1e-6, diff
        assert abs(float(m["train/adv_d2_loss"]) - float(ref_m["train/adv_d2_loss"])) < 1e-5
        print("ok", diff)
    """, devices=2)


# ------------------------------------------------------------------------------------------ through the loop


def _loop_config(tmp_path, *overrides):
    from flatlm.config import apply_overrides, load_config

    c = load_config(str(REPO / "configs" / "hmm_mlm.py") + ":tiny")
    return apply_overrides(c, ["--config.train.steps=20", "--config.train.eval_every=10", "--config.train.log_every=5",
                               "--config.checkpoint.every=5", "--config.checkpoint.keep=10",
                               f"--config.data.data_dir={tmp_path / 'data'}", *overrides])


def _final_params(workdir, step=20):
    from flatlm.run import load_run

    return load_run(str(workdir)).load_params(step)


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a),
                                                                                      jax.tree.leaves(b)))


@pytest.mark.slow  # 42-59 s on 2 cores: make test-all (make test stays under 10 min)
def test_training_loop_warm_start_monitor_and_resume(tmp_path):
    """`flatlm train` with train.adversarial from the config: lam = 0 with monitor gives the plain run's parameters
    (1e-7) and logs the head's D2 metrics; lam > 0 with start_step 10 equals the plain run up to step 10, differs
    after it, logs D2 metrics only after it, and a run resumed from a checkpoint in the warm phase (step 5) or in
    the adversarial phase (step 15) ends with exactly the parameters of the uninterrupted run."""
    import shutil

    from flatlm.train.loop import train_and_evaluate

    adv_overrides = ["--config.train.adversarial.lam=1.0", "--config.train.adversarial.d1_size=16",
                     "--config.train.adversarial.d2_size=16", "--config.train.adversarial.start_step=10"]
    runs = {"plain": [], "monitor": ["--config.train.adversarial.monitor=True", "--config.train.adversarial.d1_size=16",
                                     "--config.train.adversarial.d2_size=16"], "adversarial": adv_overrides}
    for name, overrides in runs.items():
        train_and_evaluate(_loop_config(tmp_path, *overrides), str(tmp_path / name), progress=False)
    final = {name: _final_params(tmp_path / name) for name in runs}
    assert _max_diff(final["plain"], final["monitor"]) <= 1e-7
    assert _max_diff(_final_params(tmp_path / "plain", 10), _final_params(tmp_path / "adversarial", 10)) == 0.0
    assert _max_diff(final["plain"], final["adversarial"]) > 1e-4

    def logged(name):
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return {r["step"] for r in rows if "train/adv_d2_loss" in r}

    assert logged("monitor") == {5, 10, 15, 20} and logged("adversarial") == {15, 20} and not logged("plain")
    for resume_from in (5, 15):
        resumed = tmp_path / f"resumed{resume_from}"
        shutil.copytree(tmp_path / "adversarial", resumed)
        for ckpt_dir in (resumed / "checkpoints").iterdir():
            if ckpt_dir.name.isdigit() and int(ckpt_dir.name) > resume_from:
                shutil.rmtree(ckpt_dir)
        train_and_evaluate(_loop_config(tmp_path, *adv_overrides), str(resumed), progress=False)
        assert _max_diff(final["adversarial"], _final_params(resumed)) == 0.0, resume_from


def test_training_loop_on_the_pcfg_draws_d1_d2_from_the_task_split(tmp_path):
    """PCFG (a small grammar from the config): D1/D2 come from task A's training split (built on the fly), the
    adversarial steps after start_step log the head's D2 metrics and change the parameters."""
    from flatlm.config import apply_overrides, load_config
    from flatlm.train.loop import train_and_evaluate

    c = apply_overrides(load_config(str(REPO / "configs" / "pcfg_mlm.py") + ":tiny"), [
        "--config.language.grammar.levels=3", "--config.language.grammar.num_words=50",
        "--config.language.max_length=12", "--config.data.train_size=256", "--config.data.eval_size=32",
        "--config.data.batch_size=16", "--config.model.d_model=32", "--config.train.steps=6",
        "--config.train.eval_every=6", "--config.train.log_every=1", "--config.checkpoint.every=3",
        "--config.eval.task_train_size=64", "--config.eval.task_eval_size=16", "--config.eval.tasks=('A',)",
        f"--config.data.data_dir={tmp_path / 'data'}", "--config.train.adversarial.d1_size=16",
        "--config.train.adversarial.d2_size=16", "--config.train.adversarial.start_step=3"])
    for name, lam in (("plain", 0.0), ("adversarial", 1.0)):
        c.train.adversarial.lam = lam
        train_and_evaluate(c, str(tmp_path / name), progress=False)
    rows = [json.loads(x) for x in (tmp_path / "adversarial" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in rows if "train/adv_d2_acc" in r}
    assert sorted(logged) == [4, 5, 6] and all(0 <= r["train/adv_d2_acc"] <= 1 for r in logged.values())
    assert _max_diff(_final_params(tmp_path / "plain", 3), _final_params(tmp_path / "adversarial", 3)) == 0.0
    assert _max_diff(_final_params(tmp_path / "plain", 6), _final_params(tmp_path / "adversarial", 6)) > 1e-5
