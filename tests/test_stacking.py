"""Gradual stacking (`train.stacking`, flatlm.models.stacking / flatlm.train.stacking): each growth rule against a
hand-built expectation on a 2-layer model (parameters and optimizer state), function-preserving growth keeps the
MLM loss, stage arithmetic, config validation, and an interrupted stacked run resumes bit for bit."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import REPO

from flatlm.config import apply_overrides, base_config, load_config
from flatlm.errors import UserError
from flatlm.models import stacking
from flatlm.models.bert import Bert, BertConfig
from flatlm.models.losses import mlm_loss
from flatlm.train import optim, validate_config
from flatlm.train.stacking import grow_state

TINY = str(REPO / "configs" / "hmm_mlm.py") + ":tiny"


def _cfg(ln_mode="pre", layers=2) -> BertConfig:
    return BertConfig(num_words=11, max_len=7, d_model=8, num_heads=2, d_ff=16, num_layers=layers, ln_mode=ln_mode,
                      dropout=0.0, attention_dropout=0.0)


def _distinct(tree, seed):
    """Every leaf replaced by distinct random values (LayerNorms away from (1, 0), like a trained model's)."""
    rng = np.random.default_rng(seed)  # numpy: jax.random would compile once per leaf shape (seconds)
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x) + 0.3 * rng.standard_normal(x.shape), x.dtype), tree)


def _params(cfg, seed=0):
    """Random parameters of the model's layout (abstract init: no model code runs), LayerNorm scales around 1."""
    shapes = nn.unbox(jax.eval_shape(Bert(cfg).init, jax.random.key(seed), jnp.zeros((2, 6), jnp.int32))["params"])
    ones = jax.tree_util.tree_map_with_path(
        lambda path, x: np.full(x.shape, float(str(path[-1].key) == "scale"), x.dtype), shapes)
    return _distinct(ones, seed + 1)


def _same(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)) and \
        jax.tree.structure(a) == jax.tree.structure(b)


def test_layer_sources_by_hand():
    src = stacking.layer_sources
    assert src("midas", 2, 3) == (0, 0, 1)  # k = 2 blocks of 1: the first (ceil(2/2)) is the middle, copy after it
    assert src("top", 2, 3) == (0, 1, 1)
    assert src("function_preserving", 2, 3) == (0, 1, None)
    assert src("midas", 3, 4) == (0, 1, 1, 2)
    assert src("midas", 2, 4) == src("top", 2, 4) == (0, 1, 0, 1)
    assert src("midas", 3, 5) == (0, 1, 0, 1, 2)  # k = 2 blocks of 2 (the last one partial): the first
    assert src("midas", 4, 6) == (0, 1, 0, 1, 2, 3)
    assert src("midas", 6, 8) == (0, 1, 2, 3, 2, 3, 4, 5)  # k = 3 blocks of 2: the second
    assert src("top", 4, 6) == (0, 1, 2, 3, 2, 3)
    assert src("function_preserving", 1, 4) == (0, None, None, None)
    for rule, old, new in (("top", 2, 5), ("midas", 1, 3), ("midas", 2, 2), ("nope", 1, 2)):
        with pytest.raises(ValueError):
            src(rule, old, new)


@pytest.mark.parametrize("rule,expected", [("midas", (0, 0, 1)), ("top", (0, 1, 1)),
                                           ("function_preserving", (0, 1, None))])
