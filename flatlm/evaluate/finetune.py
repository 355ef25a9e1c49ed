"""Full fine-tuning of a pre-trained encoder with a classification head on the CLS position (paper, A.4).

Every sentence gets the CLS token (id V + 2) prepended, [cls, x_1..x_T], so the model needs max_len >= T + 1
(flatlm's configs give max_len = T + 1). The encoder is named by its Flax `apply` (e.g. `Bert(cfg).apply`), whose
`features` method gives the hidden states. The head is dropout + a linear layer on the final hidden state at
position 0 (normal(0.02) init, as BERT's classifier). Encoder and head train together with AdamW (lr 1e-4,
weight decay 0.01 on weights, not on biases / LayerNorm, as the HF Trainer), global-norm clipping 1.0, linear
warmup then linear decay; dropout on. Seeds run one after another (same shapes, so one compile) and differ in
head init, minibatch order and dropout.

Parameters that the classifier never reads (the MLM head) are found by tracing `features` (`unused_leaves`)
and frozen (no weight decay either), so the returned encoder differs only where fine-tuning acted.

Learning rate: the paper fixes it (1e-4, A.4; `lr`). With `lr_grid` flatlm instead fine-tunes every seed at every
rate of the grid, keeps the rate whose mean *validation* accuracy is highest and reports that rate's accuracies
(the test split is never looked at to choose). Why: one fixed step does not suit every model. On the cpu presets'
small models the paper's 1e-4 (and the presets' 1e-3) barely moves pre-trained weights, whose norms are several
times a fresh initialisation's, so fine-tuning from a pre-trained and from a random encoder end at the same
accuracy (docs/experiments/flatness_seeking-cpu). Costs len(lr_grid) times the fixed-rate fine-tuning.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jcore
from tqdm.auto import tqdm

from flatlm.errors import UserError
from flatlm.evaluate.features import ApplyFn
from flatlm.evaluate.heads import chunks, epoch_indices, infer_num_classes, masked_ce, summarize, warmup_linear_decay
from flatlm.languages.base import special_ids
from flatlm.models.blocks import decay_mask
from flatlm.sharding import keep_layout, layout, one_at_a_time, replicate_like


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """Fine-tuning hyper-parameters. Defaults follow the paper (A.4) except `epochs`, the released script's 50
    (A.4 says 10); the released code's values are noted.

    The fields of a config's `eval.finetune` section come first, so `FinetuneConfig(**config.eval.finetune,
    seed=config.seed)` builds it; `enabled` only tells the runner whether to fine-tune.
    """

    enabled: bool = True
    epochs: int = 50  # paper: 10; released: 50
    batch_size: int = 128  # released: 128
    lr: float = 1e-4
    weight_decay: float = 0.01
    warmup_steps: int = 200  # paper: 200; released script: 50; then linear decay
    num_seeds: int = 5
    end_learning_rate: float = 0.0
    max_grad_norm: float = 1.0  # released: 1.0 (0 = no clipping)
    head_dropout: float = 0.1  # dropout on the CLS hidden state (BERT's classifier dropout)
    head_init_std: float = 0.02
    seed: int = 0  # seeds are seed, seed + 1, ..., seed + num_seeds - 1
    eval_batch_size: int = 1024
    lr_grid: tuple[float, ...] = ()  # () -> the fixed `lr` (paper); else choose among these on validation
    from_init: bool = False  # the runner also fine-tunes the run's initialisation (control); not read here

    def __post_init__(self):
        object.__setattr__(self, "lr_grid", tuple(float(lr) for lr in self.lr_grid))
        if any(not lr > 0 for lr in self.lr_grid):
            raise UserError(f"eval.finetune.lr_grid must hold positive learning rates; got {self.lr_grid}")

    @property
    def seeds(self) -> list[int]:
        """The fine-tuning seeds: seed, seed + 1, ..., seed + num_seeds - 1 (the paper reports 5)."""
        return [self.seed + i for i in range(self.num_seeds)]


def recorded_config(c: FinetuneConfig) -> dict:
    """The config as a result records it (JSON-normal: lists, not tuples). The fields added after results existed
    appear only when set, so an unchanged protocol keeps its results' identity (`flatlm.results.identity`)."""
    out = {k: v for k, v in dataclasses.asdict(c).items() if k not in ("lr_grid", "from_init") or v}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def add_cls(tokens_NT, num_words: int) -> np.ndarray:
    """[cls, x_1..x_T]: int32[N, T + 1] with cls = V + 2."""
    tokens_NT = np.asarray(tokens_NT, np.int32)
    cls_N1 = np.full((tokens_NT.shape[0], 1), special_ids(num_words).cls, np.int32)
    return np.concatenate([cls_N1, tokens_NT], axis=1)


def check_max_len(max_len: int, length: int) -> None:
    """Raise UserError unless a model of `max_len` positions has room for CLS + `length` tokens."""
    if max_len < length + 1:
        raise UserError(
            f"fine-tuning prepends a CLS token, so sentences of {length} tokens need model max_len >= "
            f"{length + 1}, but the model has max_len {max_len}; pre-train with max_len = T + 1")


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def unused_leaves(fn, params) -> list[str]:
    """Names ("a/b/c") of the leaves of `params` that fn(params)'s output does not depend on.

    Found by liveness over the traced jaxpr (no compile); a nested call counts as using all its inputs, so the
    answer errs towards "used".
    """
    jaxpr = jax.make_jaxpr(fn)(params).jaxpr
    is_var = lambda v: not isinstance(v, jcore.Literal)
    live = {v for v in jaxpr.outvars if is_var(v)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(is_var(v) and v in live for v in eqn.outvars):
            live.update(v for v in eqn.invars if is_var(v))
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return [_path_name(path) for (path, _), v in zip(leaves, jaxpr.invars) if v not in live]


def _finetune_optimizer(c: FinetuneConfig, n: int, frozen: tuple[str, ...], lr) -> optax.GradientTransformation:
    """Clip, AdamW (decay on weights), then zero updates of the frozen leaves; a pure function of its args.
    `lr` (the peak rate) may be traced, so one compile serves every rate of `lr_grid`."""
    steps = -(-n // min(c.batch_size, n))
    schedule = warmup_linear_decay(lr, c.warmup_steps, steps * c.epochs, c.end_learning_rate)
    is_frozen = lambda params: jax.tree_util.tree_map_with_path(lambda p, _: _path_name(p) in frozen, params)
    parts = [optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=c.weight_decay, mask=decay_mask),
             optax.masked(optax.set_to_zero(), is_frozen)]
    if c.max_grad_norm > 0:
        parts.insert(0, optax.clip_by_global_norm(c.max_grad_norm))
    return optax.chain(*parts)


def _logits(apply_fn: ApplyFn, params, tokens_BT, key, train: bool, dropout: float):
    """Classifier logits [B, C] from the hidden state at position 0 (the CLS token)."""
    rngs = {"dropout": jax.random.fold_in(key, 0)} if train else {}
    h_BTD = apply_fn({"params": params["encoder"]}, tokens_BT, deterministic=not train, rngs=rngs,
                     method="features")
    h_BD = h_BTD[:, 0].astype(jnp.float32)
    if train and dropout > 0:
        keep_BD = jax.random.bernoulli(jax.random.fold_in(key, 1), 1.0 - dropout, h_BD.shape)
        h_BD = jnp.where(keep_BD, h_BD / (1.0 - dropout), 0.0)
    return h_BD @ params["head"]["w"] + params["head"]["b"]


def _loss(params, apply_fn: ApplyFn, tokens_BT, y_B, w_B, key, dropout: float):
    return masked_ce(_logits(apply_fn, params, tokens_BT, key, True, dropout), y_B, w_B)


@functools.partial(jax.jit, static_argnames=("apply_fn", "config", "frozen", "state_layout"), donate_argnums=(0, 1))
def _finetune_epoch(params, opt, x_NT, y_N, perm_key, drop_key, epoch, lr, *, apply_fn, config, frozen,
                    state_layout=None):
    """One epoch: a lax.scan over minibatches. Module-level, so seeds, rates and checkpoints share one compile;
    `state_layout` (`flatlm.sharding.layout` of (params, opt)) keeps the outputs on their inputs' shardings, so the
    next epoch reuses the program."""
    c = config
    n = x_NT.shape[0]
    bs = min(c.batch_size, n)
    steps = -(-n // bs)
    tx = _finetune_optimizer(c, n, frozen, lr)
    w_XB = (jnp.arange(steps * bs) < n).astype(jnp.float32).reshape(steps, bs)
    idx_XB = epoch_indices(perm_key, epoch, n, bs)
    ekey = jax.random.fold_in(drop_key, epoch)

    def body(carry, inp):
        params, opt = carry
        idx_B, w_B, t = inp
        loss, g = jax.value_and_grad(_loss)(params, apply_fn, x_NT[idx_B], y_N[idx_B], w_B,
                                            jax.random.fold_in(ekey, t), c.head_dropout)
        updates, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    (params, opt), loss_X = jax.lax.scan(body, (params, opt), (idx_XB, w_XB, jnp.arange(steps)))
    params, opt = keep_layout((params, opt), state_layout)
    return params, opt, jnp.mean(loss_X)


@functools.partial(jax.jit, static_argnames=("apply_fn",))
def _correct_chunk(apply_fn: ApplyFn, params, tokens_BT, y_B, valid):
    """Correct predictions among the first `valid` rows of a chunk (dropout off)."""
    pred_B = jnp.argmax(_logits(apply_fn, params, tokens_BT, None, False, 0.0), axis=-1)
    return jnp.sum((pred_B == y_B) & (jnp.arange(y_B.shape[0]) < valid))


def finetune(
    apply_fn: ApplyFn,
    params,
    tokens: Mapping[str, Any],
    labels: Mapping[str, Any],
    config: FinetuneConfig = FinetuneConfig(),
    *,
    num_words: int,
    max_len: int,
    num_classes: int | None = None,
    return_params: bool = False,
    progress: bool = True,
) -> dict | tuple[dict, list]:
    """Fine-tune the encoder `apply_fn` (a Flax `model.apply` whose module has `features`, e.g. Bert or BiLSTM)
    from `params` with a CLS head, once per seed (A.4).

    num_words: the pre-training vocabulary V (CLS is id V + 2); max_len: the model's positions, which must hold
    CLS + T. tokens: split -> int[N, T] *without* CLS (it is prepended here); labels: split -> int[N]; "train" is
    required, other splits are only evaluated (with dropout off); `config.lr_grid` also needs "validation" (to
    choose on) and "test" (to report). Returns a JSON-able dict {"accuracy": {split: {"mean", "std",
    "per_seed"}}, "lr", "final_loss", "frozen", "seeds", ...}, with a grid also "lr_selection" {"split", "grid",
    "accuracy": [per rate {split: summary}]}; with `return_params`, also the list of fine-tuned parameter trees
    {"encoder": ..., "head": {"w": [D, C], "b": [C]}}, one per seed (at the chosen rate). `params` itself is never
    modified.
    """
    if "train" not in tokens:
        raise ValueError(f"finetune needs a 'train' split; got {sorted(tokens)}")
    c = config
    if c.lr_grid and not {"validation", "test"} <= set(tokens):
        raise UserError(f"eval.finetune.lr_grid chooses the rate on a 'validation' split and reports 'test', but the "
                        f"task has splits {sorted(tokens)}; use a fixed rate (eval.finetune.lr_grid=()) here")
    for tok in tokens.values():
        check_max_len(max_len, np.shape(tok)[1])
    t0 = time.perf_counter()
    toks = {split: add_cls(tok, num_words) for split, tok in tokens.items()}
    ys = {split: np.asarray(y, np.int32) for split, y in labels.items()}
    num_classes = num_classes or infer_num_classes(labels)
    x_NT, y_N = jnp.asarray(toks["train"]), jnp.asarray(ys["train"])
    n = x_NT.shape[0]

    features = lambda p: apply_fn({"params": p}, x_NT[:1], method="features")
    d_model = jax.eval_shape(features, params).shape[-1]
    frozen = tuple("encoder/" + name for name in unused_leaves(features, params))
    tx = _finetune_optimizer(c, n, frozen, c.lr)  # init only: its state does not depend on the rate
    chunk = min(c.eval_batch_size, max(len(y) for y in ys.values()))
    # the epoch function is compiled per (apply_fn, config, shapes): drop the fields it does not read
    epoch_cfg = dataclasses.replace(c, enabled=True, seed=0, num_seeds=1, eval_batch_size=0, lr=0.0, lr_grid=(),
                                    from_init=False)

    def run_seeds(lr: float, tag: str):
        """Every seed at peak rate `lr`: ({split: per-seed accuracy}, per-seed final loss, tuned trees)."""
        acc = {split: [] for split in toks}
        final_loss, tuned = [], []
        for seed in c.seeds:
            key = jax.random.key(seed)
            init_key, perm_key, drop_key = (jax.random.fold_in(key, i) for i in range(3))
            head = {"w": c.head_init_std * jax.random.normal(init_key, (d_model, num_classes), jnp.float32),
                    "b": jnp.zeros((num_classes,), jnp.float32)}
            # a private copy of the encoder: the epoch function donates its buffers
            p = {"encoder": jax.tree.map(jnp.array, params), "head": head}
            p, opt = replicate_like(params, (p, tx.init(p)))  # on the encoder's mesh: the epoch compiles once
            loss, state_layout = jnp.nan, layout((p, opt))
            bar = tqdm(range(c.epochs), desc=f"finetune seed {seed}{tag}", disable=not progress, leave=False)
            for epoch in bar:
                p, opt, loss = one_at_a_time(_finetune_epoch(  # waited for on several CPU devices (deadlocks)
                    p, opt, x_NT, y_N, perm_key, drop_key, epoch, jnp.float32(lr), apply_fn=apply_fn,
                    config=epoch_cfg, frozen=frozen, state_layout=state_layout))
                if progress:
                    bar.set_postfix(loss=f"{float(loss):.4f}")
            final_loss.append(float(loss))
            for split in toks:
                correct = sum(one_at_a_time(_correct_chunk(apply_fn, p, t, y, valid))
                              for valid, t, y in chunks(len(ys[split]), chunk, toks[split], ys[split]))
                acc[split].append(int(correct) / len(ys[split]))
            if return_params:
                tuned.append(p)
        return acc, final_loss, tuned

    grid = c.lr_grid or (c.lr,)
    best, per_lr = None, []
    for lr in grid:
        acc, final_loss, tuned = run_seeds(lr, f" lr {lr:g}" if c.lr_grid else "")
        per_lr.append({split: summarize(v) for split, v in acc.items()})
        # the first rate with the highest mean validation accuracy (ties keep the earlier rate of the grid)
        if best is None or np.mean(acc.get("validation", [0.0])) > np.mean(best[1].get("validation", [0.0])):
            best = (lr, acc, final_loss, tuned)
    lr, acc, final_loss, tuned = best
    out = {
        "kind": "finetune",
        "accuracy": {split: summarize(v) for split, v in acc.items()},
        "lr": lr,
        "final_loss": summarize(final_loss) if c.epochs else None,
        "frozen": list(frozen),
        "seeds": c.seeds,
        "num_classes": num_classes,
        "num_examples": {split: len(y) for split, y in ys.items()},
        "config": recorded_config(c),
        "seconds": time.perf_counter() - t0,
    }
    if c.lr_grid:
        out["lr_selection"] = {"split": "validation", "grid": list(grid), "accuracy": per_lr}
    return (out, tuned) if return_params else out
