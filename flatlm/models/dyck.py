"""The single-layer transformer of Section 6 (Liu et al. 2023, Thm 6.1), in plain JAX.

f(x) = (1/m) u^T relu(sum_j a_1j V x_j),  a_1. = softmax_j((Q x_1)^T (K x_j)),
x_j in R^{2T} the encodings of `flatlm.languages.dyck`; the attention row is the first position's (the paper's
a_1j), with no 1/sqrt(d) temperature. Parameters are one plain dict {"Q": [d, 2T], "K": [d, 2T], "V": [m, 2T],
"u": [m]}; psi = (Q, K, V) is the feature extractor and u the head. The loss is the squared error
L = sum_b w_b (f(x_b) - y_b)^2 (no 1/2), so at a zero-loss point Tr(H) = 2 E ||grad f||^2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Params = dict[str, jax.Array]
PSI_KEYS = ("Q", "K", "V")


def init_params(key: jax.Array, T: int, m: int, d_attn: int = 0, v_std: float = 1.0, u_std: float = 1.0,
                qk_std: float = 0.1, dtype=None) -> Params:
    """Gaussian init: Q, K ~ N(0, qk_std^2) [d, 2T] (d = d_attn or 2T), V ~ N(0, v_std^2) [m, 2T], u ~ N(0, u_std^2)."""
    d = d_attn or 2 * T
    dtype = dtype or jnp.zeros(()).dtype  # float64 under enable_x64, float32 otherwise
    kq, kk, kv, ku = jax.random.split(key, 4)
    return {
        "Q": qk_std * jax.random.normal(kq, (d, 2 * T), dtype),
        "K": qk_std * jax.random.normal(kk, (d, 2 * T), dtype),
        "V": v_std * jax.random.normal(kv, (m, 2 * T), dtype),
        "u": u_std * jax.random.normal(ku, (m,), dtype),
    }


def attention(params: Params, x_BTD: jax.Array) -> jax.Array:
    """Attention weights a_BT of the first position over all positions (rows sum to 1)."""
    M_DD = params["Q"].T @ params["K"]  # (Q x_1)^T (K x_j) = x_1^T Q^T K x_j
    q_BD = x_BTD[:, 0, :] @ M_DD
    scores_BT = jnp.einsum("bd,btd->bt", q_BD, x_BTD)
    return jax.nn.softmax(scores_BT, axis=-1)


def pooled(params: Params, x_BTD: jax.Array) -> jax.Array:
    """Attention-pooled input xbar_BD = sum_j a_1j x_j (V is linear, so sum_j a_1j V x_j = V xbar)."""
    return jnp.einsum("bt,btd->bd", attention(params, x_BTD), x_BTD)


def features(params: Params, x_BTD: jax.Array) -> jax.Array:
    """Neuron activations relu(V xbar), [B, m] (the representation the downstream head sees)."""
    return jax.nn.relu(pooled(params, x_BTD) @ params["V"].T)


def apply(params: Params, x_BTD: jax.Array) -> jax.Array:
    """Model output f_B = (1/m) u^T relu(V xbar)."""
    m = params["u"].shape[0]
    return features(params, x_BTD) @ params["u"] / m


def loss(params: Params, batch) -> jax.Array:
    """Weighted squared loss sum_b w_b (f_b - y_b)^2: the population loss for an enumerated batch."""
    err_B = apply(params, batch["x"]) - batch["y"]
    return jnp.sum(batch["w"] * err_B**2)


def flat_loss(unravel, batch):
    """`loss` as a function of one flat parameter vector theta (`unravel` from jax.flatten_util.ravel_pytree):
    Hessians and their traces are taken over all of (Q, K, V, u) at once."""
    return lambda theta: loss(unravel(theta), batch)
