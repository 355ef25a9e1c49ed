"""Fine-tuning on the CLS position: learns, moves exactly the encoder leaves it uses, checks max_len."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flatlm.errors import UserError
from flatlm.evaluate import finetune as ft
from flatlm.models import Bert, BertConfig, BiLSTM, LSTMConfig

V, T = 12, 8


def _data(n, seed=0):
    tokens_NT = np.random.default_rng(seed).integers(0, V, (n, T)).astype(np.int32)
    return tokens_NT, (tokens_NT[:, 2] % 3).astype(np.int32)  # the label is a function of one word


def _init(model, length):
    return nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, length), jnp.int32))["params"])


def test_add_cls():
    out = ft.add_cls(np.array([[1, 2], [3, V]]), V)
    np.testing.assert_array_equal(out, [[V + 2, 1, 2], [V + 2, 3, V]])


def test_finetune_moves_the_encoder():
    model = Bert(BertConfig(num_words=V, max_len=T + 1, d_model=32, num_layers=1, num_heads=2))
    params = _init(model, T + 1)
    before = jax.tree.map(np.array, params)
    tok, y = _data(320)
    tokens, labels = {"train": tok[:256], "test": tok[256:]}, {"train": y[:256], "test": y[256:]}
    cfg = ft.FinetuneConfig(epochs=12, batch_size=32, warmup_steps=10, lr=1e-3, num_seeds=2)
    out, tuned = ft.finetune(model.apply, params, tokens, labels, cfg, num_words=V, max_len=T + 1, return_params=True,
                             progress=False)
    json.dumps(out)
    assert len(tuned) == 2 and tuned[0]["head"]["w"].shape == (32, 3)
    assert out["accuracy"]["train"]["mean"] > 0.9  # chance is 1/3
    # every leaf the classifier uses moved; the unused MLM head is frozen and did not
    frozen = set(out["frozen"])
    assert frozen == {"encoder/head_bias", "encoder/head_dense", "encoder/head_dense_bias",
                      "encoder/head_ln/norm/bias", "encoder/head_ln/norm/scale"}
    for path, old in jax.tree_util.tree_leaves_with_path(before):
        name = "encoder/" + "/".join(k.key for k in path)
        new = tuned[0]["encoder"]
        for k in path:
            new = new[k.key]
        assert np.array_equal(old, np.asarray(new)) == (name in frozen), name
    # the caller's params were neither donated nor modified
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, params))
    # (the probe's side: tests/test_probe.py::test_probe_checkpoint_leaves_params_untouched)


def test_finetune_decays_matrices_only():
    """HF's no_decay (biases, LayerNorm) by shape and name: every vector of the BERT classifier is spared, the MLP
    biases `bi`, `bo` and the classifier's `b` included (a name test decayed them, an audit found)."""
    model = Bert(BertConfig(num_words=V, max_len=T, d_model=16, num_layers=1))
    params = {"encoder": _init(model, T), "head": {"w": jnp.zeros((16, 3)), "b": jnp.zeros(3)}}
    mask = ft.decay_mask(params)
    for (path, x), (_, decays) in zip(jax.tree_util.tree_leaves_with_path(params),
                                      jax.tree_util.tree_leaves_with_path(mask)):
        is_bias = "bias" in str(path[-1].key)  # the fused qkv_bias[3, H, Dh] is a bias whatever its rank
        assert decays == (x.ndim >= 2 and not is_bias), jax.tree_util.keystr(path)
    assert not mask["head"]["b"] and mask["head"]["w"]


def test_finetune_needs_room_for_cls():
    model = Bert(BertConfig(num_words=V, max_len=T, d_model=16, num_layers=1))
    tok, y = _data(16)
    with pytest.raises(UserError, match=r"max_len >= 9"):
        ft.finetune(model.apply, None, {"train": tok}, {"train": y}, ft.FinetuneConfig(epochs=1), num_words=V,
                    max_len=T, progress=False)


@pytest.mark.slow
def test_finetune_bilstm():
    model = BiLSTM(LSTMConfig(num_words=V, max_len=T + 1, d_hidden=16, num_layers=1))
    tok, y = _data(96)
    out = ft.finetune(model.apply, _init(model, T + 1), {"train": tok}, {"train": y},
                      ft.FinetuneConfig(epochs=2, batch_size=32, num_seeds=1), num_words=V, max_len=T + 1,
                      progress=False)
    assert 0.0 <= out["accuracy"]["train"]["mean"] <= 1.0 and "encoder/head/kernel" in out["frozen"]


def _splits(n_train=192, n_eval=96):
    tok, y = _data(n_train + 2 * n_eval, seed=1)
    cut = {"train": slice(0, n_train), "validation": slice(n_train, n_train + n_eval),
           "test": slice(n_train + n_eval, None)}
    return {s: tok[c] for s, c in cut.items()}, {s: y[c] for s, c in cut.items()}


