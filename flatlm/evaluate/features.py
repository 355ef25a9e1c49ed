"""Frozen features of a model for the linear probe: every token's final hidden state, concatenated.

The paper's linear probe (appendix A.4) represents a sentence by the concatenation of all its tokens' contextual
embeddings, x = [h_1; ...; h_T] in R^{T*D} (the released code concatenates all positions, padding included),
optionally through a fixed random Gaussian projection to 512 dimensions. The model is named by its Flax
`apply_fn` (e.g. `Bert(cfg).apply`), whose `features` method gives the hidden states [B, T, D].
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

ApplyFn = Callable[..., jax.Array]  # a Flax `model.apply`: apply_fn({"params": p}, tokens_BT, method="features")


def hidden_states(apply_fn: ApplyFn, params, tokens_BT, layer: int | None = None) -> jax.Array:
    """Final hidden states [B, T, D] of tokens int32[B, T] (dropout off): the frozen encoder's output; with
    `layer=k`, the k-th layer's (1-based), for a probe of an inner layer."""
    if layer is None:
        return apply_fn({"params": params}, tokens_BT, method="features")
    return apply_fn({"params": params}, tokens_BT, method="features", num_layers=layer)


def gaussian_projection(in_dim: int, out_dim: int, seed: int) -> jax.Array:
    """Fixed random projection [in_dim, out_dim] with N(0, 1/out_dim) entries (norm-preserving on average).

    The paper's capacity-controlled probe projects the concatenated embeddings to 512 dimensions (A.4).
    Deterministic given (in_dim, out_dim, seed): threefry keys give the same matrix on every backend.
    """
    return jax.random.normal(jax.random.key(seed), (in_dim, out_dim), jnp.float32) / math.sqrt(out_dim)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _features_step(apply_fn: ApplyFn, params, tokens_BT, proj_FP, layer):
    h_BTD = hidden_states(apply_fn, params, tokens_BT, layer)
    x_BF = h_BTD.reshape(h_BTD.shape[0], -1).astype(jnp.float32)
    return x_BF if proj_FP is None else x_BF @ proj_FP


def extract_features(
    apply_fn: ApplyFn,
    params,
    tokens_NT,
    *,
    batch_size: int = 1024,
    projection_dim: int = 0,
    projection_seed: int = 0,
    progress: bool = True,
    desc: str = "features",
    layer: int | None = None,
) -> np.ndarray:
    """Concatenated per-token features float32[N, T*D] (or [N, projection_dim]; 0 = none) on the host, of the
    last layer's hidden states (the paper's) or, with `layer=k`, the k-th's.

    Runs the model's `features` jitted over batches of exactly `batch_size` rows (the last one padded by repeating
    its final row), so splits of any size share one compile; the next batch is dispatched before the previous one
    is copied back. `apply_fn` is a static jit argument: pass the same model's `apply` across calls to reuse the
    compile (bound methods compare by their module's identity, so an equal but separate module recompiles).
    """
    tokens_NT = np.asarray(tokens_NT, dtype=np.int32)
    n = tokens_NT.shape[0]
    if n == 0:
        raise ValueError("extract_features: no examples")
    bs = batch_size
    proj_FP = None
    if projection_dim:
        one_T = jax.ShapeDtypeStruct((1, tokens_NT.shape[1]), jnp.int32)
        in_dim = math.prod(jax.eval_shape(functools.partial(hidden_states, apply_fn, layer=layer), params,
                                          one_T).shape[1:])
        proj_FP = gaussian_projection(in_dim, projection_dim, projection_seed)
    out_NF = None
    pending = None  # (start, stop, device array) of the batch in flight
    starts = range(0, n, bs)
    for start in tqdm(starts, desc=desc, disable=not progress, leave=False):
        stop = min(start + bs, n)
        batch_BT = tokens_NT[start:stop]
        if stop - start < bs:
            batch_BT = np.concatenate([batch_BT, np.repeat(batch_BT[-1:], bs - (stop - start), axis=0)])
        x_BF = _features_step(apply_fn, params, batch_BT, proj_FP, layer)
        if pending is not None:
            out_NF = _store(out_NF, n, *pending)
        pending = (start, stop, x_BF)
    return _store(out_NF, n, *pending)


def _store(out_NF, n, start, stop, x_BF):
    x_BF = np.asarray(x_BF)
    if out_NF is None:
        out_NF = np.empty((n, x_BF.shape[1]), np.float32)
    out_NF[start:stop] = x_BF[: stop - start]
    return out_NF
