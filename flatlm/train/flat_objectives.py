"""Flatness-seeking objectives for the train step (beyond the paper: does seeking flatness move downstream at equal
loss?). Each is an `Objective` (params, batch, apply_fn, dropout_key) -> (loss, aux) like `mlm_objective`, so the
step, its shardings, checkpoints and resumption are the plain ones; config `train.flat` (FlatConfig) picks one.

- "sam" (Foret et al. 2021): the MLM loss at params + rho * g / |g|, g the batch gradient held constant (the usual
  first-order SAM gradient). `ascent_groups` splits the batch into that many groups, each with its own ascent
  step (m-sharpness): 1 is SAM on the batch (with a large batch, close to penalising the top eigenvalue); one group
  per sentence is stochastic SAM, which penalises Tr(H) (Wen et al. 2022). Groups draw their own dropout masks and
  their losses are weighted by their predictions, so as rho -> 0 the objective is the batch's MLM loss. Cost: two
  forward-backward passes.
  Written as an objective rather than with `optax.contrib.sam`, whose opaque mode needs the loss's gradient inside
  `optimizer.update` and whose transparent mode alternates ascent and descent *steps* (doubling the step count
  that schedules, checkpoints and resumption count); the maths is the same.
- "label_noise": each step replaces a fraction `noise_p` of the masked targets by a draw from the model's own
  (stop-gradient) prediction ("model") or from the uniform distribution over words ("uniform"): the label noise of
  Section 4's mechanism made explicit (Blanc et al. 2020; Damian et al. 2021).
- "trace_penalty": L + gamma * a per-step estimate of the batch's curvature trace, differentiated through, with
  `probes` probes: `penalty="fisher"` (default) the model Fisher trace E_y ||grad log p(y | x)||^2 (labels drawn
  from the model; = Tr(H) at the saturation optimum, Lemma 4.2, and never negative) by Rademacher-signed sums of
  score gradients, differentiated with the drawn labels held fixed (Jastrzebski et al. 2021's Fisher penalty; not
  exactly grad Tr(F), see `fisher_penalty`); `penalty="hutchinson"` v^T H v of the Hessian itself
  (forward-over-reverse HVP, unbiased for grad Tr(H)). The Hessian is
  indefinite away from the optimum, so its penalty is unbounded below: on `flatness_seeking.py:tiny` (40 steps,
  gamma 0.01) it drove the Fisher trace from 78 to 1.0e4 and the exact loss up by 0.67 nats; hence the default.
  The Fisher score runs without dropout (`score_forward="clean"`: the Tr(F) that `flatlm.flatness` measures), a
  pass of its own beside the loss's; `score_forward="loss"` scores the loss's own pass, dropout mask included (the
  Fisher trace of the network the step trains, as SAM's ascent uses the loss's pass) and shares it: ~3 plain steps
  of FLOPs instead of ~4 (`fisher_penalized_loss`). A run without dropout shares it either way (the same pass).
`blocks` (SAM and the penalties) restricts the method to some of the model's blocks (flatlm.models.blocks: "all",
"encoder" = every block but the head, or names such as "embed,layer_0/attn"): SAM perturbs only their parameters
(the ascent direction is the batch gradient's part in them), the Fisher penalty is the Fisher trace of their diagonal
block (E_y ||grad_S log p(y | x)||^2) and the Hutchinson penalty Tr(H_SS); every parameter is still trained on the
whole objective. Why: in the flatness_seeking cpu runs ~97 % of the Fisher trace sits in the output head, which SAM
and the full penalty shrink, while the probe reads the encoder (docs/experiments/flatness_seeking-cpu).
Randomness (label draws, probes) comes from `batch["rng"]`, which `train_step` sets to fold_in(seed + 1, step),
so a resumed run repeats it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flatlm.config import check_choice
from flatlm.errors import UserError
from flatlm.models.blocks import ALL, block_mask, parse_blocks
from flatlm.models.losses import mlm_logits, mlm_loss, mlm_loss_of_logits, predicted_weights, sample_labels

METHODS = ("none", "sam", "label_noise", "trace_penalty")
NOISE_SOURCES = ("model", "uniform")
PENALTIES = ("fisher", "hutchinson")
SCORE_FORWARDS = ("clean", "loss")


@dataclasses.dataclass(frozen=True)
class FlatConfig:
    """`train.flat`: method (METHODS), SAM's rho and ascent_groups, label noise's noise_p and noise_source, the
    penalty's gamma, probes and (Fisher) score_forward (SCORE_FORWARDS, see `fisher_penalized_loss`); blocks (SAM
    and the penalties): the blocks the method acts on."""

    method: str = "none"
    rho: float = 0.05
    ascent_groups: int = 1
    noise_p: float = 0.1
    noise_source: str = "model"
    gamma: float = 0.01
    probes: int = 1
    penalty: str = "fisher"
    score_forward: str = "clean"
    blocks: str = ALL


def validate(cfg: FlatConfig, batch_size: int) -> None:
    """One line naming the `train.flat.*` field on failure."""
    check_choice(cfg.method, METHODS, "train.flat.method")
    check_choice(cfg.noise_source, NOISE_SOURCES, "train.flat.noise_source")
    check_choice(cfg.penalty, PENALTIES, "train.flat.penalty")
    check_choice(cfg.score_forward, SCORE_FORWARDS, "train.flat.score_forward")
    if cfg.rho <= 0 or cfg.gamma < 0 or cfg.probes < 1:
        raise UserError("config.train.flat needs rho > 0, gamma >= 0 and probes >= 1")
    if not 0 <= cfg.noise_p <= 1:
        raise UserError(f"config.train.flat.noise_p must be in [0, 1], got {cfg.noise_p}")
    if parse_blocks(cfg.blocks) != (ALL,) and cfg.method not in ("sam", "trace_penalty"):
        raise UserError(f"config.train.flat.blocks={cfg.blocks!r} applies to method sam or trace_penalty, not "
                        f"{cfg.method!r}; leave it at 'all'")
    if cfg.ascent_groups < 1 or batch_size % cfg.ascent_groups:
        raise UserError(f"config.train.flat.ascent_groups={cfg.ascent_groups} must divide data.batch_size="
                        f"{batch_size} (1: SAM on the batch; batch_size: one ascent step per sentence)")


def _squared_norm(tree) -> jax.Array:
    """Sum of squares of every leaf, accumulated in float32 (SAM's ascent scale, the Fisher penalty's ||g||^2)."""
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


def _norm(tree) -> jax.Array:
    return jnp.sqrt(_squared_norm(tree))


def _restrict(tree, mask: tuple[bool, ...]):
    """`tree` with the leaves outside the mask (flatlm.models.blocks.block_mask) set to zero."""
    if all(mask):
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([x if m else jnp.zeros_like(x) for x, m in zip(leaves, mask, strict=True)])


def sam_objective(cfg: FlatConfig):
    """SAM with `cfg.ascent_groups` independent ascent steps (see the module docstring)."""

    def perturbed(params, group, apply_fn, key):
        mask = tuple(block_mask(params, cfg.blocks))  # first: a block the model lacks is an error before any work
        plain, g = jax.value_and_grad(mlm_loss)(params, group, apply_fn, key)
        g = _restrict(g, mask)
        scale = cfg.rho / (_norm(g) + 1e-12)
        eps = jax.tree.map(lambda x: jax.lax.stop_gradient(scale * x).astype(x.dtype), g)
        return mlm_loss(jax.tree.map(jnp.add, params, eps), group, apply_fn, key), plain

    def objective(params, batch, apply_fn, dropout_key):
        data = {k: batch[k] for k in ("tokens", "targets", "weights", "positions") if k in batch}
        if cfg.ascent_groups == 1:  # not vmap over one group: XLA:CPU runs size-1 batched dots slower
            sharp, plain = perturbed(params, data, apply_fn, dropout_key)
        else:
            G = cfg.ascent_groups
            groups = jax.tree.map(lambda x: x.reshape(G, -1, *x.shape[1:]), data)
            # each group its own dropout key: one key for all would drop the same units in every group (the mask
            # is hashed from the key and the position within the group), correlating the batch's dropout noise
            keys = None if dropout_key is None else jax.random.split(dropout_key, G)
            sharp_G, plain_G = jax.vmap(perturbed, in_axes=(None, 0, None, None if keys is None else 0))(
                params, groups, apply_fn, keys)
            # the groups' losses weighted by their predictions, as the batch's MLM loss weights its positions
            # (equal weights only under one prediction per sentence)
            w_G = groups["weights"].reshape(G, -1).sum(-1).astype(jnp.float32)
            mean = lambda x_G: jnp.sum(w_G * x_G) / jnp.maximum(w_G.sum(), 1.0)
            sharp, plain = mean(sharp_G), mean(plain_G)
        plain = jax.lax.stop_gradient(plain)
        return sharp, {"train/mlm_loss": plain, "train/sam_sharpness": sharp - plain}

    return objective


def label_noise_objective(cfg: FlatConfig):
    """MLM on targets of which a fraction noise_p is redrawn from the model or uniformly, per step."""

    def objective(params, batch, apply_fn, dropout_key):
        k_pick, k_draw = jax.random.split(batch["rng"])
        targets = batch["targets"]
        if cfg.noise_source == "model" and "positions" in batch:  # the head at the predicted positions only,
            # with the uniforms of a draw at every position (the same labels as the branch below, ~P / T the work)
            pos_BP = batch["positions"]
            u_BP1 = jnp.take_along_axis(jax.random.uniform(k_draw, targets.shape + (1,)), pos_BP[..., None], axis=1)
            logits_BPV = jax.lax.stop_gradient(apply_fn({"params": params}, batch["tokens"], positions_BP=pos_BP))
            drawn = targets.at[jnp.arange(targets.shape[0])[:, None], pos_BP].set(
                sample_labels(None, logits_BPV, u_BP1))  # unpredicted positions keep their (weight-0) targets
        elif cfg.noise_source == "model":
            logits = jax.lax.stop_gradient(apply_fn({"params": params}, batch["tokens"]))
            drawn = sample_labels(k_draw, logits)
        else:
            num_words = jax.eval_shape(apply_fn, {"params": params}, batch["tokens"][:1]).shape[-1]  # shape only
            drawn = jax.random.randint(k_draw, targets.shape, 0, num_words)
        flip = jax.random.bernoulli(k_pick, cfg.noise_p, targets.shape)
        noisy = {**batch, "targets": jnp.where(flip, drawn, targets).astype(targets.dtype)}
        return mlm_loss(params, noisy, apply_fn, dropout_key), {"train/noisy_fraction": flip.mean()}

    return objective


def _probe_sum(one, keys: jax.Array) -> jax.Array:
    """Sum of one(k) over `keys`: unrolled up to 4 keys, else mapped one at a time (lax.map, compiled once). Not
    vmap: it batches the parameter-shaped probes and tangents into batched matmuls, which XLA:CPU ran 1.8x (one
    probe) to 2.6x (two) slower for the Hutchinson penalty's gradient (d128, B64)."""
    if len(keys) > 4:
        return jnp.sum(jax.lax.map(one, keys))
    return sum((one(keys[i]) for i in range(len(keys))), jnp.zeros((), jnp.float32))


