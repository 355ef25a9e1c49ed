"""flatlm.flatness.grow: the embedded model computes the small model's logits and loss (pre-LN and post-LN, width
and depth), the paper's zero-block recipe is not exact for post-LN depth, and bad targets are refused."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flatness_tiny import fast_compile, float64_everywhere, init, mlm_batch

from flatlm.flatness import grow
from flatlm.models.bert import TABLE4, TABLE4_TARGET, Bert, BertConfig

V, T = 11, 8


@pytest.fixture(autouse=True, scope="module")
def _fast_compile():
    with fast_compile():
        yield


def _small(ln_mode: str, dtype: str = "float32", **kw) -> BertConfig:
    base = dict(num_words=V, max_len=T, d_model=16, num_layers=2, num_heads=2, dropout=0.0, attention_dropout=0.0,
                ln_mode=ln_mode, dtype=dtype, param_dtype=dtype)
    return BertConfig(**{**base, **kw})


@functools.cache
def _trained_like(cfg: BertConfig, seed: int = 0) -> dict:
    """Init with larger weights and non-trivial LayerNorm scales/biases, as after training."""
    params = init(Bert(cfg), seed, scale=8.0)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = []
    for (path, x), k in zip(leaves, keys):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            x = x + 0.5 * jax.random.normal(k, x.shape, x.dtype)
        elif "bias" in name:
            x = x + 0.3 * jax.random.normal(k, x.shape, x.dtype)
        out.append(x)
    return jax.tree.unflatten(treedef, [x for x in out])


def _exact_loss(logits_BTV, q_BTV):
    """Mean over positions of the cross-entropy against true conditionals q (the exact pre-training loss form)."""
    return -jnp.mean(jnp.sum(q_BTV * jax.nn.log_softmax(logits_BTV, axis=-1), axis=-1))


@functools.cache
def _apply(cfg: BertConfig):
    return jax.jit(Bert(cfg).apply)


def _logits(cfg: BertConfig, params, tokens):
    return _apply(cfg)({"params": params}, tokens)


def _compare(small_cfg, big_cfg, params, atol, key=None, batch_seed=0, check_tree=False):
    big = grow.embed(params, small_cfg, big_cfg, key=key)
    if check_tree:
        ref = jax.eval_shape(lambda: init(Bert(big_cfg), 0))
        assert jax.tree.structure(big) == jax.tree.structure(ref)
        assert all(a.shape == b.shape and a.dtype == b.dtype
                   for a, b in zip(jax.tree.leaves(big), jax.tree.leaves(ref)))
    tokens = mlm_batch(batch_seed, batch_size=4, num_words=V, length=T)["tokens"]
    ls = _logits(small_cfg, params, tokens)
    lb = _logits(big_cfg, big, tokens)
    np.testing.assert_allclose(lb, ls, rtol=0, atol=atol)
    q = jax.random.dirichlet(jax.random.key(batch_seed), jnp.ones(V, ls.dtype), ls.shape[:2])
    assert float(_exact_loss(lb, q)) == pytest.approx(float(_exact_loss(ls, q)), abs=atol)
    assert float(jnp.max(jnp.abs(ls))) > 1.0  # the check is not trivially satisfied by tiny logits
    return big


@pytest.mark.parametrize(
    "d_model,num_heads,num_layers",
    [(32, 4, 2), (48, 2, 2), (16, 2, 4), (32, 4, 3)],
    ids=["width2-dup-heads", "width3-wider-heads", "depth+2", "width2-depth+1"],
)
def test_pre_ln_embedding_is_exact(d_model, num_heads, num_layers):
    small = _small("pre")
    big = dataclasses.replace(small, d_model=d_model, num_heads=num_heads, num_layers=num_layers, max_len=T + 2)
    _compare(small, big, _trained_like(small), atol=1e-5, check_tree=True)


@pytest.mark.parametrize("d_model,num_layers", [(32, 2), (16, 4), (48, 3)], ids=["width2", "depth+2", "width3-depth+1"])
def test_post_ln_embedding_is_exact(d_model, num_layers):
    small = _small("post")
    big = grow.grown_config(small, d_model=d_model, num_layers=num_layers)
    assert big.head_dim == small.head_dim
    _compare(small, big, _trained_like(small), atol=1e-5, check_tree=True)


def test_paper_head_size_and_random_new_blocks():
    """The paper's shapes: head size 64 (1 head -> 2 heads), new blocks with random input-side weights."""
    small = _small("pre", d_model=64, num_heads=0, num_layers=1)
    big = grow.grown_config(small, d_model=128, num_layers=2)
    assert (small.heads, big.heads, big.head_dim) == (1, 2, 64)
    params = _compare(small, big, _trained_like(small), atol=1e-5, key=jax.random.key(0))
    assert float(jnp.std(params["layer_1"]["attn"]["qkv"])) > 0.01
    assert float(jnp.max(jnp.abs(params["layer_1"]["mlp"]["wo"]))) == 0.0


@pytest.mark.parametrize("ln_mode", ["pre", "post"])
def test_exact_in_float64(ln_mode):
    """Exact up to rounding, not approximately: float64 agreement to 1e-10 (post-LN depth: eps / var ~ 1e-12)."""
    with float64_everywhere():
        small = _small(ln_mode, "float64")
        big = dataclasses.replace(small, d_model=32, num_heads=2, num_layers=3)  # head size 8 -> 16
        _compare(small, big, _trained_like(small), atol=1e-10)


