"""OPT decoder (Zhang et al. 2022) in Flax Linen with a KV cache: the teacher that generates the OPT language.

Inference only (no dropout): flatlm uses OPT as a fixed generative language, never trains it (the paper's OPT
data: OPT-125M samples 24-token sentences over its top-2000 tokens, Sections 3.2 and A.1). Hugging Face
checkpoints load through `hf.py`. Every product runs at full float32 precision (`languages.base.exact_dot`): the
sampler and the exact conditionals, not TF32 as XLA:GPU's default would (the CPU's bits do not change).
The function is Hugging Face's `OPTForCausalLM`: learned positions with OPT's offset of 2 (position p reads row
p + 2), pre-LN layers when `do_layer_norm_before` (125M) else post-LN (350M), ReLU FFN, a final LayerNorm in pre-LN
models, optional `project_in/out` when `word_embed_proj_dim != hidden_size` (350M), and a head tied to the token
embeddings (no bias).

Parameter tree (plain nested dict after `nn.unbox`; names and layouts mirror the learners' Bert):
  embed_tokens[Vopt, Dw], embed_positions[P + 2, D], project_in[Dw, D], project_out[D, Dw] (only when Dw != D),
  layer_{i}/{attn_ln/norm/{scale, bias}, attn/{qkv[D, 3, H, Dh], qkv_bias[3, H, Dh], out[H, Dh, D], out_bias[D]},
             mlp_ln/norm/{scale, bias}, mlp/{wi[D, F], bi[F], wo[F, D], bo[D]}},
  final_ln/norm/{scale, bias} (pre-LN only).
`attn_ln` is HF's `self_attn_layer_norm`, `mlp_ln` its `final_layer_norm` inside a layer.

KV cache: `KVCache(k, v, length)` with k, v float[L, C, M, H, Dh] holding M slots of which the first `length` are
valid. `decode` attends new tokens to the valid cache slots and causally to each other; C is 1 (one prefix shared
by the whole batch, e.g. K candidate continuations of one sentence) or the batch size. `append_cache` writes the new
keys/values at `length`, so a fixed-size buffer decodes step by step under one compiled shape. `decode` can also pack
independent continuations into one row (`segments_S`, each segment seeing its own number of cache slots,
`cache_visible_S`): flatlm's exact conditionals use it to run two suffixes per row under a single shape.
"""

from __future__ import annotations

import dataclasses
import math
import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flatlm.errors import UserError
from flatlm.languages.base import exact_dot, exact_einsum

POSITION_OFFSET = 2  # OPT's learned positions are stored from row 2 (a fairseq padding_idx artefact)