def hutchinson_penalty(params, batch, apply_fn, key, probes: int, blocks: str = ALL) -> jax.Array:
    """Mean over `probes` Rademacher v (zero outside `blocks`) of v^T H v, H the Hessian of the batch's MLM loss
    (dropout off): an estimate of Tr(H_SS), the trace of the blocks' diagonal block."""
    mask = tuple(block_mask(params, blocks))
    loss = lambda p: mlm_loss(p, batch, apply_fn)
    leaves, treedef = jax.tree.flatten(params)

    def one(k):
        keys = jax.random.split(k, len(leaves))
        v = _restrict(treedef.unflatten([jax.random.rademacher(kk, x.shape, x.dtype)
                                         for kk, x in zip(keys, leaves, strict=True)]), mask)
        hv = jax.jvp(jax.grad(loss), (params,), (v,))[1]
        return sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(v), jax.tree.leaves(hv), strict=True))

    return _probe_sum(one, jax.random.split(key, probes)) / probes


def _data(batch) -> dict:
    """The arrays of `batch` the losses read (not its rng): the custom VJPs below take them as one argument."""
    return {k: batch[k] for k in ("tokens", "targets", "weights", "positions") if k in batch}


def _score_setup(batch, key):
    """(the weights [B, T] or [B, P] the scores sum over, n = their count, the label key, the probes' key)."""
    # with positions the head runs at the predicted positions only (`losses.mlm_loss`)
    weights = batch["weights"] if batch.get("positions") is None else predicted_weights(batch)
    k_y, k_eps = jax.random.split(key)
    return weights, jnp.maximum(weights.sum(), 1.0), k_y, k_eps


