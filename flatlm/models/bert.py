"""BERT-style MLM encoder (pre-LN or post-LN), tied input/output embeddings, logits over the V words only.

Parameter tree (plain nested dict after `nn.unbox`):
  embed/{tokens[Vtot, D], positions[L, D]}, embed_ln (post-LN only),
  layer_{i}/{attn_ln, attn/{qkv[D, 3, H, Dh], qkv_bias[3, H, Dh], out[H, Dh, D], out_bias[D]},
             mlp_ln, mlp/{wi[D, F], bi[F], wo[F, D], bo[D]}},
  final_ln (pre-LN only), head/{dense[D, D], dense_bias[D], ln, bias[V]}.
In post-LN layers `attn_ln` / `mlp_ln` are applied after the residual sum, as in the original BERT.
Every parameter carries logical axis names ("vocab", "embed", "heads", "kv", "mlp") that
`flatlm.sharding` maps onto mesh axes, so the same code runs data-, FSDP- or tensor-parallel.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from flatlm.languages.base import special_ids

# The nine model shapes of the paper's Table 3, head size 64 (d_model 64..1536, 1..24 layers).
TABLE3: dict[str, tuple[int, int]] = {
    # name: (num_layers, d_model)
    "L1-H64": (1, 64),
    "L2-H128": (2, 128),
    "L4-H128": (4, 128),
    "L4-H256": (4, 256),
    "L4-H512": (4, 512),
    "L8-H512": (8, 512),
    "L12-H768": (12, 768),
    "L16-H1024": (16, 1024),
    "L24-H1536": (24, 1536),
}


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
        return self.num_heads or max(1, self.d_model // 64)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def vocab_size(self) -> int:
        return special_ids(self.num_words).vocab_size

    @classmethod
    def from_table3(cls, name: str, **kw) -> BertConfig:
        if name not in TABLE3:
            raise KeyError(f"unknown Table 3 shape {name!r}; choose one of {', '.join(TABLE3)}")
        layers, d = TABLE3[name]
        return cls(num_layers=layers, d_model=d, **kw)


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
        qkv_BTKHd = jnp.einsum("btd,dkhe->btkhe", x_BTD.astype(dt), qkv.astype(dt)) + qkv_b.astype(dt)
        q_BTHd, k_BTHd, v_BTHd = qkv_BTKHd[:, :, 0], qkv_BTKHd[:, :, 1], qkv_BTKHd[:, :, 2]
        s_BHTS = jnp.einsum("bthe,bshe->bhts", q_BTHd, k_BTHd) / math.sqrt(Dh) + bias_BHTT
        p_BHTS = jax.nn.softmax(s_BHTS.astype(jnp.float32), axis=-1).astype(dt)
        p_BHTS = nn.Dropout(c.attention_dropout)(p_BHTS, deterministic=deterministic)
        o_BTHd = jnp.einsum("bhts,bshe->bthe", p_BHTS, v_BTHd)
        y_BTD = jnp.einsum("bthe,hed->btd", o_BTHd, out.astype(dt)) + out_b.astype(dt)
        return nn.with_logical_constraint(y_BTD, ("batch", "length", "embed"))


class Mlp(nn.Module):
    cfg: BertConfig

    @nn.compact
    def __call__(self, x_BTD, deterministic: bool):
        c = self.cfg
        dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        wi = self.param("wi", _init(("embed", "mlp")), (c.d_model, c.ff), pdt)
        bi = self.param("bi", _zeros(("mlp",)), (c.ff,), pdt)
        wo = self.param("wo", _init(("mlp", "embed")), (c.ff, c.d_model), pdt)
        bo = self.param("bo", _zeros(("embed",)), (c.d_model,), pdt)
        h_BTF = jax.nn.gelu(x_BTD.astype(dt) @ wi.astype(dt) + bi.astype(dt), approximate=c.gelu_approximate)
        h_BTF = nn.with_logical_constraint(h_BTF, ("batch", "length", "mlp"))
        y_BTD = h_BTF @ wo.astype(dt) + bo.astype(dt)
        return nn.with_logical_constraint(y_BTD, ("batch", "length", "embed"))


class Layer(nn.Module):
    cfg: BertConfig

    @nn.compact
    def __call__(self, x_BTD, bias_BHTT, deterministic: bool):
        c = self.cfg
        ln = lambda name: LayerNorm(c.ln_eps, jnp.dtype(c.dtype), jnp.dtype(c.param_dtype), name=name)
        drop = lambda y: nn.Dropout(c.dropout)(y, deterministic=deterministic)
        attn, mlp = Attention(c, name="attn"), Mlp(c, name="mlp")
        if c.ln_mode == "pre":
            x_BTD = x_BTD + drop(attn(ln("attn_ln")(x_BTD), bias_BHTT, deterministic))
            return x_BTD + drop(mlp(ln("mlp_ln")(x_BTD), deterministic))
        x_BTD = ln("attn_ln")(x_BTD + drop(attn(x_BTD, bias_BHTT, deterministic)))
        return ln("mlp_ln")(x_BTD + drop(mlp(x_BTD, deterministic)))


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
        self.drop = nn.Dropout(c.dropout)

    def features(self, tokens_BT, deterministic: bool = True):
        """Per-token hidden states [B, T, D] after the last layer (and the final LN for pre-LN)."""
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
        for layer in self.layers:
            x_BTD = layer(x_BTD, bias_B11T, deterministic)
        if c.ln_mode == "pre":
            x_BTD = self.final_ln(x_BTD)
        return x_BTD

    def logits(self, h_BTD):
        """MLM head: dense + GELU + LN, then the tied word embeddings (words only) + bias."""
        c = self.cfg
        dt = jnp.dtype(c.dtype)
        h = jax.nn.gelu(h_BTD @ self.head_dense.astype(dt) + self.head_dense_bias.astype(dt),
                        approximate=c.gelu_approximate)
        h = self.head_ln(h)
        words_VD = self.tok_embed[: c.num_words].astype(dt)
        return jnp.einsum("btd,vd->btv", h, words_VD) + self.head_bias.astype(dt)

    def __call__(self, tokens_BT, deterministic: bool = True):
        return self.logits(self.features(tokens_BT, deterministic))