@dataclasses.dataclass(frozen=True)
class OPTConfig:
    """Shape and options of an OPT decoder; field names follow HF's `OPTConfig` where they exist."""

    vocab_size: int = 50272
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    ffn_dim: int = 3072
    max_positions: int = 2048
    word_embed_proj_dim: int = 0  # 0 -> hidden_size; 350M uses 512 with project_in/out
    do_layer_norm_before: bool = True  # pre-LN (125M, >= 1.3B); False is post-LN (350M)
    remove_final_layer_norm: bool = False
    activation: str = "relu"
    enable_bias: bool = True
    ln_eps: float = 1e-5
    pad_token_id: int = 1
    bos_token_id: int = 2
    eos_token_id: int = 2
    dtype: str = "float32"
    param_dtype: str = "float32"

    @property
    def embed_dim(self) -> int:
        """Width of the token embeddings (Dw)."""
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def head_dim(self) -> int:
        """Width of one attention head (Dh)."""
        return self.hidden_size // self.num_heads

    @property
    def has_projection(self) -> bool:
        """Whether embeddings are projected in/out of the residual stream (350M: Dw 512 != D 1024)."""
        return self.embed_dim != self.hidden_size

    @property
    def has_final_ln(self) -> bool:
        """Whether a LayerNorm precedes the head (pre-LN models that keep it)."""
        return self.do_layer_norm_before and not self.remove_final_layer_norm

    @classmethod
    def named(cls, name: str, **kw) -> OPTConfig:
        """One of `NAMED_CONFIGS` ("125m", "350m", "tiny"), with fields overridden by `kw`."""
        if name not in NAMED_CONFIGS:
            raise UserError(f"unknown OPT shape {name!r}; choose one of {', '.join(NAMED_CONFIGS)}")
        return dataclasses.replace(NAMED_CONFIGS[name], **kw)

    @classmethod
    def from_hf(cls, hf: dict[str, typing.Any]) -> OPTConfig:
        """From a Hugging Face `config.json` dict (model_type "opt")."""
        if hf.get("model_type", "opt") != "opt":
            raise UserError(f"config.json has model_type {hf.get('model_type')!r}, expected 'opt'")
        if not hf.get("layer_norm_elementwise_affine", True):
            raise UserError("OPT checkpoints without LayerNorm affine parameters are not supported")
        if not hf.get("tie_word_embeddings", True):
            raise UserError("OPT checkpoints with an untied output head are not supported")
        proj = hf.get("word_embed_proj_dim")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            ffn_dim=hf["ffn_dim"],
            max_positions=hf["max_position_embeddings"],
            word_embed_proj_dim=0 if proj in (None, hf["hidden_size"]) else proj,
            do_layer_norm_before=hf.get("do_layer_norm_before", True),
            remove_final_layer_norm=hf.get("_remove_final_layer_norm", False),
            activation=hf.get("activation_function", "relu"),
            enable_bias=hf.get("enable_bias", True),
            pad_token_id=_first(hf.get("pad_token_id"), 1),
            bos_token_id=_first(hf.get("bos_token_id"), 2),
            eos_token_id=_first(hf.get("eos_token_id"), 2),
        )

    def to_hf(self) -> dict[str, typing.Any]:
        """Keyword arguments for `transformers.OPTConfig` describing the same model."""
        return dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            ffn_dim=self.ffn_dim,
            max_position_embeddings=self.max_positions,
            word_embed_proj_dim=self.embed_dim,
            do_layer_norm_before=self.do_layer_norm_before,
            _remove_final_layer_norm=self.remove_final_layer_norm,
            activation_function=self.activation,
            enable_bias=self.enable_bias,
            pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )


def _first(x, default: int) -> int:
    if x is None:
        return default
    return int(x[0]) if isinstance(x, list | tuple) else int(x)


NAMED_CONFIGS: dict[str, OPTConfig] = {
    # facebook/opt-125m: pre-LN, no projection.
    "125m": OPTConfig(),
    # facebook/opt-350m: post-LN, no final LN, 512-wide embeddings projected in/out of the 1024-wide stream.
    "350m": OPTConfig(hidden_size=1024, num_layers=24, num_heads=16, ffn_dim=4096, word_embed_proj_dim=512,
                      do_layer_norm_before=False),
    # A small random model for tests and CI smoke runs.
    "tiny": OPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, ffn_dim=64, max_positions=32),
}


class KVCache(typing.NamedTuple):
    """Keys/values k, v float[L, C, M, H, Dh]; the first `length` (int32 scalar) of the M slots are valid."""

    k: jax.Array
    v: jax.Array
    length: jax.Array


def init_cache(cfg: OPTConfig, batch: int, slots: int) -> KVCache:
    """An empty cache of `slots` positions for `batch` rows."""
    shape = (cfg.num_layers, batch, slots, cfg.num_heads, cfg.head_dim)
    z = jnp.zeros(shape, jnp.dtype(cfg.dtype))
    return KVCache(z, z, jnp.zeros((), jnp.int32))


def append_cache(cache: KVCache, kv_new: KVCache) -> KVCache:
    """Write `kv_new` (k, v [L, C, S, H, Dh], as returned by `decode`) into the cache at `cache.length`."""
    at = (0, 0, cache.length, 0, 0)
    k = jax.lax.dynamic_update_slice(cache.k, kv_new.k.astype(cache.k.dtype), at)
    v = jax.lax.dynamic_update_slice(cache.v, kv_new.v.astype(cache.v.dtype), at)
    return KVCache(k, v, cache.length + kv_new.k.shape[2])