def fisher_penalty(params, batch, apply_fn, key, probes: int, blocks: str = ALL) -> jax.Array:
    """Unbiased estimate of the model Fisher trace of the batch's mean MLM loss, (1/n) sum_i w_i E_y ||g_i(y)||^2
    with g_i(y) = grad log p(y | x_i) over the weighted positions (weights w_i, n their sum; 0/1 from the pipeline):
    y drawn from the model (stop-gradient), then the mean over `probes` Rademacher sign vectors eps of
    ||grad sum_i eps_i sqrt(w_i) log p(y_i | x_i)||^2 / n (cross terms vanish).
    Its gradient is 2 H_s g / n (H_s the Hessian of the signed score, g its gradient), formed forward-over-reverse
    (`_score_norm`): 2.7 gradients instead of 3.5 for reverse-over-reverse (d128 x 2L, batch 64, CPU). That is the
    gradient with the drawn labels held fixed (the Fisher penalty of Jastrzebski et al. 2021, "Catastrophic Fisher
    explosion"), not the gradient of Tr(F): the labels' dependence on the params, E_y[||g(y)||^2 grad log p(y)], is
    left out (an audit on a tiny BERT: the two gradients at cosine 0.87). The value is unbiased for Tr(F). With
    `blocks` the norms are over those blocks' parameters only: the Fisher trace of their diagonal block. Dropout
    off."""
    mask = tuple(block_mask(params, blocks))
    weights, n, k_y, k_eps = _score_setup(batch, key)

    def one(k):
        eps = jax.random.rademacher(k, weights.shape, jnp.float32) * jnp.sqrt(weights)
        return _score_norm(apply_fn, mask, params, eps, k_y, _data(batch), None)

    return _probe_sum(one, jax.random.split(k_eps, probes)) / (n * probes)


