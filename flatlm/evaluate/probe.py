"""Linear probe on frozen features: the paper's downstream metric for a pre-trained checkpoint.

Features are the concatenation of every token's final hidden state, x = [h_1; ...; h_T] in R^{T*D}, as in the
paper and the released code (which concatenates all positions, padding included), optionally through a fixed
random Gaussian projection to 512 dimensions (deterministic given `projection_seed`).
The probe is a softmax-linear head trained with AdamW (lr 1e-3, weight decay 0.01, linear warmup then linear
decay). S seeds train together under `jax.vmap` (one compile; heads stacked [S, F, C]); each seed has its own
head init, minibatch order and dropout. Features live on the device, each seed draws a fresh permutation per
epoch, and one jitted call runs a whole epoch as a `lax.scan` over minibatches.

Standardisation (on by default): every feature is shifted and scaled by its mean and std over the *training*
split (constant features are left unscaled), which makes lr 1e-3 work for features of any scale (hidden
states, projections, probabilities). Set `standardize=False` for the released code's raw features.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

FeatureFn = Callable[[Any, jax.Array], jax.Array]  # (params, tokens int32[B, T]) -> hidden [B, T, D]
EVAL_CHUNK = 8192  # examples per chunk when scoring a split (bounds the [S, chunk, C] logits)


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """Linear-probe hyper-parameters. Defaults follow the paper; the released code's values are noted."""

    learning_rate: float = 1e-3
    weight_decay: float = 0.01  # AdamW, decoupled, on weights and bias (torch AdamW default, as released)
    epochs: int = 100  # paper: 100; released script: 50
    batch_size: int = 512  # released: 512
    warmup_steps: int = 50  # released: 50, then linear ("polynomial", power 1) decay
    end_learning_rate: float = 1e-7  # HF polynomial schedule's lr_end
    max_grad_norm: float = 0.0  # 0 = no clipping (the released probe loop does not clip)
    dropout: float = 0.0  # dropout on the features; the released classifier used 0.1
    standardize: bool = True  # see module docstring
    num_seeds: int = 5
    seed: int = 0  # seeds are seed, seed + 1, ..., seed + num_seeds - 1
    projection_dim: int | None = None  # 512 for the paper's projected probe; None = raw T*D features
    projection_seed: int = 0
    head_init_std: float = 0.02  # BERT's init_weights for the classifier

    @property
    def seeds(self) -> list[int]:
        return [self.seed + i for i in range(self.num_seeds)]


class ProbeHeads(NamedTuple):
    """S linear heads in standardised feature space: logits = ((x - mean) / scale) @ w + b."""

    w_SFC: jax.Array
    b_SC: jax.Array
    mean_F: jax.Array
    scale_F: jax.Array


# ----------------------------------------------------------------------------------------------- features


@dataclasses.dataclass(frozen=True)
class ModelFeatures:
    """`FeatureFn` for a Flax module with a `features(tokens)` method (Bert, BiLSTM); hashable by value."""

    model: nn.Module

    def __call__(self, params, tokens_BT):
        return self.model.apply({"params": params}, tokens_BT, method="features")


def model_feature_fn(model: nn.Module) -> FeatureFn:
    """The frozen-feature function of `model`: (params, tokens[B, T]) -> hidden [B, T, D], dropout off."""
    return ModelFeatures(model)


def gaussian_projection(in_dim: int, out_dim: int, seed: int) -> jax.Array:
    """Fixed random projection [in_dim, out_dim] with N(0, 1/out_dim) entries (norm-preserving on average).

    Deterministic given (in_dim, out_dim, seed): threefry keys give the same matrix on every backend.
    """
    return jax.random.normal(jax.random.key(seed), (in_dim, out_dim), jnp.float32) / math.sqrt(out_dim)


@functools.partial(jax.jit, static_argnums=0)
def _features_step(feature_fn: FeatureFn, params, tokens_BT, proj_FP):
    h_BTD = feature_fn(params, tokens_BT)
    x_BF = h_BTD.reshape(h_BTD.shape[0], -1).astype(jnp.float32)
    return x_BF if proj_FP is None else x_BF @ proj_FP