def test_lr_grid_keeps_the_rate_with_the_best_validation_accuracy():
    """Reference: the same fine-tuning at each fixed rate, one call per rate; the grid's per-rate accuracies must be
    those calls' exactly, the chosen rate the argmax of the validation means, and every rate one compile."""
    model = Bert(BertConfig(num_words=V, max_len=T + 1, d_model=16, num_layers=1, num_heads=2))
    params = _init(model, T + 1)
    tokens, labels = _splits()
    base = dict(epochs=3, batch_size=32, warmup_steps=2, num_seeds=2)
    grid = (1e-5, 3e-3, 3e-4)  # the tiny rate cannot learn the rule in 18 steps; the order is not the answer's
    compiles = ft._finetune_epoch._cache_size()
    out = ft.finetune(model.apply, params, tokens, labels, ft.FinetuneConfig(**base, lr_grid=grid), num_words=V,
                      max_len=T + 1, progress=False)
    assert ft._finetune_epoch._cache_size() - compiles <= 1  # the rate is traced, not a new program
    json.dumps(out)
    fixed = [ft.finetune(model.apply, params, tokens, labels, ft.FinetuneConfig(**base, lr=lr), num_words=V,
                         max_len=T + 1, progress=False) for lr in grid]
    assert ft._finetune_epoch._cache_size() - compiles <= 1
    assert out["lr_selection"]["grid"] == list(grid)
    for per_lr, ref in zip(out["lr_selection"]["accuracy"], fixed):
        assert per_lr == ref["accuracy"]
    val = [ref["accuracy"]["validation"]["mean"] for ref in fixed]
    best = int(np.argmax(val))
    assert val[0] < max(val)  # the check has teeth: the rates differ on validation
    assert out["lr"] == grid[best] and out["accuracy"] == fixed[best]["accuracy"]
    assert out["config"]["lr_grid"] == list(grid) and "lr_grid" not in fixed[0]["config"]


def test_lr_grid_needs_validation_and_test_and_positive_rates():
    model = Bert(BertConfig(num_words=V, max_len=T + 1, d_model=16, num_layers=1))
    tokens, labels = _splits()
    no_test = {s: tokens[s] for s in ("train", "validation")}
    with pytest.raises(UserError, match="chooses the rate on a 'validation' split and reports 'test'"):
        ft.finetune(model.apply, None, no_test, labels, ft.FinetuneConfig(lr_grid=(1e-3, 1e-2)), num_words=V,
                    max_len=T + 1, progress=False)
    with pytest.raises(UserError, match="positive learning rates"):
        ft.FinetuneConfig(lr_grid=(1e-3, 0.0))


def test_an_encoder_on_a_mesh_compiles_the_epoch_once():
    """A restored checkpoint's params live on the run's mesh; the fresh head and optimizer state must join it before
    the first epoch, or the epoch function compiles twice (once more for its own mesh-placed outputs)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    model = Bert(BertConfig(num_words=V, max_len=T + 1, d_model=8, num_layers=1, num_heads=2))
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    params = jax.device_put(_init(model, T + 1), NamedSharding(mesh, PartitionSpec()))
    tok, y = _data(64)
    # head_init_std: a static config no other test uses, so the epoch function's cache has no entry for it yet
    cfg = ft.FinetuneConfig(epochs=3, batch_size=32, warmup_steps=1, num_seeds=1, head_init_std=0.0123)
    before = ft._finetune_epoch._cache_size()
    ft.finetune(model.apply, params, {"train": tok}, {"train": y}, cfg, num_words=V, max_len=T + 1, progress=False)
    assert ft._finetune_epoch._cache_size() == before + 1


@pytest.mark.slow  # ~15 s: a fresh interpreter with 2 simulated devices (compile time only; the 1-device case is fast)
def test_an_encoder_sharded_over_two_devices_compiles_the_epoch_once_and_tunes_as_on_one():
    """FSDP-like placement (leaves split over the data axis where it divides them) on 2 simulated devices: XLA's
    propagation gave the epoch's unconstrained outputs other shardings than its inputs (the embeddings, attention
    and head), so the second epoch compiled again; the state layout is now kept. Same final loss as off the mesh."""
    from conftest import run_python

    proc = run_python(f"""
        import json, numpy as np, jax, jax.numpy as jnp, flax.linen as nn
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from flatlm.evaluate import finetune as ft
        from flatlm.models import Bert, BertConfig
        V, T = {V}, {T}
        model = Bert(BertConfig(num_words=V, max_len=T + 1, d_model=16, num_layers=1, num_heads=2))
        params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((2, T + 1), jnp.int32))["params"])
        mesh = Mesh(np.array(jax.devices()).reshape(2, 1), ("data", "model"))
        split = lambda x: NamedSharding(mesh, P("data") if x.ndim and x.shape[0] % 2 == 0 else P())
        rng = np.random.default_rng(0)
        tok = rng.integers(0, V, (64, T))
        y = tok[:, 2] % 3
        cfg = ft.FinetuneConfig(epochs=3, batch_size=32, warmup_steps=1, num_seeds=1)
        out = {{}}
        for name, p in (("single", params), ("sharded", jax.tree.map(lambda x: jax.device_put(x, split(x)), params))):
            before = ft._finetune_epoch._cache_size()
            r = ft.finetune(model.apply, p, {{"train": tok}}, {{"train": y}}, cfg, num_words=V, max_len=T + 1,
                            progress=False)
            out[name] = dict(compiles=ft._finetune_epoch._cache_size() - before, loss=r["final_loss"]["mean"])
        print("RESULT" + json.dumps(out))
    """, devices=2)
    out = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1][len("RESULT"):])
    assert out["sharded"]["compiles"] == 1, out
    assert out["sharded"]["loss"] == pytest.approx(out["single"]["loss"], rel=1e-5), out