def test_paper_recipe_is_not_exact_for_post_ln_depth():
    """Zero-branch blocks alone (no moving of the preceding LayerNorm's affine) change a post-LN model."""
    small = _small("post")
    big_cfg = dataclasses.replace(small, num_layers=3)
    params = _trained_like(small)
    big = grow.embed(params, small, big_cfg)
    naive = jax.tree.map(lambda x: x, big)
    naive["layer_1"]["mlp_ln"] = params["layer_1"]["mlp_ln"]
    naive["layer_2"]["mlp_ln"] = {"norm": {"scale": jnp.ones(16), "bias": jnp.zeros(16)}}
    tokens = mlm_batch(0, batch_size=4, num_words=V, length=T)["tokens"]
    ls = _logits(small, params, tokens)
    assert float(jnp.max(jnp.abs(_logits(big_cfg, naive, tokens) - ls))) > 1e-2
    assert float(jnp.max(jnp.abs(_logits(big_cfg, big, tokens) - ls))) < 1e-5


def test_bad_targets_are_refused():
    small = _small("pre")
    params = init(Bert(small))
    bad = [
        dataclasses.replace(small, d_model=24, num_heads=3),  # width not a multiple
        dataclasses.replace(small, num_layers=1),  # fewer layers
        dataclasses.replace(small, num_words=V + 1),
        dataclasses.replace(small, d_model=32, num_heads=1),  # fewer heads
        dataclasses.replace(small, ln_mode="post"),
    ]
    for cfg in bad:
        with pytest.raises(ValueError):
            grow.embed(params, small, cfg)


def test_table4_members_embed_into_its_largest_shape():
    layers, width = TABLE4[TABLE4_TARGET]
    assert (layers, width) == (20, 1920) == grow.lcm_shape(grow.TABLE4_MEMBERS)
    for member in grow.TABLE4_MEMBERS:
        L, D = TABLE4[member]
        small = BertConfig.from_shape(member, num_words=10, max_len=8)
        big = grow.grown_config(small, d_model=width, num_layers=layers)
        assert width % D == 0 and layers >= L and big.heads == 30 and big.ff == 4 * width


def _model_fisher_by_leaf(model, params, masked_BT, pos_B) -> dict[str, float]:
    """Exact model Fisher trace per tensor: mean over contexts of sum_y p(y|x) ||grad log p(y|x)||^2 (= Tr(H) at
    the saturation optimum, Lemma 4.2), by the full Jacobian (no sampling); one compiled program, not op by op."""
    B = masked_BT.shape[0]

    def logp(p):
        return jax.nn.log_softmax(model.apply({"params": p}, masked_BT)[jnp.arange(B), pos_B])

    def by_leaf(p):
        jac, probs = jax.jacrev(logp)(p), jnp.exp(logp(p))
        return jax.tree.map(lambda g: jnp.sum(probs * jnp.sum(g.reshape(B, probs.shape[1], -1) ** 2, -1)) / B, jac)

    sums = jax.tree_util.tree_flatten_with_path(jax.jit(by_leaf)(params))[0]
    return {"/".join(str(k.key) for k in path): float(value) for path, value in sums}


def test_growth_rescales_the_fisher_trace_of_exactly_the_non_invariant_tensors():
    """Why Figure 5's grown views do not compare traces like for like (issue 13, C2): width x k leaves the Fisher
    trace of GROWTH_INVARIANT tensors unchanged, divides that of biases, LayerNorms and embeddings by k and
    multiplies the head LayerNorm's by k; added blocks contribute through their (zero) output biases."""
    from flatlm.flatness.estimates import growth_group

    with float64_everywhere():
        V, T, B = 6, 5, 12
        small = BertConfig(num_words=V, max_len=T, d_model=8, num_layers=1, num_heads=1, d_ff=16, dropout=0.0,
                           attention_dropout=0.0, dtype="float64", param_dtype="float64")
        tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
        params = init(Bert(small), 0)  # flatness_tiny's jitted init (the values do not depend on the tokens)
        params = jax.jit(lambda p: jax.tree.map(
            lambda x: x + 0.5 * jax.random.normal(jax.random.key(2), x.shape, x.dtype), p))(params)
        pos = jnp.arange(B) % T
        masked = tokens.at[jnp.arange(B), pos].set(V + 1)
        before = _model_fisher_by_leaf(Bert(small), params, masked, pos)
        k = 2
        big = grow.grown_config(small, d_model=8 * k, num_layers=2)
        grown = jax.jit(grow.embed, static_argnums=(1, 2))(params, small, big)
        after = _model_fisher_by_leaf(Bert(big), grown, masked, pos)
    for name, value in before.items():
        leaf = tuple(name.split("/"))
        factor = 1.0 if growth_group(leaf) == "growth_invariant" else k if name.startswith("head_ln") else 1 / k
        assert after[name] == pytest.approx(factor * value, rel=1e-8), name
    added = {n: v for n, v in after.items() if n.startswith("layer_1/") and v > 1e-12}
    assert set(added) == {"layer_1/attn/out_bias", "layer_1/mlp/bo"}  # zero blocks feel the stream's gradient