@pytest.mark.parametrize("opt_rule", ["carry", "reset"])
def test_each_rule_grows_a_2_layer_state_as_built_by_hand(rule, expected, opt_rule):
    cfg = _cfg()
    train = base_config().train
    train.update(steps=100, lr=1e-3)
    optimizer = optim.optimizer(train)
    params = _params(cfg)
    adam, masked, sched = optimizer.init(params)
    adam = adam._replace(count=jnp.int32(7), mu=_distinct(adam.mu, 10), nu=_distinct(adam.nu, 11))
    state = {"step": jnp.int32(7), "params": params, "opt_state": (adam, masked, sched._replace(count=jnp.int32(7)))}
    grown = grow_state(state, optimizer, cfg, 3, rule, opt_rule, jax.random.key(3))
    p = grown["params"]
    assert _same({k: v for k, v in p.items() if not k.startswith("layer_")},
                 {k: v for k, v in params.items() if not k.startswith("layer_")})  # embeddings, head, final LN kept
    g_adam, _, g_sched = grown["opt_state"]
    for j, src in enumerate(expected):
        if src is not None:
            assert _same(p[f"layer_{j}"], params[f"layer_{src}"]), (j, src)
            if opt_rule == "carry":
                assert _same(g_adam.mu[f"layer_{j}"], adam.mu[f"layer_{src}"])
                assert _same(g_adam.nu[f"layer_{j}"], adam.nu[f"layer_{src}"])
        else:  # a zero-residual block: outputs 0, random input-side weights, identity LayerNorms, zero moments
            new = p[f"layer_{j}"]
            for w in (new["attn"]["out"], new["attn"]["out_bias"], new["mlp"]["wo"], new["mlp"]["bo"]):
                assert not np.any(np.asarray(w))
            assert 0.01 < float(jnp.std(new["attn"]["qkv"])) < 0.03 and 0.01 < float(jnp.std(new["mlp"]["wi"])) < 0.03
            assert np.array_equal(new["attn_ln"]["norm"]["scale"], np.ones(8))
            assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(g_adam.mu[f"layer_{j}"]))
    assert int(g_sched.count) == 7  # the learning-rate schedule runs over train.steps either way
    if opt_rule == "carry":
        assert int(g_adam.count) == 7 and _same(g_adam.mu["tok_embed"], adam.mu["tok_embed"])
    else:
        assert int(g_adam.count) == 0
        assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves((g_adam.mu, g_adam.nu)))
    assert jax.tree.structure(grown["opt_state"]) == jax.tree.structure(optimizer.init(p))


def _batch(seed=0, n=6, t=6, words=11):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, words, (n, t))
    targets = tokens.copy()
    tokens[np.arange(n), rng.integers(0, t, n)] = words + 1  # mask id
    weights = (tokens == words + 1).astype(np.float32)
    return {"tokens": jnp.asarray(tokens), "targets": jnp.asarray(targets), "weights": jnp.asarray(weights)}


@pytest.mark.parametrize("ln_mode", ["pre", "post"])
def test_function_preserving_growth_keeps_the_mlm_loss(ln_mode):
    small = _cfg(ln_mode)
    params, batch = _params(small), _batch()
    big = stacking.grow_params(params, small, 4, "function_preserving", key=jax.random.key(1))
    before = float(mlm_loss(params, batch, Bert(small).apply))
    after = float(mlm_loss(big, batch, Bert(_cfg(ln_mode, 4)).apply))
    assert after == pytest.approx(before, rel=1e-5, abs=1e-6)
    logits = lambda cfg, p: np.asarray(Bert(cfg).apply({"params": p}, batch["tokens"]))
    np.testing.assert_allclose(logits(_cfg(ln_mode, 4), big), logits(small, params), rtol=1e-5, atol=1e-5)
    midas = stacking.grow_params(params, small, 4, "midas")  # a copied block changes the function
    assert np.max(np.abs(logits(_cfg(ln_mode, 4), midas) - logits(small, params))) > 1e-2
    if ln_mode == "post":  # the post-LN moment rule moves the LayerNorm's moments with it
        moments = stacking.grow_moments(params, "post", 4, "function_preserving")
        assert _same(moments["layer_3"]["mlp_ln"], params["layer_1"]["mlp_ln"])
        assert not np.any(np.asarray(moments["layer_1"]["mlp_ln"]["norm"]["scale"]))