def _score_and_loss(params, t, apply_fn, eps, key_y, data, dropout_key):
    """(sum_i eps_i log p(y_i | x_i) + t * the MLM loss, the MLM loss), both from one forward pass (`mlm_logits`),
    y drawn from its own (stop-gradient) logits: the key is shared by the probes, so every probe scores the same
    draw. eps is [B, T], or [B, P] at the positions (then the head runs there only). t = 0 for the score alone."""
    logits = mlm_logits(params, data, apply_fn, dropout_key)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    y = sample_labels(key_y, jax.lax.stop_gradient(logp))
    loss = mlm_loss_of_logits(logits, data)
    return jnp.sum(eps * jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]) + t * loss, loss


def _score_grad(params, t, apply_fn, eps, key_y, data, dropout_key):
    """(grad_params of `_score_and_loss`, the MLM loss)."""
    return jax.grad(_score_and_loss, has_aux=True)(params, t, apply_fn, eps, key_y, data, dropout_key)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _score_norm(apply_fn, mask, params, eps, key_y, data, dropout_key) -> jax.Array:
    """||P g||^2, g the signed score's gradient, P zeroing the leaves outside `mask`; differentiable in params only
    (eps, labels, data and the dropout mask are data)."""
    return _squared_norm(_restrict(_score_grad(params, 0.0, apply_fn, eps, key_y, data, dropout_key)[0], mask))


def _score_norm_fwd(apply_fn, mask, params, eps, key_y, data, dropout_key):
    """The value and H_s P g in one linearisation (the gradient of ||P g||^2 is 2 H_s P g, P a projection): the
    gradient's primal pass once, then one tangent pass at P g."""
    g, tangent = jax.linearize(lambda p: _score_grad(p, 0.0, apply_fn, eps, key_y, data, dropout_key)[0], params)
    pg = _restrict(g, mask)
    return _squared_norm(pg), tangent(pg)


def _score_norm_bwd(apply_fn, mask, hg, ct):
    return jax.tree.map(lambda x: (2 * ct * x).astype(x.dtype), hg), None, None, None, None


_score_norm.defvjp(_score_norm_fwd, _score_norm_bwd)