def extract_features(
    feature_fn: FeatureFn,
    params,
    tokens_NT,
    *,
    batch_size: int = 1024,
    projection_dim: int | None = None,
    projection_seed: int = 0,
    progress: bool = True,
    desc: str = "features",
) -> np.ndarray:
    """Concatenated per-token features float32[N, T*D] (or [N, projection_dim]) on the host.

    Runs `feature_fn` jitted over batches of exactly `batch_size` rows (the last one padded by repeating its
    final row), so splits of any size share one compile; the next batch is dispatched before the previous one
    is copied back. `feature_fn` is a static jit argument: pass the same (hashable) function across calls
    (e.g. one `model_feature_fn(model)`; equal models give equal functions) to reuse the compile.
    """
    tokens_NT = np.asarray(tokens_NT, dtype=np.int32)
    n = tokens_NT.shape[0]
    if n == 0:
        raise ValueError("extract_features: no examples")
    bs = batch_size
    proj_FP = None
    if projection_dim is not None:
        one_T = jax.ShapeDtypeStruct((1, tokens_NT.shape[1]), jnp.int32)
        in_dim = math.prod(jax.eval_shape(feature_fn, params, one_T).shape[1:])
        proj_FP = gaussian_projection(in_dim, projection_dim, projection_seed)
    out_NF = None
    pending = None  # (start, stop, device array) of the batch in flight
    starts = range(0, n, bs)
    for start in tqdm(starts, desc=desc, disable=not progress, leave=False):
        stop = min(start + bs, n)
        batch_BT = tokens_NT[start:stop]
        if stop - start < bs:
            batch_BT = np.concatenate([batch_BT, np.repeat(batch_BT[-1:], bs - (stop - start), axis=0)])
        x_BF = _features_step(feature_fn, params, batch_BT, proj_FP)
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


def fingerprint(*arrays) -> str:
    """sha1 of the arrays' shapes, dtypes and bytes: detects a cache file made from different inputs."""
    h = hashlib.sha1()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def feature_cache_path(cache_dir: str, step: int | str, split: str, projection_dim: int | None,
                       projection_seed: int = 0) -> str:
    """File of the cached features for (checkpoint step, split, projection) in `cache_dir`."""
    proj = "full" if projection_dim is None else f"proj{projection_dim}-seed{projection_seed}"
    return os.path.join(cache_dir, f"features-step{step}-{split}-{proj}.npz")