def test_stage_arithmetic():
    stages = ((1, 3), (2, 4), (4, 5))
    assert [stacking.layers_at(stages, s) for s in range(13)] == [1] * 4 + [2] * 4 + [4] * 5
    assert stacking.final_shape_from(stages) == 8
    assert stacking.final_shape_from(()) == 0 and stacking.final_shape_from(((2, 9),)) == 0
    assert stacking.normalize_stages([[1, 3], [2, 4]]) == ((1, 3), (2, 4))  # as config.json stores them
    cfg = _cfg(layers=2)
    one = stacking.train_flops(cfg, ((1, 10),), 4, 6)
    two = stacking.train_flops(cfg, ((2, 10),), 4, 6)
    per_layer = 4 * 6 * 10 * (6 * (4 * 64 + 2 * 8 * 16) + 12 * 6 * 8)
    assert two - one == per_layer and stacking.train_flops(cfg, ((1, 5), (2, 5)), 4, 6) == (one + two) / 2


def _train_config(*overrides):
    c = load_config(TINY)
    return apply_overrides(c, ["--config.model.num_layers=2", *overrides])


@pytest.mark.parametrize("overrides,match", [
    (["--config.train.stacking.stages=((1,30),(3,30))"], "model has 2"),
    (["--config.train.stacking.stages=((1,30),(2,20))"], "sum to 50 steps but train.steps=60"),
    (["--config.train.stacking.stages=((2,30),(2,30))"], "layers must increase"),
    (["--config.train.stacking.stages=((1,30),2)"], "is not a pair"),
    (["--config.model.num_layers=4", "--config.train.stacking.stages=((1,30),(4,30))"], "add a stage in between"),
    (["--config.train.stacking.stages=((1,30),(2,30))", "--config.train.stacking.rule=bottom"], "rule"),
    (["--config.train.stacking.stages=((1,30),(2,30))", "--config.train.stacking.opt_state=keep"], "opt_state"),
    (["--config.train.stacking.stages=((1,30),(2,30))", "--config.train.rank_every=10"], "rank_every"),
    (["--config.train.stacking.stages=((1,30),(2,30))", "--config.model.kind=lstm"], "BERT only"),
])
def test_bad_stacking_configs_are_one_line_errors(overrides, match):
    with pytest.raises(UserError, match=match) as e:
        validate_config(_train_config(*overrides))
    assert "\n" not in str(e.value)


def test_good_stacking_configs_validate():
    validate_config(_train_config("--config.train.stacking.stages=((1,30),(2,30))"))
    validate_config(_train_config("--config.model.num_layers=4", "--config.train.stacking.stages=((1,30),(4,30))",
                                  "--config.train.stacking.rule=function_preserving"))
    old = ml_collections.ConfigDict(_train_config().to_dict())
    del old.train["stacking"]  # a config from before train.stacking
    validate_config(old)
    assert stacking.stages_of(old) == ()


def _train(workdir, data, stop_at=None):
    import os

    from flatlm.train.loop import Preempted, train_and_evaluate

    c = _train_config("--config.train.steps=8", "--config.train.eval_every=8", "--config.checkpoint.every=100",
                      "--config.train.stacking.stages=((1,4),(2,4))",
                      "--config.train.stacking.rule=function_preserving",
                      f"--config.data.data_dir={data}")
    env = {"FLATLM_DEBUG_SIGKILL_WORKDIR": str(workdir), "FLATLM_DEBUG_SIGTERM_AT_STEP": str(stop_at)}
    old = {k: os.environ.get(k) for k in env}
    try:
        if stop_at is not None:
            os.environ.update(env)
            with pytest.raises(Preempted):
                train_and_evaluate(c, str(workdir), progress=False)
            for k in env:
                os.environ.pop(k)
        return train_and_evaluate(c, str(workdir), progress=False)
    finally:
        for k, v in old.items():
            if v is not None:
                os.environ[k] = v


