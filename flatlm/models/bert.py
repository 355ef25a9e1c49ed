"""BERT-style MLM encoder (pre-LN or post-LN), tied input/output embeddings, logits over the V words only.

Parameter tree (plain nested dict after `nn.unbox`):
  tok_embed[Vtot, D], pos_embed[L, D], embed_ln (post-LN only),
  layer_{i}/{attn_ln, attn/{qkv[D, 3, H, Dh], qkv_bias[3, H, Dh], out[H, Dh, D], out_bias[D]},
             mlp_ln, mlp/{wi[D, F], bi[F], wo[F, D], bo[D]}},
  final_ln (pre-LN only), head_dense[D, D], head_dense_bias[D], head_ln, head_bias[V];
  each LayerNorm holds norm/{scale[D], bias[D]}.
In post-LN layers `attn_ln` / `mlp_ln` are applied after the residual sum, as in the original BERT.
Every parameter carries logical axis names ("vocab", "embed", "heads", "kv", "mlp") that
`flatlm.sharding` maps onto mesh axes, so the same code runs data-, FSDP- or tensor-parallel.

Speed on CPU (see benchmarks/train_step.py): dense layers are 2-D matmuls over the B*T rows, so XLA computes
their weight gradients without transposing activations first; dropout masks are a keyed hash of the element
index that fuses into its consumer, instead of jax.random's threefry (a loop over the whole tensor on CPU)."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from flatlm.languages.base import special_ids

# The nine model shapes of the paper's Table 3 (A.3; Section 3's transformers), name: (num_layers, d_model).
# Heads d_model / 64 (head size 64) and d-inter 4 d_model, as the table prints: 64/1/1/256 ... 1536/24/24/6144.
TABLE3: dict[str, tuple[int, int]] = {
    "L1-H64": (1, 64),
    "L4-H128": (4, 128),
    "L5-H192": (5, 192),
    "L6-H256": (6, 256),
    "L8-H512": (8, 512),
    "L12-H768": (12, 768),
    "L16-H1024": (16, 1024),
    "L20-H1280": (20, 1280),
    "L24-H1536": (24, 1536),
}

# The seven shapes of the paper's Table 4 (B.3; Figure 5): every width divides the largest one's 1920, so each
# model embeds into L20-H1920 by function-preserving growth (B.4). Heads d_model / 64 as printed. The table's
# d-inter column repeats Table 3's (512, 768, 1024, 2048, 3072, 4096, 5120), which is not 4 d_model for five of the
# seven rows and cannot be embedded by duplication (5120 / 768 is not an integer); flatlm uses d-inter = 4 d_model,
# as B.4's text states ("the intermediate layer in the MLP is set to 4 d_h"). Printed column kept below.
TABLE4: dict[str, tuple[int, int]] = {
    "L4-H128": (4, 128),
    "L5-H192": (5, 192),
    "L6-H320": (6, 320),
    "L7-H384": (7, 384),
    "L12-H640": (12, 640),
    "L16-H960": (16, 960),
    "L20-H1920": (20, 1920),
}
TABLE4_D_INTER_PRINTED: tuple[int, ...] = (512, 768, 1024, 2048, 3072, 4096, 5120)
TABLE4_TARGET = "L20-H1920"  # the largest Table 4 shape: Figure 5 measures Tr(H) of every model grown into it

# Every named shape a config may select with `model.shape` (Table 3 and Table 4 share L4-H128 and agree on it).
SHAPES: dict[str, tuple[int, int]] = {**TABLE3, **TABLE4}


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Shape and options of the encoder. `num_words` is the language's V; ids V.. are pad, mask, cls."""

    num_words: int
    max_len: int
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 0  # 0 -> d_model // 64 (head size 64, as in the paper), at least 1
    d_ff: int = 0  # 0 -> 4 * d_model
    ln_mode: str = "pre"  # "pre" | "post"
    dropout: float = 0.1
    attention_dropout: float = 0.1
    gelu_approximate: bool = True  # tanh GELU; False gives BERT's exact erf GELU (slower on CPU)
    ln_eps: float = 1e-12
    dtype: str = "float32"  # activation/compute dtype
    param_dtype: str = "float32"

    @property
    def heads(self) -> int:
        """Number of attention heads (0 in the config: head size 64, at least 1)."""
        return self.num_heads or max(1, self.d_model // 64)

    @property
    def head_dim(self) -> int:
        """Per-head size d_model / heads."""
        return self.d_model // self.heads

    @property
    def ff(self) -> int:
        """MLP hidden size (0 in the config: 4 * d_model)."""
        return self.d_ff or 4 * self.d_model

    @property
    def vocab_size(self) -> int:
        """Embedding rows: the V words plus pad, mask and cls."""
        return special_ids(self.num_words).vocab_size

    @classmethod
    def from_shape(cls, name: str, **kw) -> BertConfig:
        """The config of a paper Table 3 (A.3) or Table 4 (B.3) shape by name, e.g. "L4-H128"."""
        if name not in SHAPES:
            raise KeyError(f"unknown Table 3/4 shape {name!r}; choose one of {', '.join(SHAPES)}")
        layers, d = SHAPES[name]
        return cls(num_layers=layers, d_model=d, **kw)


def _mix32(x):
    """murmur3's 32-bit finalizer: a bijection on uint32 with full avalanche."""
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _keep_mask(key, rate: float, shape) -> jax.Array:
    """bool[shape], True with probability 1 - rate: a keyed counter hash of each element's global index.

    Elementwise in the index, so XLA fuses it into the consumer (no random tensor in memory) and the mask does
    not depend on how the array is sharded.
    """
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    k = key.reshape(-1)[:2].astype(jnp.uint32)
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
        stride *= shape[d]
    bits = _mix32(_mix32(idx ^ k[0]) + k[1])
    return bits >= jnp.uint32(min(int(round(rate * 2**32)), 2**32 - 1))


class Dropout(nn.Module):
    """`nn.Dropout`'s semantics (the "dropout" rng stream, keep with probability 1 - rate, scale by 1 / (1 - rate))
    with a hashed mask: cheap on CPU, and the same mask on every mesh."""

    rate: float

    @nn.compact
    def __call__(self, x, deterministic: bool):
        if deterministic or self.rate == 0.0:
            return x
        if self.rate >= 1.0:
            return jnp.zeros_like(x)
        keep = _keep_mask(self.make_rng("dropout"), self.rate, x.shape)
        return jnp.where(keep, x / jnp.asarray(1.0 - self.rate, x.dtype), jnp.zeros((), x.dtype))


def _dense(x_BTK, w_KN, dt):
    """x[..., K] @ w[K, N] as one 2-D matmul over the flattened leading axes: [prod(...), N]."""
    return x_BTK.reshape(-1, x_BTK.shape[-1]).astype(dt) @ w_KN.astype(dt)


def _init(names, scale=0.02):
    return nn.with_logical_partitioning(nn.initializers.normal(scale), names)


def _zeros(names):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


class LayerNorm(nn.Module):
    """LayerNorm with logically-annotated scale/bias over the "embed" axis."""

    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        return nn.LayerNorm(
            epsilon=self.eps,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
            bias_init=_zeros(("embed",)),
            name="norm",
        )(x)


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection; `bias_BHTT` masks padding."""
    cfg: BertConfig

    @nn.compact
    def __call__(self, x_BTD, bias_BHTT, deterministic: bool):
        c = self.cfg
        dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        H, Dh, D = c.heads, c.head_dim, c.d_model
        qkv = self.param("qkv", _init(("embed", None, "heads", "kv")), (D, 3, H, Dh), pdt)
        qkv_b = self.param("qkv_bias", _zeros((None, "heads", "kv")), (3, H, Dh), pdt)
        out = self.param("out", _init(("heads", "kv", "embed")), (H, Dh, D), pdt)
        out_b = self.param("out_bias", _zeros(("embed",)), (D,), pdt)
        B, T = x_BTD.shape[:2]
        # Dense layers as 2-D matmuls over the N = B*T rows: the weight gradient is then x_NK^T g_NJ, one dot
        # with a single contracting axis, which XLA's CPU backend runs without transposing x or g first.
        qkv_NJ = _dense(x_BTD, qkv.reshape(D, 3 * H * Dh), dt) + qkv_b.reshape(3 * H * Dh).astype(dt)
        qkv_BTKHd = qkv_NJ.reshape(B, T, 3, H, Dh)
        q_BTHd, k_BTHd, v_BTHd = qkv_BTKHd[:, :, 0], qkv_BTKHd[:, :, 1], qkv_BTKHd[:, :, 2]
        s_BHTS = jnp.einsum("bthe,bshe->bhts", q_BTHd, k_BTHd) / math.sqrt(Dh) + bias_BHTT
        p_BHTS = jax.nn.softmax(s_BHTS.astype(jnp.promote_types(s_BHTS.dtype, jnp.float32)), axis=-1).astype(dt)
        p_BHTS = Dropout(c.attention_dropout)(p_BHTS, deterministic=deterministic)
        o_BTHd = jnp.einsum("bhts,bshe->bthe", p_BHTS, v_BTHd)
        y_ND = _dense(o_BTHd.reshape(B, T, H * Dh), out.reshape(H * Dh, D), dt) + out_b.astype(dt)
        y_BTD = y_ND.reshape(B, T, D)
        return nn.with_logical_constraint(y_BTD, ("batch", "length", "embed"))


class Mlp(nn.Module):
    """The block's position-wise MLP: dense, GELU, dense (dropout after)."""
    cfg: BertConfig

    @nn.compact
    def __call__(self, x_BTD, deterministic: bool):
        c = self.cfg
        dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        wi = self.param("wi", _init(("embed", "mlp")), (c.d_model, c.ff), pdt)
        bi = self.param("bi", _zeros(("mlp",)), (c.ff,), pdt)
        wo = self.param("wo", _init(("mlp", "embed")), (c.ff, c.d_model), pdt)
        bo = self.param("bo", _zeros(("embed",)), (c.d_model,), pdt)
        B, T = x_BTD.shape[:2]
        h_NF = jax.nn.gelu(_dense(x_BTD, wi, dt) + bi.astype(dt), approximate=c.gelu_approximate)
        h_BTF = nn.with_logical_constraint(h_NF.reshape(B, T, c.ff), ("batch", "length", "mlp"))
        # wo enters transposed behind an optimisation barrier (which XLA cannot fold the transpose through), so
        # its gradient is the dot g^T h [D, F] over the N = B*T rows: XLA:CPU runs it ~1.5x faster than h^T g
        # [F, D] (321 vs 206 GFLOP/s at L6-H256, N = 8192): -40 ms of a 900 ms step. The parameter stays [F, D];
        # the barrier is differentiable (forward-over-reverse HVPs included) and the maths unchanged.
        wo_DF = jax.lax.optimization_barrier(wo.T.astype(dt))
        y_ND = jax.lax.dot_general(h_BTF.reshape(-1, c.ff).astype(dt), wo_DF, (((1,), (1,)), ((), ())))
        y_BTD = (y_ND + bo.astype(dt)).reshape(B, T, c.d_model)
        return nn.with_logical_constraint(y_BTD, ("batch", "length", "embed"))


class Layer(nn.Module):
    """One transformer block, pre- or post-LN (`cfg.ln_mode`)."""
    cfg: BertConfig

    @nn.compact
    def __call__(self, x_BTD, bias_BHTT, deterministic: bool):
        c = self.cfg
        ln = lambda name: LayerNorm(c.ln_eps, jnp.dtype(c.dtype), jnp.dtype(c.param_dtype), name=name)
        drop = lambda y: Dropout(c.dropout)(y, deterministic=deterministic)
        attn, mlp = Attention(c, name="attn"), Mlp(c, name="mlp")
        if c.ln_mode == "pre":
            x_BTD = x_BTD + drop(attn(ln("attn_ln")(x_BTD), bias_BHTT, deterministic))
            return x_BTD + drop(mlp(ln("mlp_ln")(x_BTD), deterministic))
        x_BTD = ln("attn_ln")(x_BTD + drop(attn(x_BTD, bias_BHTT, deterministic)))
        return ln("mlp_ln")(x_BTD + drop(mlp(x_BTD, deterministic)))


def check_depth(num_layers: int | None, total: int) -> int:
    """How many layers `features(..., num_layers=)` runs: all for None, else 1 <= num_layers <= total."""
    if num_layers is None:
        return total
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers={num_layers}: the model has layers 1..{total}")
    return num_layers


def at_positions(h_BTD, positions_BP):
    """h[b, positions[b, p]] as [B, P, D] (h itself when positions is None)."""
    return h_BTD if positions_BP is None else jnp.take_along_axis(h_BTD, positions_BP[..., None], axis=1)


def at_position(h_NTD, positions_N):
    """h[n, positions[n]] as [N, D]: one position per sequence (the exact loss's copies). Plain indexing, not
    `at_positions`: under two processes take_along_axis left the exact loss's result a global array no process
    could fetch (tests/test_multihost.py)."""
    return h_NTD[jnp.arange(h_NTD.shape[0]), positions_N]


class Bert(nn.Module):
    """MLM encoder. `__call__(tokens) -> logits[B, T, V]`; `features(tokens) -> hidden[B, T, D]`."""

    cfg: BertConfig

    def setup(self):
        c = self.cfg
        pdt = jnp.dtype(c.param_dtype)
        self.tok_embed = self.param("tok_embed", _init(("vocab", "embed")), (c.vocab_size, c.d_model), pdt)
        self.pos_embed = self.param("pos_embed", _init((None, "embed")), (c.max_len, c.d_model), pdt)
        ln = lambda name: LayerNorm(c.ln_eps, jnp.dtype(c.dtype), pdt, name=name)
        if c.ln_mode == "post":
            self.embed_ln = ln("embed_ln")
        else:
            self.final_ln = ln("final_ln")
        self.layers = [Layer(c, name=f"layer_{i}") for i in range(c.num_layers)]
        self.head_dense = self.param("head_dense", _init(("embed", "embed_out")), (c.d_model, c.d_model), pdt)
        self.head_dense_bias = self.param("head_dense_bias", _zeros(("embed_out",)), (c.d_model,), pdt)
        self.head_ln = ln("head_ln")
        self.head_bias = self.param("head_bias", _zeros(("vocab",)), (c.num_words,), pdt)
        self.drop = Dropout(c.dropout)

    def features(self, tokens_BT, deterministic: bool = True, num_layers: int | None = None):
        """Per-token hidden states [B, T, D] after the last layer (and the final LN for pre-LN). With
        `num_layers=k`, the residual stream after the k-th layer (1-based; `eval.probe.layers`); pre-LN applies its
        final LN only after the last layer, where the model's head reads it."""
        c = self.cfg
        dt = jnp.dtype(c.dtype)
        if c.ln_mode not in ("pre", "post"):
            raise ValueError(f"ln_mode must be 'pre' or 'post', got {c.ln_mode!r}")
        T = tokens_BT.shape[1]
        x_BTD = jnp.take(self.tok_embed, tokens_BT, axis=0).astype(dt) + self.pos_embed[:T].astype(dt)
        x_BTD = nn.with_logical_constraint(x_BTD, ("batch", "length", "embed"))
        if c.ln_mode == "post":
            x_BTD = self.embed_ln(x_BTD)
        x_BTD = self.drop(x_BTD, deterministic=deterministic)
        pad = special_ids(c.num_words).pad
        bias_B11T = jnp.where(tokens_BT == pad, jnp.finfo(dt).min, 0.0).astype(dt)[:, None, None, :]
        depth = check_depth(num_layers, c.num_layers)
        for layer in self.layers[:depth]:
            x_BTD = layer(x_BTD, bias_B11T, deterministic)
        if c.ln_mode == "pre" and depth == c.num_layers:
            x_BTD = self.final_ln(x_BTD)
        return x_BTD

    def logits(self, h_BTD):
        """MLM head: dense + GELU + LN, then the tied word embeddings (words only) + bias."""
        c = self.cfg
        dt = jnp.dtype(c.dtype)
        lead = h_BTD.shape[:-1]
        h_ND = jax.nn.gelu(_dense(h_BTD, self.head_dense, dt) + self.head_dense_bias.astype(dt),
                           approximate=c.gelu_approximate)
        h_ND = self.head_ln(h_ND)
        words_VD = self.tok_embed[: c.num_words].astype(dt)
        logits_NV = jnp.einsum("nd,vd->nv", h_ND, words_VD) + self.head_bias.astype(dt)
        return logits_NV.reshape(*lead, c.num_words)

    def logits_at(self, tokens_NT, positions_N):
        """MLM logits [N, V] at one position per sequence: the head runs only there (exact loss, A.5)."""
        return self.logits(at_position(self.features(tokens_NT), positions_N))

    def __call__(self, tokens_BT, deterministic: bool = True, positions_BP=None):
        """MLM logits [B, T, V] over the language's words (dropout on iff not `deterministic`); with
        `positions_BP` only at those positions, [B, P, V] (`losses.mlm_loss`: the head skips unpredicted tokens)."""
        return self.logits(at_positions(self.features(tokens_BT, deterministic), positions_BP))