def _init(names, scale=0.02):
    return nn.with_logical_partitioning(nn.initializers.normal(scale), names)


def _zeros(names):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def _activation(name: str):
    acts = {"relu": jax.nn.relu, "gelu": lambda x: jax.nn.gelu(x, approximate=False),
            "gelu_new": lambda x: jax.nn.gelu(x, approximate=True)}
    if name not in acts:
        raise UserError(f"unsupported OPT activation {name!r}; supported: {', '.join(acts)}")
    return acts[name]


class Attention(nn.Module):
    """Causal self-attention over [valid cache slots ; new tokens]; returns the output and the new keys/values."""

    cfg: OPTConfig

    @nn.compact
    def __call__(self, x_BSD, self_mask_SS, cache_k_CMHd=None, cache_v_CMHd=None, cache_mask_SM=None):
        c = self.cfg
        dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        H, Dh, D = c.num_heads, c.head_dim, c.hidden_size
        qkv = self.param("qkv", _init(("embed", None, "heads", "kv")), (D, 3, H, Dh), pdt)
        out = self.param("out", _init(("heads", "kv", "embed")), (H, Dh, D), pdt)
        qkv_BSKHd = exact_einsum("bsd,dkhe->bskhe", x_BSD.astype(dt), qkv.astype(dt))
        if c.enable_bias:
            qkv_BSKHd = qkv_BSKHd + self.param("qkv_bias", _zeros((None, "heads", "kv")), (3, H, Dh), pdt).astype(dt)
        # HF scales the projected queries (bias included) rather than the scores; same order here.
        q_BSHd = qkv_BSKHd[:, :, 0] * (Dh**-0.5)
        k_BSHd, v_BSHd = qkv_BSKHd[:, :, 1], qkv_BSKHd[:, :, 2]
        neg = jnp.finfo(jnp.float32).min
        s_BHSS = exact_einsum("bshe,bthe->bhst", q_BSHd, k_BSHd).astype(jnp.float32)
        s_BHSS = jnp.where(self_mask_SS, s_BHSS, neg)
        if cache_k_CMHd is None:
            p_BHSS = jax.nn.softmax(s_BHSS, axis=-1).astype(dt)
            o_BSHd = exact_einsum("bhst,bthe->bshe", p_BHSS, v_BSHd)
        else:
            M = cache_k_CMHd.shape[1]
            shared = cache_k_CMHd.shape[0] == 1 and x_BSD.shape[0] != 1
            ck, cv = cache_k_CMHd.astype(dt), cache_v_CMHd.astype(dt)
            if shared:  # one prefix for the whole batch: no copy of the cache per row
                s_BHSM = exact_einsum("bshe,mhe->bhsm", q_BSHd, ck[0])
            else:
                s_BHSM = exact_einsum("bshe,bmhe->bhsm", q_BSHd, ck)
            s_BHSM = jnp.where(cache_mask_SM, s_BHSM.astype(jnp.float32), neg)
            p_BHSX = jax.nn.softmax(jnp.concatenate([s_BHSM, s_BHSS], axis=-1), axis=-1).astype(dt)
            p_BHSM, p_BHSS = p_BHSX[..., :M], p_BHSX[..., M:]
            if shared:
                o_BSHd = exact_einsum("bhsm,mhe->bshe", p_BHSM, cv[0])
            else:
                o_BSHd = exact_einsum("bhsm,bmhe->bshe", p_BHSM, cv)
            o_BSHd = o_BSHd + exact_einsum("bhst,bthe->bshe", p_BHSS, v_BSHd)
        y_BSD = exact_einsum("bshe,hed->bsd", o_BSHd, out.astype(dt))
        if c.enable_bias:
            y_BSD = y_BSD + self.param("out_bias", _zeros(("embed",)), (D,), pdt).astype(dt)
        y_BSD = nn.with_logical_constraint(y_BSD, ("batch", "length", "embed"))
        return y_BSD, k_BSHd, v_BSHd