@pytest.mark.slow
def test_a_stacked_run_resumes_exactly_mid_stage_at_and_after_a_boundary(tmp_path):
    """Stopped (SIGTERM, checkpoint saved) in the middle of stage 1, at its last step (checkpoint before growth) and
    right after the growth: each resumed run ends with the straight run's parameters, bit for bit."""
    from flatlm.checkpoint import all_steps
    from flatlm.run import load_run

    data = tmp_path / "data"
    straight = _train(tmp_path / "straight", data)
    final = load_run(str(tmp_path / "straight")).load_params(8)
    assert stacking.num_layers_of(final) == 2
    for stop in (2, 4, 5):
        wd = tmp_path / f"stop{stop}"
        assert _train(wd, data, stop_at=stop) == straight
        assert all_steps(str(wd)) == [stop, 8]
        run = load_run(str(wd))
        assert run.steps == ([8] if stop <= 4 else [5, 8])  # evaluators see the final depth only
        assert _same(run.load_params(8), final), stop
        if stop <= 4:
            with pytest.raises(UserError, match="stage of 1 layers"):
                run.load_params(stop)


def test_report_section_compute_and_paired_effects(tmp_path):
    """`flatlm report`'s stacking section: layer-steps and the FLOPs ratio by hand (tokens cancel), the same-loss
    count and the paired effect against scipy's t quantile."""
    from scipy import stats

    from flatlm.config import save_workdir_config
    from flatlm.report import RunData
    from flatlm.report_stacking import sections

    probe = {("plain", 0): 0.50, ("plain", 1): 0.60, ("midas", 0): 0.55, ("midas", 1): 0.58}
    kl = {("plain", 0): 0.01, ("plain", 1): 0.01, ("midas", 0): 0.011, ("midas", 1): 0.05}  # seed 1: KL > 0.02
    runs = []
    for (arm, seed), acc in probe.items():
        extra = ["--config.train.stacking.stages=((1,30),(2,30))"] if arm == "midas" else []
        save_workdir_config(_train_config(*extra), str(tmp_path / f"{arm}-seed{seed}"))
        results = [{"kind": "exact_loss", "step": 60, "loss": 1.0 + kl[arm, seed], "kl": kl[arm, seed],
                    "loss_std": 0.001},
                   {"kind": "probe", "step": 60, "task": "k4", "accuracy": acc},
                   {"kind": "flatness", "step": 60, "method": "fisher", "trace": 10.0 * acc}]
        runs.append(RunData(name=f"{arm}-seed{seed}", path=tmp_path / f"{arm}-seed{seed}", config={}, evals=[],
                            results=results))
    md = sections(runs)
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in md
             if line.startswith("| ") and not line.startswith("| run") and not line.startswith("| arm")}
    D, F, V, T = 64, 256, 20, 8  # configs/hmm_mlm.py:tiny
    per_token = lambda L: 6 * (L * (4 * D * D + 2 * D * F) + D * D + V * D) + L * 12 * T * D  # noqa: E731
    assert cells["plain-seed0"][2] == "120" and cells["midas-seed1"][2] == "90"
    assert cells["midas-seed0"][4] == f"{(per_token(1) + per_token(2)) / (2 * per_token(2)):.2f}"
    row = cells["midas"]
    assert row[1:3] == ["2", "1 of 2"]
    d = np.array([0.55 - 0.50, 0.58 - 0.60])
    half = stats.t.ppf(0.975, 1) * d.std(ddof=1) / np.sqrt(2)
    assert row[4] == f"{100 * d.mean():+.3g} [{100 * (d.mean() - half):+.3g}, {100 * (d.mean() + half):+.3g}]"
    assert row[5] == "-" and row[6].startswith(f"{10 * d.mean():+.3g} [")
    assert "| trace (fisher) |" in "\n".join(md)
    assert sections(runs[:2]) == []  # no stacked run: no section
    md = sections(runs, control="midas")  # `flatlm report --control midas`: plain - midas, the sign flipped
    assert any("## Gradual stacking vs midas (" in line for line in md)
    (row,) = [[c.strip() for c in line.strip("|").split("|")] for line in md if line.startswith("| plain |")]
    assert row[4] == f"{-100 * d.mean():+.3g} [{-100 * (d.mean() + half):+.3g}, {-100 * (d.mean() - half):+.3g}]"
