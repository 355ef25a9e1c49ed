"""The adversarial meta-learning objective of the paper's Appendix A.4: same pre-training loss, worse downstream.

    minimise  L_mlm(psi) - lam * (1/|D2|) sum_{(x, y) in D2} l(g_{phi(psi)}(h_psi(x)), y)

h_psi(x) are the linear probe's features (every token's final hidden state concatenated, [T*D], optionally
through the probe's fixed Gaussian projection); phi(psi) is a linear head fitted in closed form by ridge
regression on one-hot labels of a downstream batch D1,

    phi = argmin_W (1/|D1|) ||H1 W - Y1||^2 + ridge ||W||^2,

and D2 is a disjoint downstream batch. The solve is differentiated, so the meta-gradient flows through phi into
the features of D1 as well as those of D2 (Liu et al. 2020-style meta-learning). It runs in the smaller of the
two forms: primal (H1^T H1 + rho I)^-1 H1^T Y1 when |D1| >= F, kernel H1^T (H1 H1^T + rho I)^-1 Y1 when |D1| < F
(rho = ridge * |D1|), where D2's predictions need only the cross-Gram H2 H1^T. By default features are first
centred by D1's mean and divided by D1's RMS (differentiated too; see `AdversarialConfig.normalize`) and the
head gets an unpenalised intercept; with normalize="none" it is the plain formula above. Each D2 row's loss is
capped at the loss of the chance head (D1's label frequencies; `cap_at_chance`): maximising the uncapped loss
has no bound, and in practice it rewards blowing up a few features, which wrecks the MLM loss instead of
removing the label information.

`make_objective(cfg)` returns an objective for `flatlm.train.step.train_step`; its batch is the MLM
batch plus `down1_tokens int32[d1, T]`, `down1_labels int32[d1]`, `down2_tokens int32[d2, T]`,
`down2_labels int32[d2]` (plain unmasked sentences of the MLM batch's length T). `downstream_batches` makes
those for HMM task-k, `pool_batches` for any labelled set (e.g. a task's train split).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from flatlm.config import check_choice
from flatlm.data.tasks import hmm_position
from flatlm.errors import UserError
from flatlm.evaluate.features import gaussian_projection, hidden_states
from flatlm.models.losses import ApplyFn, mlm_loss

LOSSES = ("squared", "ce")
LABEL_DEFINITIONS = ("sampled", "posterior")
NORMALIZATIONS = ("global", "feature", "none")
DOWN_KEYS = ("down1_tokens", "down1_labels", "down2_tokens", "down2_labels")
_HIGHEST = jax.lax.Precision.HIGHEST  # Gram matrices in full f32 (no TF32/bf16 passes on GPU/TPU)
_VAR_FLOOR = 1e-2  # "feature" normalisation: variance floor, relative to the mean variance over features
_TINY = 1e-12  # keeps the square roots differentiable at zero variance


@dataclasses.dataclass(frozen=True)
class AdversarialConfig:
    """Hyper-parameters of the adversarial objective and of its downstream batches.

    lam: weight of the downstream term; 0 gives plain MLM (the downstream computation is skipped statically,
      or only monitored under stop_gradient with `monitor`).
    ridge: per-example ridge strength, phi = argmin (1/|D1|)||H1 W - Y1||^2 + ridge ||W||^2.
    d1_size, d2_size: rows of the D1 (fit) and D2 (evaluate) batches; both divisible by the data-parallel size.
    loss: l on D2: "squared" = sum over classes of (prediction - one_hot)^2, "ce" = softmax cross-entropy of
      ce_scale * prediction; averaged over D2. cap_at_chance: each D2 row's loss is capped at the loss of the
      chance head (D1's label frequencies), so the adversary drives the head to chance and no further.
    projection_dim: 0 = raw T*D features; > 0 = the probe's fixed Gaussian projection (paper: 512) with
      projection_seed (the same matrix as `flatlm.evaluate.features.gaussian_projection`).
    normalize: "global" (default) centres features by D1's mean and divides them by D1's RMS over all
      features (scale-free, so the encoder cannot weaken the ridge by shrinking its features), "feature"
      standardises each feature by its D1 std (floored), "none" = raw features; the first two fit an
      unpenalised intercept. D1's statistics are differentiated too.
    task: downstream task name, "k<i>" for HMM task-i; num_classes: its number of labels (HMM: num_states).
    label_definition: HMM labels, "sampled" (the generating state) or "posterior" (argmax P(z_i | x)).
    pool_size: 0 = fresh downstream sentences every step; > 0 = D1/D2 drawn from a fixed pool of that size.
    seed: seed of the downstream batches (and of the pool).
    monitor: with lam == 0, still report the D2 metrics (computed under stop_gradient: same gradients).
    start_step: plain MLM steps up to this step, the adversarial objective after it (a warm start).

    Built from the config section, `AdversarialConfig(**config.train.adversarial, num_classes=...,
    label_definition=..., seed=config.seed)`: num_classes, label_definition and seed are derived from the
    language, `eval.task_definition` and the run's seed.
    """

    lam: float = 0.0
    ridge: float = 1.0
    d1_size: int = 256
    d2_size: int = 256
    loss: str = "squared"
    ce_scale: float = 1.0
    cap_at_chance: bool = True
    projection_dim: int = 0
    projection_seed: int = 0
    normalize: str = "global"
    task: str = "task-6"
    num_classes: int = 0
    label_definition: str = "sampled"
    pool_size: int = 0
    seed: int = 0
    monitor: bool = False
    start_step: int = 0

    @property
    def active(self) -> bool:
        """Whether the downstream term is computed at all (lam > 0, or lam = 0 with `monitor`)."""
        return self.lam > 0 or self.monitor

    @property
    def position(self) -> int:
        """The HMM task's position k of task "k<k>"."""
        return task_position(self.task)


def task_position(task: str) -> int:
    """0-based position of an HMM task name ("task-6": the paper's 6th variable, position 5; "k5": position 5)."""
    return hmm_position(task)


def validate(cfg: AdversarialConfig) -> None:
    """Check the fields that come from `config.train.adversarial`; a UserError (a ValueError) naming the field."""
    name = "config.train.adversarial"
    if cfg.lam < 0:
        raise UserError(f"{name}.lam must be >= 0, got {cfg.lam}")
    check_choice(cfg.loss, LOSSES, "train.adversarial.loss")
    check_choice(cfg.normalize, NORMALIZATIONS, "train.adversarial.normalize")
    check_choice(cfg.label_definition, LABEL_DEFINITIONS, "eval.task_definition (adversarial labels)")
    if not cfg.ridge > 0:
        raise UserError(f"{name}.ridge must be positive, got {cfg.ridge}")
    for field in ("d1_size", "d2_size"):
        if getattr(cfg, field) < 1:
            raise UserError(f"{name}.{field} must be positive, got {getattr(cfg, field)}")
    if cfg.projection_dim < 0:
        raise UserError(f"{name}.projection_dim must be >= 0 (0: raw features), got {cfg.projection_dim}")
    if cfg.pool_size and cfg.pool_size < cfg.d1_size + cfg.d2_size:
        raise UserError(f"{name}.pool_size={cfg.pool_size} is smaller than d1_size + d2_size; "
                        "raise it or set it to 0 (fresh sentences every step)")
    if cfg.start_step < 0:
        raise UserError(f"{name}.start_step must be >= 0, got {cfg.start_step}")


# ----------------------------------------------------------------------------------------------- the head


def ridge_head(x_NF: jax.Array, y_NC: jax.Array, rho: float) -> jax.Array:
    """W[F, C] = argmin ||x W - y||^2 + rho ||W||^2, in the primal form if N >= F, else the kernel form."""
    n, f = x_NF.shape
    if n >= f:
        gram_FF = jnp.einsum("nf,ng->fg", x_NF, x_NF, precision=_HIGHEST) + rho * jnp.eye(f, dtype=x_NF.dtype)
        return _spd_solve(gram_FF, jnp.einsum("nf,nc->fc", x_NF, y_NC, precision=_HIGHEST))
    kernel_NN = jnp.einsum("nf,mf->nm", x_NF, x_NF, precision=_HIGHEST) + rho * jnp.eye(n, dtype=x_NF.dtype)
    return jnp.einsum("nf,nc->fc", x_NF, _spd_solve(kernel_NN, y_NC), precision=_HIGHEST)


def ridge_predict(x1_NF: jax.Array, y1_NC: jax.Array, x2_MF: jax.Array, rho: float) -> jax.Array:
    """Predictions [M, C] on x2 of `ridge_head(x1, y1, rho)`; the kernel form never builds W (one cross-Gram)."""
    n, f = x1_NF.shape
    if n >= f:
        return jnp.einsum("mf,fc->mc", x2_MF, ridge_head(x1_NF, y1_NC, rho), precision=_HIGHEST)
    x_KF = jnp.concatenate([x1_NF, x2_MF])
    gram_KN = jnp.einsum("kf,nf->kn", x_KF, x1_NF, precision=_HIGHEST)  # [x1; x2] x1^T in one matmul
    alpha_NC = _spd_solve(gram_KN[:n] + rho * jnp.eye(n, dtype=x1_NF.dtype), y1_NC)
    return jnp.einsum("mn,nc->mc", gram_KN[n:], alpha_NC, precision=_HIGHEST)


def _spd_solve(a_NN: jax.Array, b_NC: jax.Array) -> jax.Array:
    # Symmetric positive definite: a Cholesky solve, differentiated implicitly (custom_linear_solve).
    return jax.scipy.linalg.solve(a_NN, b_NC, assume_a="pos")


def _normalize(x1_NF, x2_MF, mode: str):
    """Centre both by x1's per-feature mean and scale by x1's spread: one scalar (the RMS over every feature,
    "global") or per feature ("feature", as the probe's standardisation; a feature whose x1 variance is below
    `_VAR_FLOOR` times the mean variance keeps that floor, so near-constant features are not blown up)."""
    mean_F = jnp.mean(x1_NF, axis=0)
    x1_NF, x2_MF = x1_NF - mean_F, x2_MF - mean_F
    var_F = jnp.mean(jnp.square(x1_NF), axis=0)
    mean_var = jnp.mean(var_F)
    if mode == "global":
        scale = jnp.sqrt(mean_var + _TINY)
    elif mode == "feature":
        scale = jnp.sqrt(var_F + _VAR_FLOOR * mean_var + _TINY)
    else:
        raise ValueError(f"unknown normalization {mode!r}")
    return x1_NF / scale, x2_MF / scale


def closed_form_predict(x1_NF, labels1_N, x2_MF, *, num_classes: int, ridge: float, normalize: str = "global"):
    """Predictions [M, C] on x2 of the ridge head fitted on (x1, one_hot(labels1)); differentiable in x1, x2.

    ridge is per example (rho = ridge * N). normalize "none" is the plain ridge formula on raw features;
    "global"/"feature" first centre x1 and x2 by x1's mean and scale them by x1's spread (see `_normalize`),
    and the head gets an unpenalised intercept (the mean of the one-hot targets).
    """
    y1_NC = jax.nn.one_hot(labels1_N, num_classes, dtype=x1_NF.dtype)
    rho = ridge * x1_NF.shape[0]
    if normalize == "none":
        return ridge_predict(x1_NF, y1_NC, x2_MF, rho)
    x1_NF, x2_MF = _normalize(x1_NF, x2_MF, normalize)
    mean_C = jnp.mean(y1_NC, axis=0)
    return ridge_predict(x1_NF, y1_NC - mean_C, x2_MF, rho) + mean_C


def per_example_loss(pred_MC, labels_M, loss: str, ce_scale: float = 1.0):
    """l(prediction, label) per row [M]: "squared" sum_c (pred - one_hot)^2, "ce" -log softmax(ce_scale pred)."""
    y_MC = jax.nn.one_hot(labels_M, pred_MC.shape[-1], dtype=pred_MC.dtype)
    if loss == "squared":
        return jnp.sum(jnp.square(pred_MC - y_MC), axis=-1)
    if loss == "ce":
        return -jnp.sum(y_MC * jax.nn.log_softmax(ce_scale * pred_MC, axis=-1), axis=-1)
    raise ValueError(f"unknown loss {loss!r}")


def head_loss(pred_MC, labels_M, loss: str, ce_scale: float = 1.0, chance_C=None):
    """Mean over rows of l(prediction, label), and the accuracy of argmax(prediction).

    With `chance_C` (the label frequencies of D1, i.e. the prediction of a head that learnt nothing), each row's
    loss is capped at that chance predictor's loss on the row: the adversary gains by pushing the head down
    to chance, never beyond (maximising the uncapped loss has no bound and rewards blowing features up).
    """
    per_M = per_example_loss(pred_MC, labels_M, loss, ce_scale)
    if chance_C is not None:
        chance_M = per_example_loss(jnp.broadcast_to(chance_C, pred_MC.shape), labels_M, loss, ce_scale)
        per_M = jnp.minimum(per_M, chance_M)
    acc = jnp.mean((jnp.argmax(pred_MC, axis=-1) == labels_M).astype(jnp.float32))
    return jnp.mean(per_M), acc


# ----------------------------------------------------------------------------------------------- objective


def probe_features(apply_fn: ApplyFn, params, tokens_BT, projection_dim: int = 0, projection_seed: int = 0):
    """The probe's features float32[B, T*D] (or [B, projection_dim]) of `tokens`, differentiable in params.

    `apply_fn` is a Flax `model.apply` of a module with a `features(tokens) -> hidden[B, T, D]` method.
    """
    h_BTD = hidden_states(apply_fn, params, tokens_BT)
    x_BF = h_BTD.reshape(h_BTD.shape[0], -1)
    x_BF = x_BF.astype(jnp.promote_types(x_BF.dtype, jnp.float32))  # bf16 activations -> f32; f64 stays
    if not projection_dim:
        return x_BF
    with jax.ensure_compile_time_eval():  # a constant of the compiled step, drawn once at trace time
        proj_FP = gaussian_projection(x_BF.shape[1], projection_dim, projection_seed)
    return jnp.einsum("bf,fp->bp", x_BF, proj_FP.astype(x_BF.dtype), precision=_HIGHEST)


def downstream_terms(cfg: AdversarialConfig, apply_fn: ApplyFn, params, batch: dict):
    """(D2 loss, D2 accuracy) of the closed-form head fitted on D1, differentiable in params.

    D1 and D2 go through the encoder in one call (one batch of d1 + d2 sentences).
    """
    n1 = batch["down1_tokens"].shape[0]
    tokens_KT = jnp.concatenate([batch["down1_tokens"], batch["down2_tokens"]])
    x_KF = probe_features(apply_fn, params, tokens_KT, cfg.projection_dim, cfg.projection_seed)
    labels1_N = batch["down1_labels"]
    pred_MC = closed_form_predict(x_KF[:n1], labels1_N, x_KF[n1:], num_classes=cfg.num_classes, ridge=cfg.ridge,
                                  normalize=cfg.normalize)
    chance_C = jnp.mean(jax.nn.one_hot(labels1_N, cfg.num_classes, dtype=pred_MC.dtype), axis=0)
    return head_loss(pred_MC, batch["down2_labels"], cfg.loss, cfg.ce_scale,
                     chance_C if cfg.cap_at_chance else None)


def make_objective(cfg: AdversarialConfig):
    """objective(params, batch, apply_fn, dropout_key) -> (L_mlm - lam * l_D2, aux) for `train_step`.

    aux: train/mlm_loss, and (lam > 0 or monitor) train/adv_d2_loss, train/adv_d2_acc of the closed-form head.
    With lam == 0 the loss and its gradient are exactly those of `mlm_objective`. Dropout (the key) applies
    to the MLM pass only: the downstream features are the probe's deterministic ones (`method="features"`).
    """
    validate(cfg)
    if cfg.active and cfg.num_classes < 2:
        raise ValueError(f"num_classes must be >= 2 (HMM: num_states), got {cfg.num_classes}")

    def objective(params, batch, apply_fn, dropout_key):
        mlm = mlm_loss(params, batch, apply_fn, dropout_key)
        aux = {"train/mlm_loss": mlm}
        if cfg.lam == 0 and not cfg.monitor:
            return mlm, aux
        down_params = params if cfg.lam > 0 else jax.lax.stop_gradient(params)
        d2_loss, d2_acc = downstream_terms(cfg, apply_fn, down_params, batch)
        aux.update({"train/adv_d2_loss": d2_loss, "train/adv_d2_acc": d2_acc})
        loss = mlm - cfg.lam * d2_loss if cfg.lam > 0 else mlm
        return loss, aux

    return objective


# ----------------------------------------------------------------------------------------------- data


def _derived_seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


_TAG_POOL, _TAG_STEP, _TAG_PICK = 0xAD0, 0xAD1, 0xAD2  # keep these streams apart from other users of `seed`


def _local_rows(n: int, process_index: int, process_count: int) -> slice:
    if n % process_count:
        raise ValueError(f"downstream batch size {n} is not divisible by the process count {process_count}")
    per = n // process_count
    return slice(process_index * per, (process_index + 1) * per)


def _check_split(d1: int, d2: int, process_count: int) -> None:
    if d1 < 1 or d2 < 1:
        raise ValueError(f"D1 and D2 need at least one sentence each, got {d1} and {d2}")
    for n in (d1, d2):
        _local_rows(n, 0, process_count)


def _split(tokens_KT, labels_K, d1: int, process_index: int, process_count: int) -> dict:
    d2 = tokens_KT.shape[0] - d1
    r1, r2 = _local_rows(d1, process_index, process_count), _local_rows(d2, process_index, process_count)
    return {
        "down1_tokens": np.asarray(tokens_KT[:d1][r1], np.int32),
        "down1_labels": np.asarray(labels_K[:d1][r1], np.int32),
        "down2_tokens": np.asarray(tokens_KT[d1:][r2], np.int32),
        "down2_labels": np.asarray(labels_K[d1:][r2], np.int32),
    }


def hmm_labels(language, corpus, k: int, definition: str = "sampled") -> np.ndarray:
    """HMM task-k labels of a sampled corpus: the generating state z_k, or argmax_j P(z_k = j | x)."""
    return np.asarray(language.task_labels(corpus.tokens, corpus.lengths, k, definition=definition,
                                           states=corpus.latents.get("states")), np.int32)


def pool_batches(tokens_NT, labels_N, d1: int, d2: int, seed: int, *, start: int = 0, process_index: int = 0,
                 process_count: int = 1) -> Iterator[dict]:
    """Endless D1/D2 batches drawn without replacement from a fixed labelled set (e.g. a task's train split).

    Batch i uses d1 + d2 distinct rows chosen by (seed, i): D1 and D2 are disjoint. Yields this process's rows
    of batches start, start + 1, ... (resume a run checkpointed at step S with start=S).
    """
    tokens_NT, labels_N = np.asarray(tokens_NT, np.int32), np.asarray(labels_N, np.int32)
    n = tokens_NT.shape[0]
    if n < d1 + d2:
        raise ValueError(f"a pool of {n} sentences cannot give disjoint D1 ({d1}) and D2 ({d2})")
    _check_split(d1, d2, process_count)

    def batches():
        for i in itertools.count(start):
            rows_K = np.random.default_rng([seed, i, _TAG_PICK]).choice(n, d1 + d2, replace=False)
            yield _split(tokens_NT[rows_K], labels_N[rows_K], d1, process_index, process_count)

    return batches()


def downstream_batches(language, k: int, d1: int, d2: int, seed: int, *, definition: str = "sampled",
                       pool_size: int = 0, start: int = 0, process_index: int = 0,
                       process_count: int = 1) -> Iterator[dict]:
    """Endless D1/D2 batches of HMM task-k: dicts of down1_tokens, down1_labels, down2_tokens, down2_labels.

    pool_size = 0: batch i is d1 + d2 fresh sentences sampled with a seed derived from (seed, i), the first
    d1 being D1 (distinct draws, so D1 and D2 are disjoint). pool_size > 0: a pool of that many sentences is
    sampled once from (seed) and every batch draws distinct rows of it (`pool_batches`). Deterministic in
    (seed, i); yields this process's rows of batches start, start + 1, ... (resume at step S with start=S).
    """
    if not 0 <= k < language.max_length:
        raise ValueError(f"task position k={k} must be in 0..{language.max_length - 1}")
    if definition not in LABEL_DEFINITIONS:
        raise ValueError(f"definition must be one of {LABEL_DEFINITIONS}, got {definition!r}")
    if pool_size:
        corpus = language.sample(pool_size, seed=_derived_seed(seed, _TAG_POOL))
        return pool_batches(corpus.tokens, hmm_labels(language, corpus, k, definition), d1, d2, seed,
                            start=start, process_index=process_index, process_count=process_count)
    _check_split(d1, d2, process_count)

    def batches():
        for i in itertools.count(start):
            corpus = language.sample(d1 + d2, seed=_derived_seed(seed, i, _TAG_STEP))
            labels_K = hmm_labels(language, corpus, k, definition)
            yield _split(corpus.tokens, labels_K, d1, process_index, process_count)

    return batches()


def downstream_iterator(cfg: AdversarialConfig, language, *, start: int = 0, process_index: int = 0,
                        process_count: int = 1) -> Iterator[dict]:
    """`downstream_batches` for an HMM language from the config's task, sizes, pool and seed."""
    return downstream_batches(language, cfg.position, cfg.d1_size, cfg.d2_size, cfg.seed,
                              definition=cfg.label_definition, pool_size=cfg.pool_size, start=start,
                              process_index=process_index, process_count=process_count)