def save_npz_atomic(path: str, **arrays) -> None:
    """np.savez to a temporary file in the same folder, then os.replace: readers never see a partial file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_or_compute(path: str, key: str, compute: Callable[[], np.ndarray]) -> np.ndarray:
    """The array cached at `path` if its stored fingerprint equals `key`, else `compute()` (then cached)."""
    if os.path.exists(path):
        try:
            with np.load(path) as f:
                if str(f["fingerprint"]) == key:
                    return f["features"]
        except (OSError, KeyError, ValueError):
            pass  # unreadable or foreign file: recompute and overwrite
    x = compute()
    save_npz_atomic(path, features=x, fingerprint=np.array(key))
    return x


def cached_features(
    cache_dir: str | None,
    feature_fn: FeatureFn,
    params,
    tokens_NT,
    *,
    step: int | str,
    split: str,
    batch_size: int = 1024,
    projection_dim: int | None = None,
    projection_seed: int = 0,
    progress: bool = True,
) -> np.ndarray:
    """`extract_features`, cached in `cache_dir` under (step, split, projection); None = no cache.

    The file also stores a fingerprint of the tokens, so different inputs under the same key are recomputed.
    The key does not identify the model: keep one cache folder per training run (e.g. its workdir).
    """
    compute = lambda: extract_features(
        feature_fn, params, tokens_NT, batch_size=batch_size, projection_dim=projection_dim,
        projection_seed=projection_seed, progress=progress, desc=f"features {split}")
    if cache_dir is None:
        return compute()
    path = feature_cache_path(cache_dir, step, split, projection_dim, projection_seed)
    return load_or_compute(path, fingerprint(np.asarray(tokens_NT, np.int32)), compute)


# ----------------------------------------------------------------------------------------------- training


def warmup_linear_decay(peak: float, warmup_steps: int, total_steps: int, end: float = 0.0) -> optax.Schedule:
    """0 -> peak linearly over `warmup_steps`, then linearly to `end` at `total_steps` (HF 'polynomial')."""
    warmup_steps = max(0, min(warmup_steps, total_steps))
    decay = optax.linear_schedule(peak, end, max(1, total_steps - warmup_steps))
    if warmup_steps == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup_steps), decay], [warmup_steps])


def summarize(per_seed) -> dict:
    """{"mean", "std", "per_seed"} of per-seed values (std over seeds with ddof=0, as np.std)."""
    v = np.asarray(per_seed, np.float64)
    return {"mean": float(v.mean()), "std": float(v.std()), "per_seed": [float(a) for a in v]}


@functools.partial(jax.jit, static_argnums=1)
def _standardizer(x_NF, enabled: bool):
    """Per-feature mean and scale over the rows of x (std; 1 where a feature is constant); 0 and 1 if off."""
    if not enabled:
        f = x_NF.shape[1]
        return jnp.zeros((f,), jnp.float32), jnp.ones((f,), jnp.float32)
    mean_F = jnp.mean(x_NF, axis=0)
    std_F = jnp.sqrt(jnp.mean(jnp.square(x_NF - mean_F), axis=0))
    return mean_F, jnp.where(std_F > 1e-6, std_F, 1.0)


@jax.jit
def _standardize(x_NF, mean_F, scale_F):
    return (jnp.asarray(x_NF, jnp.float32) - mean_F) / scale_F


def _masked_ce(logits_BC, y_B, w_B):
    logp_BC = jax.nn.log_softmax(logits_BC, axis=-1)
    nll_B = -jnp.take_along_axis(logp_BC, y_B[:, None], axis=-1)[:, 0]
    return jnp.sum(nll_B * w_B) / jnp.maximum(jnp.sum(w_B), 1.0)


def epoch_indices(key, epoch, n: int, batch_size: int):
    """This seed's minibatch indices int32[steps, B] for `epoch`; the tail batch is padded with index 0."""
    steps = -(-n // batch_size)
    perm_N = jax.random.permutation(jax.random.fold_in(key, epoch), n)
    perm_N = jnp.concatenate([perm_N, jnp.zeros((steps * batch_size - n,), perm_N.dtype)])
    return perm_N.reshape(steps, batch_size)


def _probe_optimizer(c: ProbeConfig, n: int) -> optax.GradientTransformation:
    """AdamW with warmup + linear decay over `epochs` passes of n examples (a pure function of its args)."""
    steps = -(-n // min(c.batch_size, n))
    schedule = warmup_linear_decay(c.learning_rate, c.warmup_steps, steps * c.epochs, c.end_learning_rate)
    tx = optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=c.weight_decay)
    return optax.chain(optax.clip_by_global_norm(c.max_grad_norm), tx) if c.max_grad_norm > 0 else tx


def _probe_loss(head, x_BF, y_B, w_B, key, dropout: float):
    if dropout > 0:
        keep_BF = jax.random.bernoulli(key, 1.0 - dropout, x_BF.shape)
        x_BF = jnp.where(keep_BF, x_BF / (1.0 - dropout), 0.0)
    # head["w"] is [C, F]: contracting F against the rows of x makes the weight gradient g^T x, a plain
    # matmul, where [F, C] gives x^T g with a transposed [B, F] operand (3x slower on CPU).
    return _masked_ce(jnp.einsum("bf,cf->bc", x_BF, head["w"]) + head["b"], y_B, w_B)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnums=(0, 1))
