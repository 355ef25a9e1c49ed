"""Depth surgery on BERT parameter trees: grow a model from n to m > n layers by a stacking rule.

Pure functions of parameter pytrees (`flatlm.models.bert`'s layout: `layer_{i}` keys, 0 = next to the embeddings);
the trainer applies them at stage boundaries of `train.stacking` (`flatlm.train.stacking`) and
`flatlm.flatness.grow` builds its function-preserving depth growth from the same zero-residual block.

Rules (b = m - n layers are added; "block" = b consecutive layers):
- `top` (gradual stacking, Reddi et al. 2023, "Efficient training of language models using few-shot learning";
  Gong et al. 2019): the new layers are copies of the top b layers, stacked on top: [0..n-1, n-b..n-1].
- `midas` (MIDAS, Saunshi et al. 2024, "On the inductive bias of stacking towards improving reasoning"): the model
  is read as k = ceil(n / b) blocks of b layers counted from the bottom, and the middle block (the ceil(k/2)-th,
  as their f_1 ... f_ceil(k/2) f_ceil(k/2) ... f_k; clipped to the last full b layers) is duplicated and the
  copy inserted right after it. 2 -> 3 layers: [0, 0, 1]; 3 -> 4: [0, 1, 1, 2]; 2 -> 4: [0, 1, 0, 1].
- `function_preserving` (flatlm's own, the depth part of paper Appendix B.4 growth): b new blocks on top whose
  residual branches output exactly 0 (zero attn.out, out_bias, mlp.wo, bo), so the grown model computes the same
  function; their input-side weights (qkv, mlp.wi) are N(0, init_scale^2) (the model's own init) when a key is
  given, else 0 (a block with zero qkv, wi AND wo gets no gradient: training needs the key). Post-LN additionally
  moves the preceding LayerNorm's affine onto the last new block (`move_post_ln_affine`; why: flatness/grow.py).
`top` and `midas` need b <= n (copies of existing layers). Optimizer moments follow the parameters they belong to
(`grow_tree` with a zero layer for new blocks), so the same rule grows Adam's mu and nu.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from flatlm.models.bert import BertConfig

RULES = ("midas", "top", "function_preserving")


def layer_sources(rule: str, old: int, new: int) -> tuple[int | None, ...]:
    """For each layer of the grown model (0 = bottom), the layer of the old model it is a copy of, or None for a
    new zero-residual block. ValueError on an unknown rule or a growth the rule cannot make."""
    b = new - old
    if old < 1 or b < 1:
        raise ValueError(f"growth from {old} to {new} layers: need 1 <= old < new")
    if rule == "function_preserving":
        return (*range(old), *([None] * b))
    if rule not in ("midas", "top"):
        raise ValueError(f"unknown stacking rule {rule!r}; choose one of {', '.join(RULES)}")
    if b > old:
        raise ValueError(f"{rule} growth copies existing layers: cannot add {b} to {old} (add at most {old})")
    if rule == "top":
        return (*range(old), *range(old - b, old))
    k = math.ceil(old / b)
    start = min(b * (math.ceil(k / 2) - 1), old - b)
    return (*range(start + b), *range(start, start + b), *range(start + b, old))


def identity_ln(d: int, dtype) -> dict:
    """A LayerNorm's parameters at their init: scale 1, bias 0."""
    return {"norm": {"scale": jnp.ones((d,), dtype), "bias": jnp.zeros((d,), dtype)}}


def zero_residual_layer(cfg: BertConfig, key: jax.Array | None, dtype, init_scale: float = 0.02) -> dict:
    """A block whose residual branches output exactly 0 (zero attn.out, mlp.wo and their biases); qkv and mlp.wi
    are N(0, init_scale^2) from `key`, or 0 without one; LayerNorms at scale 1, bias 0."""
    D, H, Dh, F = cfg.d_model, cfg.heads, cfg.head_dim, cfg.ff
    z = lambda *s: jnp.zeros(s, dtype)
    if key is None:
        qkv, wi = z(D, 3, H, Dh), z(D, F)
    else:
        kq, kw = jax.random.split(key)
        qkv = init_scale * jax.random.normal(kq, (D, 3, H, Dh), dtype)
        wi = init_scale * jax.random.normal(kw, (D, F), dtype)
    return {
        "attn_ln": identity_ln(D, dtype),
        "attn": {"qkv": qkv, "qkv_bias": z(3, H, Dh), "out": z(H, Dh, D), "out_bias": z(D)},
        "mlp_ln": identity_ln(D, dtype),
        "mlp": {"wi": wi, "bi": z(F), "wo": z(F, D), "bo": z(D)},
    }


def move_post_ln_affine(tree: dict, old: int, new: int, identity: Mapping[str, Any]) -> dict:
    """Post-LN depth growth with new blocks on top (flatness/grow.py explains why): the LayerNorm before the first
    new block (layer old-1's mlp_ln, or embed_ln when old = 0) hands its (scale, bias) to the last new block's
    mlp_ln and becomes `identity`. Returns `tree` with those entries replaced (the dicts are not mutated)."""
    tree = dict(tree)
    prev = tree[f"layer_{old - 1}"]["mlp_ln"] if old else tree["embed_ln"]
    tree[f"layer_{new - 1}"] = {**tree[f"layer_{new - 1}"], "mlp_ln": {"norm": dict(prev["norm"])}}
    if old:
        tree[f"layer_{old - 1}"] = {**tree[f"layer_{old - 1}"], "mlp_ln": identity}
    else:
        tree["embed_ln"] = identity
    return tree


