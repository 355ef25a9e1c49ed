"""Function-preserving growth of a trained small BERT into a larger one (paper Appendix B.4), so flatness can be
compared across model sizes at exactly the same function.

Width x k (k = d_model' / d_model, an integer). The residual stream is replicated: x' = tile(x) = [x, x, ..., x].
- Embeddings (token, position) are tiled, unscaled, so the stream starts replicated.
- LayerNorm commutes with replication: the mean and variance of k copies of x are those of x (the epsilon too),
  so LN with tiled scale/bias maps tile(x) to tile(LN(x)) exactly.
- Every weight that reads the stream (qkv, mlp.wi, head.dense) is tiled along its input axis and divided by k, so
  its dot products are unchanged; weights that write to the stream (attn.out, mlp.wo) are tiled along their output
  axis, so they write replicated outputs; biases of replicated axes are tiled.
- Heads. With the paper's fixed head size 64, k x width means m = k x heads: heads are duplicated, and the output
  projection, which now sums m copies of every head, is divided by m. If instead the head size grows (r = Dh'/Dh),
  q, k, v are replicated inside each head, q is scaled by 1/sqrt(r) so that q.k / sqrt(Dh') is unchanged, and the
  output projection is divided by r. In general m * r = k, and out is divided by k.
- Hidden MLP units are replicated k_f = d_ff' / d_ff times; mlp.wo is divided by k_f.
- Tied output embedding: logits = h . E^T with E tiled would be k times too large, so the head's LayerNorm scale
  and bias are divided by k (the tied matrix cannot be scaled on one side only).
Exact (up to floating-point summation order) for pre-LN and post-LN.

Depth +n layers (the blocks and the LayerNorm move are `flatlm.models.stacking`'s, shared with `train.stacking`).
- Pre-LN: new blocks with zero output projections (attn.out, out_bias, mlp.wo, bo) add 0 to the residual stream:
  exact. Their other weights are zero (default) or freshly initialised (`key`).
- Post-LN: the paper's recipe (new blocks with zero branches, every small-model tensor copied) is NOT exact, and
  no choice of the new block's own parameters makes it exact for a trained model. The new block's input is the
  output of the preceding LayerNorm, x = g * n + b with n centred and of unit variance (g, b that LayerNorm's scale
  and bias). With zero branches the block computes LN_2(LN_1(x)), and LN_2's output is g_2 * z + b_2 with z
  centred and of unit variance, so LN_2(LN_1(x)) = x for all n forces (g_2, b_2) = (g, b) and z = n up to sign,
  i.e. the centred part of LN_1(x) = g_1 * (x - mean(x)) / std(x) + b_1 must be proportional to n for every n.
  Take g = 1: x - mean(x) = n + c with c = b - mean(b), std(x) = sqrt(1 + |c|^2/d + 2 n.c/d) varies with n,
  and g_1 * (n + c) / std(x) + b_1 (centred) is proportional to n for all n only if c = 0. So an exact zero-branch
  block needs b (and likewise g) constant across features, which a trained LayerNorm is not. Non-zero branches
  cannot repair this exactly either: they would have to compute the per-token 1 / std(x), an algebraic function
  of the input that GELU MLPs and softmax attention only approximate (test_paper_recipe_is_not_exact_for_post_ln_depth
  measures logit changes > 1e-2).
  flatlm's exact construction therefore also reparameterises one existing tensor: the preceding LayerNorm (the
  last small block's mlp_ln, or embed_ln without layers) is reset to scale 1, bias 0, its (g, b) move to the last
  new block's mlp_ln, and all other new LayerNorms are (1, 0). Every inserted LayerNorm then receives an already
  normalised vector, and LN(n) = n up to the epsilon: the relative error is about eps / (2 var) (1e-12 / var for
  BERT's eps = 1e-12, far below float32 resolution), and zero with eps = 0.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flatlm import checkpoint as ckpt
from flatlm import paths
from flatlm import run as run_lib
from flatlm.config import save_workdir_config
from flatlm.errors import UserError
from flatlm.models import stacking
from flatlm.models.bert import SHAPES, TABLE4, BertConfig
from flatlm.models.losses import mlm_loss

# Figure 5 (B.3) grows every Table 4 shape into the largest one, L20-H1920 (the table's widths all divide 1920).
TABLE4_MEMBERS: tuple[str, ...] = tuple(TABLE4)


def lcm_shape(names: Iterable[str]) -> tuple[int, int]:
    """(max num_layers, lcm of d_model) over Table 3/4 shape names: the smallest target that embeds them all.

    For Table 4 this is the paper's target, L20-H1920; for a custom group (e.g. Table 3's first six, which have
    no common multiple in Table 3) it is the group's own target.
    """
    shapes = [SHAPES[n] for n in names]
    return max(L for L, _ in shapes), math.lcm(*(d for _, d in shapes))


def grown_config(small: BertConfig, *, d_model: int, num_layers: int) -> BertConfig:
    """`small` at a larger width/depth, keeping its head size (so heads are duplicated) and d_ff / d_model."""
    k = d_model // small.d_model
    return dataclasses.replace(
        small,
        d_model=d_model,
        num_layers=num_layers,
        num_heads=small.num_heads * k if small.num_heads else 0,
        d_ff=small.d_ff * k if small.d_ff else 0,
    )


def _ratio(big: int, small: int, what: str) -> int:
    if big < small or big % small:
        raise ValueError(f"{what}: the big model's {big} must be an integer multiple of the small model's {small}")
    return big // small


def _check(small: BertConfig, big: BertConfig) -> tuple[int, int, int, int]:
    for field in ("num_words", "ln_mode", "gelu_approximate", "ln_eps"):
        if getattr(small, field) != getattr(big, field):
            raise ValueError(f"{field} differs: {getattr(small, field)!r} vs {getattr(big, field)!r}")
    if big.max_len < small.max_len:
        raise ValueError(f"max_len {big.max_len} < small model's {small.max_len}")
    if big.num_layers < small.num_layers:
        raise ValueError(f"num_layers {big.num_layers} < small model's {small.num_layers}")
    k = _ratio(big.d_model, small.d_model, "d_model")
    m = _ratio(big.heads, small.heads, "num_heads")
    r = _ratio(big.head_dim, small.head_dim, "head_dim")
    kf = _ratio(big.ff, small.ff, "d_ff")
    assert m * r == k
    return k, m, r, kf


def _ln(p: Mapping[str, Any], k: int, div: float = 1.0) -> dict:
    return {"norm": {"scale": jnp.tile(p["norm"]["scale"], k) / div, "bias": jnp.tile(p["norm"]["bias"], k) / div}}


def _widen_layer(p: Mapping[str, Any], k: int, m: int, r: int, kf: int) -> dict:
    a, f = p["attn"], p["mlp"]
    q_scale = jnp.array([1.0 / math.sqrt(r), 1.0, 1.0], a["qkv"].dtype)  # keeps q.k / sqrt(head_dim) unchanged
    qkv = jnp.tile(a["qkv"], (k, 1, m, r)) / k * q_scale[None, :, None, None]
    qkv_bias = jnp.tile(a["qkv_bias"], (1, m, r)) * q_scale[:, None, None]
    return {
        "attn_ln": _ln(p["attn_ln"], k),
        "attn": {
            "qkv": qkv,
            "qkv_bias": qkv_bias,
            "out": jnp.tile(a["out"], (m, r, k)) / (m * r),
            "out_bias": jnp.tile(a["out_bias"], k),
        },
        "mlp_ln": _ln(p["mlp_ln"], k),
        "mlp": {
            "wi": jnp.tile(f["wi"], (k, kf)) / k,
            "bi": jnp.tile(f["bi"], kf),
            "wo": jnp.tile(f["wo"], (kf, k)) / kf,
            "bo": jnp.tile(f["bo"], k),
        },
    }


def embed(
    small_params: Mapping[str, Any],
    small_config: BertConfig,
    big_config: BertConfig,
    *,
    key: jax.Array | None = None,
    init_scale: float = 0.02,
) -> dict:
    """Parameters for `big_config` computing the same logits as the small model (see the module docstring).

    big_config must have the same num_words, ln_mode, GELU and ln_eps; integer multiples of d_model, heads,
    head_dim and d_ff; at least as many layers (new blocks are appended after the small model's) and positions
    (extra position rows are zero). New blocks' input-side weights (qkv, mlp.wi) are zero, or N(0, init_scale^2)
    when `key` is given; their outputs are zero either way. The small model's part is one jitted program (eager,
    its ~100 tiles and divides compiled one by one: seconds of `flatlm grow` on CPU); new blocks are drawn as
    before, outside it, so a seed keeps giving the same bits (jitted, the scaled normals moved by 1 ulp).
    """
    _check(small_config, big_config)  # its one-line errors before anything is traced
    dt = jnp.dtype(big_config.param_dtype)
    out = _widen(small_params, small_config=small_config, big_config=big_config)
    L = small_config.num_layers
    for i in range(L, big_config.num_layers):
        lk = None if key is None else jax.random.fold_in(key, i)
        out[f"layer_{i}"] = stacking.zero_residual_layer(big_config, lk, dt, init_scale)
    if small_config.ln_mode == "post" and big_config.num_layers > L:
        # Move the preceding LayerNorm's affine to the last new block; all inserted LayerNorms are then (1, 0).
        out = stacking.move_post_ln_affine(out, L, big_config.num_layers, stacking.identity_ln(big_config.d_model, dt))
    return jax.tree.map(lambda x: jnp.asarray(x, dt), out)


@functools.partial(jax.jit, static_argnames=("small_config", "big_config"))
def _widen(p: Mapping[str, Any], *, small_config: BertConfig, big_config: BertConfig) -> dict:
    """The small model's embeddings, head, final LayerNorm and layers widened to `big_config`'s width."""
    k, m, r, kf = _check(small_config, big_config)
    pos = jnp.tile(p["pos_embed"], (1, k))
    out: dict[str, Any] = {
        "tok_embed": jnp.tile(p["tok_embed"], (1, k)),
        "pos_embed": jnp.zeros((big_config.max_len, big_config.d_model), pos.dtype).at[: small_config.max_len].set(pos),
        "head_dense": jnp.tile(p["head_dense"], (k, k)) / k,
        "head_dense_bias": jnp.tile(p["head_dense_bias"], k),
        "head_ln": _ln(p["head_ln"], k, div=k),  # tied output embedding: undo the k of tile(h) . tile(E)
        "head_bias": p["head_bias"],
    }
    ln_name = "final_ln" if small_config.ln_mode == "pre" else "embed_ln"
    out[ln_name] = _ln(p[ln_name], k)
    for i in range(small_config.num_layers):
        out[f"layer_{i}"] = _widen_layer(p[f"layer_{i}"], k, m, r, kf)
    return out


@functools.partial(jax.jit, static_argnums=0)
def _logits_and_loss(apply_fn, params, batch: dict) -> tuple[jax.Array, jax.Array]:
    return apply_fn({"params": params}, batch["tokens"]), mlm_loss(params, batch, apply_fn)


def check_embedding(small_apply, small_params, big_apply, big_params, batches) -> dict[str, float]:
    """Max |logit difference| and mean MLM loss (nats) of the small and grown models on MLM `batches`."""
    diff, ls, lb = 0.0, [], []
    for b in batches:
        a, loss_a = _logits_and_loss(small_apply, small_params, b)
        c, loss_c = _logits_and_loss(big_apply, big_params, b)
        diff = max(diff, float(np.max(np.abs(np.asarray(a) - np.asarray(c)))))
        ls.append(float(loss_a))
        lb.append(float(loss_c))
    return {"max_abs_logit_diff": diff, "loss_small": float(np.mean(ls)), "loss_big": float(np.mean(lb))}


def save_npz(path: str, params, config: BertConfig) -> None:
    """Write grown parameters as an .npz of '/'-joined parameter paths, with the BertConfig as JSON under
    '__config__' (readable without flatlm: `np.load(path)`)."""
    flat = {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    np.savez(path, __config__=np.array(json.dumps(dataclasses.asdict(config))), **flat)


def save_run(out: str, small_run, params, big: BertConfig, step: int) -> None:
    """Write the grown model as a new run workdir `out` that `flatlm evaluate / flatness / report` read as any other:
    config.json (the small run's config at the grown shape, reading the small run's corpus) and an orbax checkpoint
    `step` holding {"step", "params"} (no optimizer state; evaluators restore the parameters only). UserError if
    `out` already holds a run."""
    if paths.path(out, "config.json").exists():
        raise UserError(f"--out {out} already holds a run; choose a new folder")
    config = small_run.config.copy_and_resolve_references()
    config.model.update(shape="", d_model=big.d_model, num_layers=big.num_layers, num_heads=big.num_heads,
                        d_ff=big.d_ff)
    small_data = run_lib.data_dir(small_run.config, small_run.workdir)
    config.data.data_dir = small_data if paths.is_cloud(small_data) else os.path.abspath(small_data)
    save_workdir_config(config, out)
    mngr = ckpt.manager(out, keep=1)
    try:
        ckpt.save(mngr, step, {"step": jnp.asarray(step, jnp.int32), "params": params})
    finally:
        mngr.close()
