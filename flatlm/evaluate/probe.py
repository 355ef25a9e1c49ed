"""Linear probe on frozen features: the paper's downstream metric for a pre-trained checkpoint (appendix A.4).

Features (`features.py`) are the concatenation of every token's final hidden state, x = [h_1; ...; h_T], optionally
through a fixed random Gaussian projection to 512 dimensions; `cache.py` keeps them on disk per checkpoint.
The probe is a softmax-linear head trained with AdamW (lr 1e-3, weight decay 0.01, linear warmup then linear
decay, 100 epochs: A.4). S seeds train together under `jax.vmap` (one compile; heads stacked [S, F, C]); each seed
has its own head init, minibatch order and dropout. Features live on the device, each seed draws a fresh
permutation per epoch, and one jitted call runs a whole epoch as a `lax.scan` over minibatches.

Standardisation (on by default): every feature is shifted and scaled by its mean and std over the *training*
split (constant features are left unscaled), which makes lr 1e-3 work for features of any scale (hidden
states, projections, probabilities). Set `standardize=False` for the released code's raw features.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from flatlm.evaluate.cache import cached_features
from flatlm.evaluate.features import ApplyFn
from flatlm.evaluate.heads import chunks, epoch_indices, infer_num_classes, masked_ce, summarize, warmup_linear_decay

EVAL_CHUNK = 8192  # examples per chunk when scoring a split (bounds the [S, chunk, C] logits)


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """Linear-probe hyper-parameters. Defaults follow the paper (A.4); the released code's values are noted.

    The fields of a config's `eval.probe` section come first, so `ProbeConfig(**config.eval.probe,
    seed=config.seed)` builds it; `enabled` only tells the runner whether to probe.
    """

    enabled: bool = True
    epochs: int = 100  # paper: 100; released script: 50
    batch_size: int = 512  # released: 512
    lr: float = 1e-3
    weight_decay: float = 0.01  # AdamW, decoupled, on weights and bias (torch AdamW default, as released)
    warmup_steps: int = 50  # released: 50, then linear ("polynomial", power 1) decay
    num_seeds: int = 5
    projection_dim: int = 0  # 512 for the paper's projected probe; 0 = raw T*D features
    standardize: bool = True  # see module docstring
    end_learning_rate: float = 1e-7  # HF polynomial schedule's lr_end
    max_grad_norm: float = 0.0  # 0 = no clipping (the released probe loop does not clip)
    dropout: float = 0.0  # dropout on the features; the released classifier used 0.1
    seed: int = 0  # seeds are seed, seed + 1, ..., seed + num_seeds - 1
    projection_seed: int = 0
    head_init_std: float = 0.02  # BERT's init_weights for the classifier
    layers: tuple[int, ...] = ()  # inner layers (1-based) also probed, kind "layer_probe"; the paper: the last only

    def __post_init__(self):  # a static jit argument (`_probe_epoch`): hashable, whatever sequence the config held
        object.__setattr__(self, "layers", tuple(self.layers))

    @property
    def seeds(self) -> list[int]:
        """The probe's seeds: seed, seed + 1, ..., seed + num_seeds - 1 (the paper reports 5)."""
        return [self.seed + i for i in range(self.num_seeds)]


class ProbeHeads(NamedTuple):
    """S linear heads in standardised feature space: logits = ((x - mean) / scale) @ w + b."""

    w_SFC: jax.Array
    b_SC: jax.Array
    mean_F: jax.Array
    scale_F: jax.Array


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


def _probe_optimizer(c: ProbeConfig, n: int) -> optax.GradientTransformation:
    """AdamW with warmup + linear decay over `epochs` passes of n examples (a pure function of its args)."""
    steps = -(-n // min(c.batch_size, n))
    schedule = warmup_linear_decay(c.lr, c.warmup_steps, steps * c.epochs, c.end_learning_rate)
    tx = optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=c.weight_decay)
    return optax.chain(optax.clip_by_global_norm(c.max_grad_norm), tx) if c.max_grad_norm > 0 else tx


def _probe_loss(head, x_BF, y_B, w_B, key, dropout: float):
    if dropout > 0:
        keep_BF = jax.random.bernoulli(key, 1.0 - dropout, x_BF.shape)
        x_BF = jnp.where(keep_BF, x_BF / (1.0 - dropout), 0.0)
    # head["w"] is [C, F]: contracting F against the rows of x makes the weight gradient g^T x, a plain
    # matmul, where [F, C] gives x^T g with a transposed [B, F] operand (3x slower on CPU).
    return masked_ce(jnp.einsum("bf,cf->bc", x_BF, head["w"]) + head["b"], y_B, w_B)


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
    epoch_cfg = dataclasses.replace(c, enabled=True, seed=0, num_seeds=1, projection_dim=0, projection_seed=0)

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


def head_accuracy(heads: ProbeHeads, x_NF, y_N, *, chunk: int | None = None) -> np.ndarray:
    """Accuracy float[S] of each head on raw (unstandardised) features x[N, F] and labels y int[N].

    Scored in chunks of `chunk` rows (default min(EVAL_CHUNK, N)); equal chunks share one compile.
    """
    y_N = np.asarray(y_N, np.int32)
    n = y_N.shape[0]
    chunk = chunk or min(EVAL_CHUNK, n)
    total_S = sum(_correct_chunk(heads, x, y, valid) for valid, x, y in chunks(n, chunk, x_NF, y_N))
    return np.asarray(total_S) / n


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
        "config": {k: v for k, v in dataclasses.asdict(config).items() if k != "layers"},  # the entry names its layer
        "seconds": time.perf_counter() - t0,
    }


def probe_checkpoint(
    apply_fn: ApplyFn,
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
    layer: int | None = None,
) -> dict:
    """Linear probe of a checkpoint (A.4): frozen features of every split (of the last layer, or with `layer=k`
    the k-th), then `run_probe`.

    apply_fn: the model's Flax `apply` (e.g. `Bert(cfg).apply`; its `features` method gives hidden states);
    tokens: split -> int[N, T]; labels: split -> int[N]. Features are cached under (step, split, projection) in
    `cache_dir` when given. `params` are only read: the encoder stays frozen.
    """
    feats = {
        split: cached_features(
            cache_dir, apply_fn, params, tok, step=step, split=split, batch_size=batch_size,
            projection_dim=config.projection_dim, projection_seed=config.projection_seed, progress=progress,
            layer=layer)
        for split, tok in tokens.items()
    }
    out = run_probe(feats, labels, config, num_classes=num_classes, progress=progress)
    out["step"] = step
    if layer is not None:
        out["layer"] = layer
    return out