class Mlp(nn.Module):
    """The feed-forward block: x[B, S, D] -> act(x @ wi + bi) @ wo + bo."""

    cfg: OPTConfig

    @nn.compact
    def __call__(self, x_BSD):
        c = self.cfg
        dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        wi = self.param("wi", _init(("embed", "mlp")), (c.hidden_size, c.ffn_dim), pdt)
        wo = self.param("wo", _init(("mlp", "embed")), (c.ffn_dim, c.hidden_size), pdt)
        h_BSF = exact_dot(x_BSD.astype(dt), wi.astype(dt))
        if c.enable_bias:
            h_BSF = h_BSF + self.param("bi", _zeros(("mlp",)), (c.ffn_dim,), pdt).astype(dt)
        h_BSF = nn.with_logical_constraint(_activation(c.activation)(h_BSF), ("batch", "length", "mlp"))
        y_BSD = exact_dot(h_BSF, wo.astype(dt))
        if c.enable_bias:
            y_BSD = y_BSD + self.param("bo", _zeros(("embed",)), (c.hidden_size,), pdt).astype(dt)
        return nn.with_logical_constraint(y_BSD, ("batch", "length", "embed"))


class LayerNorm(nn.Module):
    """HF's affine LayerNorm over the "embed" axis; parameters `norm/{scale, bias}` (the layout of Bert's)."""

    cfg: OPTConfig

    @nn.compact
    def __call__(self, x_BSD):
        c = self.cfg
        ones = nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",))
        return nn.LayerNorm(epsilon=c.ln_eps, dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype),
                            scale_init=ones, bias_init=_zeros(("embed",)), name="norm")(x_BSD)


class Layer(nn.Module):
    """One decoder layer (pre- or post-LN); returns the new stream and this layer's keys/values [B, S, H, Dh]."""

    cfg: OPTConfig

    @nn.compact
    def __call__(self, x_BSD, self_mask_SS, cache_k=None, cache_v=None, cache_mask_SM=None):
        c = self.cfg
        attn_ln, mlp_ln = LayerNorm(c, name="attn_ln"), LayerNorm(c, name="mlp_ln")
        pre = c.do_layer_norm_before
        a_BSD, k_BSHd, v_BSHd = Attention(c, name="attn")(attn_ln(x_BSD) if pre else x_BSD, self_mask_SS, cache_k,
                                                          cache_v, cache_mask_SM)
        x_BSD = x_BSD + a_BSD
        if not pre:
            x_BSD = attn_ln(x_BSD)
        x_BSD = x_BSD + Mlp(c, name="mlp")(mlp_ln(x_BSD) if pre else x_BSD)
        if not pre:
            x_BSD = mlp_ln(x_BSD)
        return x_BSD, k_BSHd, v_BSHd