def grow_tree(tree: Mapping[str, Any], sources: Sequence[int | None], new_layer: Callable[[int], dict]) -> dict:
    """`tree` (parameters, or anything with their layout, e.g. Adam's mu) with layers rebuilt from `sources`
    (`layer_sources`): layer j is a copy of old layer sources[j], or `new_layer(j)` where it is None. Every other
    entry (embeddings, head, final LayerNorm) is kept."""
    out = {k: v for k, v in tree.items() if not k.startswith("layer_")}
    for j, src in enumerate(sources):
        out[f"layer_{j}"] = new_layer(j) if src is None else jax.tree.map(lambda x: x, tree[f"layer_{src}"])
    return out


def num_layers_of(tree: Mapping[str, Any]) -> int:
    """How many `layer_{i}` blocks a parameter tree has."""
    return sum(1 for k in tree if k.startswith("layer_"))


def grow_params(params: Mapping[str, Any], cfg: BertConfig, num_layers: int, rule: str, *,
                key: jax.Array | None = None, init_scale: float = 0.02) -> dict:
    """Parameters of `cfg` (cfg.num_layers layers) grown to `num_layers` by `rule` (module docstring). New
    zero-residual blocks (function_preserving) draw their input-side weights from fold_in(key, layer index)."""
    old = cfg.num_layers
    sources = layer_sources(rule, old, num_layers)
    dt = jnp.dtype(cfg.param_dtype)

    def new_layer(j):
        return zero_residual_layer(cfg, None if key is None else jax.random.fold_in(key, j), dt, init_scale)

    out = grow_tree(params, sources, new_layer)
    if rule == "function_preserving" and cfg.ln_mode == "post":
        out = move_post_ln_affine(out, old, num_layers, identity_ln(cfg.d_model, dt))
    return out


def grow_moments(moments: Mapping[str, Any], ln_mode: str, num_layers: int, rule: str) -> dict:
    """An optimizer's per-parameter state (Adam's mu or nu, SGD's trace) grown like `grow_params` grows the
    parameters: copied layers carry their moments, new blocks get zeros (a fresh parameter's), and post-LN's moved
    LayerNorm affine carries its moments with it (the LayerNorm left at identity starts from zeros)."""
    old = num_layers_of(moments)
    zeros = jax.tree.map(jnp.zeros_like, moments["layer_0"])
    out = grow_tree(moments, layer_sources(rule, old, num_layers), lambda j: zeros)
    if rule == "function_preserving" and ln_mode == "post":
        out = move_post_ln_affine(out, old, num_layers, zeros["mlp_ln"])
    return out


# ---------------------------------------------------------------- stages (train.stacking.stages)


def normalize_stages(stages) -> tuple[tuple[int, int], ...]:
    """`train.stacking.stages` as ((num_layers, steps), ...) of ints (config.json stores lists); ValueError when
    an entry is not a pair of integers."""
    out = []
    for s in stages or ():
        if not isinstance(s, list | tuple) or len(s) != 2 or not all(isinstance(x, int) for x in s):
            raise ValueError(f"stage {s!r} is not a pair (num_layers, steps) of integers")
        out.append((int(s[0]), int(s[1])))
    return tuple(out)


def layers_at(stages, step: int) -> int:
    """Layers of the model whose state is saved at `step` (after `step` updates): stage i covers the steps
    (S_{i-1}, S_i], S_i the cumulative steps; step 0 is the first stage's init. Growth happens before step S_i + 1."""
    stages = normalize_stages(stages)
    end = 0
    for layers, steps in stages:
        end += steps
        if step <= end:
            return layers
    return stages[-1][0]


def final_shape_from(stages) -> int:
    """The first step whose checkpoint has the final depth (S_{K-1} + 1); 0 without stacking."""
    stages = normalize_stages(stages)
    return sum(s for _, s in stages[:-1]) + 1 if len(stages) > 1 else 0


def stages_of(config) -> tuple[tuple[int, int], ...]:
    """A run config's `train.stacking.stages` (() without stacking, or for configs older than it)."""
    train = config.get("train") if hasattr(config, "get") else None
    stacking = train.get("stacking") if train is not None else None
    return normalize_stages(stacking.get("stages", ()) if stacking is not None else ())


def train_flops(cfg: BertConfig, stages, batch_size: int, length: int) -> float:
    """Estimated training FLOPs: 6 x (matmul parameters per token) x tokens, plus attention's q.k and p.v
    (2 x 2 x T x D per token and layer forward, x 3 with backward), summed over stages ((num_layers, steps)).
    Matmul parameters per token: L x (4 D^2 + 2 D F) + the head (D^2 + V D); embedding lookups are free."""
    D, F, V = cfg.d_model, cfg.ff, cfg.num_words
    tokens = batch_size * length
    total = 0.0
    for layers, steps in normalize_stages(stages):
        per_token = 6 * (layers * (4 * D * D + 2 * D * F) + D * D + V * D) + layers * 12 * length * D
        total += float(per_token) * tokens * steps
    return total