def fisher_penalized_loss(params, batch, apply_fn, dropout_key, gamma: float, probes: int, blocks: str = ALL):
    """(L + gamma * F, L, F): the MLM loss L and the Fisher penalty F (`fisher_penalty`, the same draws from
    `batch["rng"]`) with the score pass on the loss's own forward pass, dropout mask included. The first probe
    shares that pass with the loss: its gradient grad L + (2 gamma / (n probes)) H_s P g comes out of one tangent
    pass, the tangent at (P g, t = 1) of grad_params [score + t L] at t = 0, whose backward carries both
    cotangents; 3 plain steps of FLOPs instead of 4 for L and F apart. Differentiable in params, through the
    first output only (the caller stops the others)."""
    mask = tuple(block_mask(params, blocks))
    weights, n, k_y, k_eps = _score_setup(batch, batch["rng"])
    signs = [jax.random.rademacher(k, weights.shape, jnp.float32) * jnp.sqrt(weights)
             for k in jax.random.split(k_eps, probes)]
    data = _data(batch)
    total, loss, first = _loss_plus_score_norm(apply_fn, mask, params, gamma / (n * probes), signs[0], k_y, data,
                                               dropout_key)
    rest = _probe_sum(lambda eps: _score_norm(apply_fn, mask, params, eps, k_y, data, dropout_key),
                      jnp.stack(signs[1:])) if probes > 1 else jnp.zeros((), jnp.float32)
    trace = (jax.lax.stop_gradient(first) + rest) / (n * probes)
    return total + gamma * rest / (n * probes), loss, trace


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _loss_plus_score_norm(apply_fn, mask, params, coef, eps, key_y, data, dropout_key):
    """(L + coef ||P g||^2, L, ||P g||^2) on one forward pass; its VJP is the first output's (see
    `fisher_penalized_loss`)."""
    g, loss = _score_grad(params, 0.0, apply_fn, eps, key_y, data, dropout_key)
    sq = _squared_norm(_restrict(g, mask))
    return loss + coef * sq, loss, sq


def _loss_plus_score_norm_fwd(apply_fn, mask, params, coef, eps, key_y, data, dropout_key):
    g, tangent, loss = jax.linearize(lambda p, t: _score_grad(p, t, apply_fn, eps, key_y, data, dropout_key),
                                     params, jnp.zeros((), jnp.float32), has_aux=True)
    pg = _restrict(g, mask)
    sq = _squared_norm(pg)
    both = tangent(jax.tree.map(lambda x: (2 * coef * x).astype(x.dtype), pg), jnp.ones((), jnp.float32))
    return (loss + coef * sq, loss, sq), both


def _loss_plus_score_norm_bwd(apply_fn, mask, both, ct):
    return jax.tree.map(lambda x: (ct[0] * x).astype(x.dtype), both), None, None, None, None, None


_loss_plus_score_norm.defvjp(_loss_plus_score_norm_fwd, _loss_plus_score_norm_bwd)


def trace_penalty_objective(cfg: FlatConfig):
    """L + gamma * (the Fisher or Hutchinson estimate of the batch's curvature trace). The Fisher penalty scores
    the model without dropout (score_forward "clean": the Tr(F) the evaluator measures) or on the loss's own
    forward pass with its dropout mask ("loss"); either way it shares the loss's pass (`fisher_penalized_loss`)
    when the two are the same pass, i.e. when the run has no dropout (dropout_key None)."""
    estimate = fisher_penalty if cfg.penalty == "fisher" else hutchinson_penalty

    def objective(params, batch, apply_fn, dropout_key):
        if cfg.penalty == "fisher" and (cfg.score_forward == "loss" or dropout_key is None):
            total, loss, trace = fisher_penalized_loss(params, batch, apply_fn, dropout_key, cfg.gamma, cfg.probes,
                                                       cfg.blocks)
        else:
            loss = mlm_loss(params, batch, apply_fn, dropout_key)
            trace = estimate(params, batch, apply_fn, batch["rng"], cfg.probes, cfg.blocks)
            total = loss + cfg.gamma * trace
        return total, {"train/mlm_loss": jax.lax.stop_gradient(loss),
                       "train/trace_estimate": jax.lax.stop_gradient(trace)}

    return objective


def make_objective(cfg: FlatConfig):
    """The objective of `cfg.method`, or None for "none" (plain MLM)."""
    return {"none": lambda c: None, "sam": sam_objective, "label_noise": label_noise_objective,
            "trace_penalty": trace_penalty_objective}[cfg.method](cfg)