class OPT(nn.Module):
    """OPT causal LM. `__call__(tokens) -> logits[B, S, Vopt]`; `decode(...)` for cached/incremental use."""

    cfg: OPTConfig

    def setup(self):
        c = self.cfg
        pdt = jnp.dtype(c.param_dtype)
        self.embed_tokens = self.param("embed_tokens", _init(("vocab", "embed")), (c.vocab_size, c.embed_dim), pdt)
        self.embed_positions = self.param("embed_positions", _init((None, "embed")),
                                          (c.max_positions + POSITION_OFFSET, c.hidden_size), pdt)
        if c.has_projection:
            self.project_in = self.param("project_in", _init((None, "embed")), (c.embed_dim, c.hidden_size), pdt)
            self.project_out = self.param("project_out", _init(("embed", None)), (c.hidden_size, c.embed_dim), pdt)
        if c.has_final_ln:
            self.final_ln = LayerNorm(c, name="final_ln")
        self.layers = [Layer(c, name=f"layer_{i}") for i in range(c.num_layers)]

    def decode(self, tokens_BS, positions_BS=None, cache: KVCache | None = None, head_ids=None,
               segments_S=None, cache_visible_S=None):
        """Logits for new tokens given a cache of earlier ones, and the new tokens' keys/values.

        tokens_BS: OPT token ids; positions_BS: their 0-based positions (default: `cache.length` + 0..S-1, or
        0..S-1 without a cache; BOS sits at position 0); head_ids int[K]: if given, logits only for these
        vocabulary entries (a restricted vocabulary needs no full-vocabulary head).
        Packing several independent continuations into one row: token s attends causally only to tokens of its own
        segment (`segments_S`, default one segment) and to the first `cache_visible_S[s]` cache slots (default
        `cache.length`).
        Returns (logits[B, S, Vopt or K], KVCache(k, v [L, B, S, H, Dh], length=S)).
        """
        c = self.cfg
        dt = jnp.dtype(c.dtype)
        B, S = tokens_BS.shape
        if positions_BS is None:
            start = 0 if cache is None else cache.length
            positions_BS = jnp.broadcast_to(start + jnp.arange(S), (B, S))
        self_mask_SS = jnp.tril(jnp.ones((S, S), bool))
        if segments_S is not None:
            self_mask_SS &= segments_S[:, None] == segments_S[None, :]
        cache_mask_SM = None
        if cache is not None:
            visible_S = jnp.broadcast_to(cache.length if cache_visible_S is None else cache_visible_S, (S,))
            cache_mask_SM = jnp.arange(cache.k.shape[2])[None, :] < visible_S[:, None]
        x_BSD = jnp.take(self.embed_tokens, tokens_BS, axis=0).astype(dt)
        if c.has_projection:
            x_BSD = exact_dot(x_BSD, self.project_in.astype(dt))
        x_BSD = x_BSD + jnp.take(self.embed_positions, positions_BS + POSITION_OFFSET, axis=0).astype(dt)
        x_BSD = nn.with_logical_constraint(x_BSD, ("batch", "length", "embed"))
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            ck = cv = None
            if cache is not None:
                ck, cv = cache.k[i], cache.v[i]
            x_BSD, k_BSHd, v_BSHd = layer(x_BSD, self_mask_SS, ck, cv, cache_mask_SM)
            ks.append(k_BSHd)
            vs.append(v_BSHd)
        return self.logits(x_BSD, head_ids), KVCache(jnp.stack(ks), jnp.stack(vs), jnp.asarray(S, jnp.int32))

    def logits(self, x_BSD, head_ids=None):
        """Final LN (pre-LN models), project_out (if any), then the tied embeddings (all rows or `head_ids`)."""
        c = self.cfg
        dt = jnp.dtype(c.dtype)
        if c.has_final_ln:
            x_BSD = self.final_ln(x_BSD)
        if c.has_projection:
            x_BSD = exact_dot(x_BSD, self.project_out.astype(dt))
        emb_VD = self.embed_tokens if head_ids is None else jnp.take(self.embed_tokens, head_ids, axis=0)
        return exact_einsum("bsd,vd->bsv", x_BSD, emb_VD.astype(dt))

    def __call__(self, tokens_BS):
        """Full causal forward from position 0: logits[B, S, Vopt]."""
        return self.decode(tokens_BS)[0]


def init_params(cfg: OPTConfig, seed: int = 0) -> dict:
    """HF-style random initialisation (normal 0.02, zero biases, unit LN scales) as a plain dict."""
    init = jax.jit(lambda key: OPT(cfg).init(key, jnp.zeros((1, 1), jnp.int32)))
    return nn.unbox(init(jax.random.PRNGKey(seed))["params"])


def random_params(cfg: OPTConfig, seed: int = 0, std: float = 0.02) -> dict:
    """Every weight and bias ~ N(0, std^2) and LN scales ~ 1 + N(0, std^2) (numpy RNG, float32): a random model
    with sharper conditionals than `init_params` for tests (std ~ 0.3 makes every token matter)."""
    shapes = jax.eval_shape(lambda: nn.unbox(OPT(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes["params"])
    rng = np.random.default_rng(seed)
    out = []
    for path, x in leaves:
        noise = (std * rng.standard_normal(x.shape)).astype(np.dtype(cfg.param_dtype))
        out.append(jnp.asarray(1.0 + noise if jax.tree_util.keystr(path).endswith("['scale']") else noise))
    return jax.tree_util.tree_unflatten(treedef, out)


def num_params(params) -> int:
    """Number of scalars in a parameter tree (HF counts: 125M -> 125,239,296)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))