def _probe_epoch(head_S, opt_S, x_NF, y_N, perm_keys_S, drop_keys_S, epoch, *, config: ProbeConfig):
    """One epoch of every seed's head: a lax.scan over minibatches, vmapped over seeds.

    Module-level and keyed on (config, shapes), so probes of many checkpoints share one compile.
    """
    c = config
    n = x_NF.shape[0]
    bs = min(c.batch_size, n)
    steps = -(-n // bs)
    tx = _probe_optimizer(c, n)
    w_XB = (jnp.arange(steps * bs) < n).astype(jnp.float32).reshape(steps, bs)
    idx_SXB = jax.vmap(epoch_indices, (0, None, None, None))(perm_keys_S, epoch, n, bs)
    ekeys_S = jax.vmap(jax.random.fold_in, (0, None))(drop_keys_S, epoch)

    def seed_step(head, opt, idx_B, w_B, key):
        loss, g = jax.value_and_grad(_probe_loss)(head, x_NF[idx_B], y_N[idx_B], w_B, key, c.dropout)
        updates, opt = tx.update(g, opt, head)
        return optax.apply_updates(head, updates), opt, loss

    def body(carry, inp):
        head_S, opt_S = carry
        idx_SB, w_B, t = inp
        skeys_S = jax.vmap(jax.random.fold_in, (0, None))(ekeys_S, t)
        head_S, opt_S, loss_S = jax.vmap(seed_step, (0, 0, 0, None, 0))(head_S, opt_S, idx_SB, w_B, skeys_S)
        return (head_S, opt_S), loss_S

    (head_S, opt_S), loss_XS = jax.lax.scan(
        body, (head_S, opt_S), (jnp.swapaxes(idx_SXB, 0, 1), w_XB, jnp.arange(steps)))
    return head_S, opt_S, jnp.mean(loss_XS, axis=0)


def fit_heads(x_NF, y_N, config: ProbeConfig, *, num_classes: int, seeds: list[int] | None = None,
              progress: bool = True, on_epoch: Callable[[int, jax.Array], None] | None = None,
              ) -> tuple[ProbeHeads, np.ndarray]:
    """Train one linear head per seed (vmapped) on features x float[N, F], labels y int[N].

    Returns the stacked heads and the per-epoch mean training loss float[S, epochs] (nats).
    Seed s's result does not depend on which other seeds run beside it (up to float rounding).
    `on_epoch(epoch, loss_S)`, if given, is called after each epoch is dispatched (loss_S may still be in
    flight; blocking on it costs the overlap of host and device).
    """
    c = config
    seeds = c.seeds if seeds is None else list(seeds)
    x_NF = jnp.asarray(x_NF, jnp.float32)
    y_N = jnp.asarray(y_N, jnp.int32)
    n, f = x_NF.shape
    mean_F, scale_F = _standardizer(x_NF, c.standardize)
    if c.standardize:
        x_NF = _standardize(x_NF, mean_F, scale_F)

    keys_S = jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))
    init_keys, perm_keys, drop_keys = (jax.vmap(jax.random.fold_in, (0, None))(keys_S, i) for i in range(3))
    normal = lambda key: jax.random.normal(key, (num_classes, f), jnp.float32)
    head_S = {"w": c.head_init_std * jax.vmap(normal)(init_keys),  # [S, C, F]
              "b": jnp.zeros((len(seeds), num_classes), jnp.float32)}
    opt_S = jax.vmap(_probe_optimizer(c, n).init)(head_S)
    # the epoch function is compiled per (config, shapes): drop the fields it does not read
    epoch_cfg = dataclasses.replace(c, seed=0, num_seeds=1, projection_dim=None, projection_seed=0)

    losses = []
    bar = tqdm(range(c.epochs), desc=f"probe x{len(seeds)} seeds", disable=not progress, leave=False)
    for epoch in bar:
        head_S, opt_S, loss_S = _probe_epoch(head_S, opt_S, x_NF, y_N, perm_keys, drop_keys, epoch,
                                             config=epoch_cfg)
        losses.append(loss_S)
        if on_epoch is not None:
            on_epoch(epoch, loss_S)
        if progress:
            bar.set_postfix(loss=f"{float(jnp.mean(loss_S)):.4f}")
    loss_SE = np.stack([np.asarray(v) for v in losses], axis=1) if losses else np.zeros((len(seeds), 0))
    return ProbeHeads(jnp.swapaxes(head_S["w"], 1, 2), head_S["b"], mean_F, scale_F), loss_SE


@jax.jit
def _correct_chunk(heads: ProbeHeads, x_BF, y_B, valid):
    """Correct predictions per head among the first `valid` rows of a chunk: int[S]."""
    x_BF = (x_BF.astype(jnp.float32) - heads.mean_F) / heads.scale_F
    logits_SBC = jnp.einsum("bf,sfc->sbc", x_BF, heads.w_SFC) + heads.b_SC[:, None, :]
    ok_SB = (jnp.argmax(logits_SBC, axis=-1) == y_B) & (jnp.arange(y_B.shape[0]) < valid)
    return jnp.sum(ok_SB, axis=1)


def chunks(n: int, chunk: int, *arrays):
    """Yields (valid, *arrays[start:start + chunk]) with the tail zero-padded to `chunk` rows (one shape)."""
    for start in range(0, n, chunk):
        valid = min(chunk, n - start)
        parts = []
        for a in arrays:
            part = a[start:start + chunk]
            if valid < chunk:
                xp = np if isinstance(part, np.ndarray) else jnp
                part = xp.concatenate([part, xp.zeros((chunk - valid,) + part.shape[1:], part.dtype)])
            parts.append(part)
        yield (valid, *parts)


def head_accuracy(heads: ProbeHeads, x_NF, y_N, *, chunk: int | None = None) -> np.ndarray:
    """Accuracy float[S] of each head on raw (unstandardised) features x[N, F] and labels y int[N].

    Scored in chunks of `chunk` rows (default min(EVAL_CHUNK, N)); equal chunks share one compile.
    """
    y_N = np.asarray(y_N, np.int32)
    n = y_N.shape[0]
    chunk = chunk or min(EVAL_CHUNK, n)
    total_S = sum(_correct_chunk(heads, x, y, valid) for valid, x, y in chunks(n, chunk, x_NF, y_N))
    return np.asarray(total_S) / n


def infer_num_classes(labels: Mapping[str, Any]) -> int:
    return int(max(int(np.max(np.asarray(y))) for y in labels.values() if np.size(y))) + 1


def run_probe(
    features: Mapping[str, Any],
    labels: Mapping[str, Any],
    config: ProbeConfig = ProbeConfig(),
    *,
    num_classes: int | None = None,
    progress: bool = True,
) -> dict:
    """Fit `config.num_seeds` probes on features["train"], score every split; a JSON-able results dict.

    features: split -> float[N, F]; labels: split -> int[N]; "train" is required, other splits (e.g. "val",
    "test") are only evaluated. Results: {"accuracy": {split: {"mean", "std", "per_seed"}}, "final_loss",
    "seeds", "num_classes", "feature_dim", "num_examples", "config", "seconds"}.
    """
    if "train" not in features:
        raise ValueError(f"run_probe needs a 'train' split; got {sorted(features)}")
    t0 = time.perf_counter()
    num_classes = num_classes or infer_num_classes(labels)
    heads, loss_SE = fit_heads(features["train"], labels["train"], config, num_classes=num_classes,
                               progress=progress)
    chunk = min(EVAL_CHUNK, max(int(np.shape(y)[0]) for y in labels.values()))
    acc = {split: summarize(head_accuracy(heads, x, labels[split], chunk=chunk))
           for split, x in features.items()}
    return {
        "kind": "linear_probe",
        "accuracy": acc,
        "final_loss": summarize(loss_SE[:, -1]) if loss_SE.shape[1] else None,
        "seeds": config.seeds,
        "num_classes": num_classes,
        "feature_dim": int(np.shape(features["train"])[1]),
        "num_examples": {split: int(np.shape(x)[0]) for split, x in features.items()},
        "config": dataclasses.asdict(config),
        "seconds": time.perf_counter() - t0,
    }


def probe_checkpoint(
    feature_fn: FeatureFn,
    params,
    tokens: Mapping[str, Any],
    labels: Mapping[str, Any],
    config: ProbeConfig = ProbeConfig(),
    *,
    step: int | str = "none",
    cache_dir: str | None = None,
    batch_size: int = 1024,
    num_classes: int | None = None,
    progress: bool = True,
) -> dict:
    """Linear probe of a checkpoint: features of every split (cached under (step, split, projection) in
    `cache_dir` when given), then `run_probe`. tokens: split -> int[N, T]; labels: split -> int[N].
    `params` are only read: the encoder stays frozen."""
    feats = {
        split: cached_features(
            cache_dir, feature_fn, params, tok, step=step, split=split, batch_size=batch_size,
            projection_dim=config.projection_dim, projection_seed=config.projection_seed, progress=progress)
        for split, tok in tokens.items()
    }
    out = run_probe(feats, labels, config, num_classes=num_classes, progress=progress)
    out["step"] = step
    return out
