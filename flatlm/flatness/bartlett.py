"""Lemma 4.2 (the Bartlett identity) and Section 4's noise mechanism, checked on MLM models.

Identity: at the optimum of a cross-entropy objective whose labels follow the model's own conditionals, the
Hessian's expectation equals the gradient covariance, which equals the Fisher:
  E_y[grad^2 (-log p_y)] = J^T (diag p - p p^T) J = E_y[g_y g_y^T] = F,   g_y = grad log p_y,  E_y[g_y] = 0,
because the Hessian's other term sum_k (p_k - [k = y]) grad^2 logit_k has zero mean under y ~ p. `bartlett_check`
computes the two sides by different derivatives: Tr(H) by second-order autodiff (jax.hessian, or Hutchinson's
Hessian-vector products) of the cross-entropy, and Tr(F) from first-order per-label gradients
(`flatlm.flatness.fisher`), on three label sources: the label-enumerated expectation (`expected`: the identity
exactly, up to rounding), labels drawn from the model (`sampled`: equal in expectation, within the sampling error)
and the batch's own targets (`true`: equal only where the model's conditionals are the data's, i.e. at saturation).

Noise ablation (`noise_ablation`): from one converged point, full-batch GD on the population loss (zero gradient at
the optimum: it stays) against SGD on fresh samples (its noise has covariance Hessian / B there, so it drifts
towards smaller Tr(H), faster for larger lr / B; Theorem 4.3). `population_batch` and `teacher_sampler` build the
population loss and the fresh samples of a teacher's conditionals for tiny models.

Batches are MLM batches (tokens, targets, weights) for `apply_fn({"params": p}, tokens, deterministic=True)`; the
cross-entropy here keeps the logits' precision (float64 under x64), unlike the training loss's float32 cast.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from flatlm.flatness.estimates import acc_dtype, batch_list
from flatlm.flatness.fisher import ApplyFn, exact_fisher_trace, fisher_surrogate_loss, fisher_trace
from flatlm.flatness.hessian import hutchinson_trace
from flatlm.models.losses import sample_labels
from flatlm.run import load_run

Batch = dict[str, Any]


def ce_loss(params, batch: Batch, apply_fn: ApplyFn) -> jax.Array:
    """(1/W) sum_i w_i (-log p_i(target_i)) in the logits' precision (at least float32)."""
    logits_BTV = apply_fn({"params": params}, batch["tokens"], deterministic=True)
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(acc_dtype(logits_BTV)), axis=-1)
    w_BT = batch["weights"].astype(logp_BTV.dtype)
    safe_BT = jnp.where(batch["weights"] > 0, batch["targets"], 0)
    nll_BT = -jnp.take_along_axis(logp_BTV, safe_BT[..., None], axis=-1)[..., 0]
    return jnp.sum(w_BT * nll_BT) / jnp.maximum(jnp.sum(w_BT), 1e-30)


@functools.lru_cache(maxsize=16)
def _loss_fn(apply_fn: ApplyFn, kind: str):
    """loss_fn(params, batch) for the estimators, cached per apply_fn (jit compiles once per model)."""
    if kind == "expected":
        return lambda p, b: fisher_surrogate_loss(p, b, apply_fn)
    return lambda p, b: ce_loss(p, b, apply_fn)


def model_labels(apply_fn: ApplyFn, params, batch: Batch, key: jax.Array) -> Batch:
    """`batch` with every target replaced by a draw from the model's conditional at that position."""
    logits_BTV = apply_fn({"params": params}, jnp.asarray(batch["tokens"]), deterministic=True)
    y_BT = sample_labels(key, logits_BTV)
    return {**batch, "targets": np.asarray(y_BT).astype(np.asarray(batch["targets"]).dtype)}


@functools.lru_cache(maxsize=32)
def _dense_trace(loss_fn):
    """jit(params, batch -> Tr of the dense jax.hessian of loss_fn(., batch)), compiled once per loss_fn (the
    shared `exact_trace` recompiles per call, which dominates many small calls)."""
    def tr(params, batch):
        flat, unravel = ravel_pytree(params)
        return jnp.trace(jax.hessian(lambda x: loss_fn(unravel(x), batch))(flat))
    return jax.jit(tr)


def _hessian_trace(loss_fn, params, batches, key, method: str, num_probes: int) -> tuple[float, float]:
    if method == "exact":
        return float(np.mean([float(_dense_trace(loss_fn)(params, b)) for b in batches])), 0.0
    est = hutchinson_trace(loss_fn, params, key, num_probes, batches=batches, chunk_size=min(8, num_probes))
    # the error of the trace over exactly these batches (the Fisher is measured on the same ones): the probes'
    # alone; `stderr` over several batches also counts their spread as data (~2.7x too wide, an audit measured)
    return est.mean, est.given_data_stderr


def bartlett_check(apply_fn: ApplyFn, params, batches: Batch | Iterable[Batch], key: jax.Array, *,
                   hessian: str = "exact", num_probes: int = 64, num_label_draws: int = 8,
                   label_sources: Sequence[str] = ("expected", "sampled", "true"), fisher: str = "exact",
                   fisher_draws: int = 50) -> dict[str, Any]:
    """Tr(H) against Tr(F) on the same contexts (the Bartlett identity, Lemma 4.2), as a JSON-able dict.

    fisher: Tr(F) under the model from first-order gradients: "exact" (labels enumerated, stderr 0; builds the
    Jacobian of the log-probabilities, tiny models) or "sampled" (`fisher_trace`, `fisher_draws` labels per
    context; its stderr enters the gaps' z). For each label source
    a dict {trace, stderr, gap (trace - fisher), z (gap / stderr, None if stderr is 0), rel_gap (gap / fisher)}:
    expected: Tr of the Hessian of the loss averaged over y ~ p with p held fixed (the expectation the identity is
      about; equal to fisher up to rounding at any params); sampled: mean over `num_label_draws` draws of labels from
      the model of Tr(H) of the cross-entropy on them (stderr over draws, which holds Hutchinson's noise); true:
      Tr(H) on the batches' own targets (equal to fisher only at saturation). Also grad_norm (of the loss on true
      targets: ~0 at the optimum). hessian: "exact" (jax.hessian; tiny models) or "hutchinson" with `num_probes`
      probes."""
    bs = batch_list(batches)
    bs = [{k: jnp.asarray(v) for k, v in b.items()} for b in bs]
    if hessian not in ("exact", "hutchinson"):
        raise ValueError(f"hessian must be 'exact' or 'hutchinson', got {hessian!r}")
    if fisher not in ("exact", "sampled"):
        raise ValueError(f"fisher must be 'exact' or 'sampled', got {fisher!r}")
    if fisher == "exact":
        fisher_mean, fisher_se = exact_fisher_trace(apply_fn, params, bs).mean, 0.0
    else:
        est = fisher_trace(apply_fn, params, bs, jax.random.fold_in(key, 10**7), num_draws=fisher_draws)
        # the error of Tr(F) over exactly these contexts (the Hessians are taken on them too): the draws' alone
        fisher_mean, fisher_se = est.mean, est.given_data_stderr
    out: dict[str, Any] = {"fisher": fisher_mean, "fisher_stderr": fisher_se, "hessian_method": hessian}
    ce = _loss_fn(apply_fn, "ce")

    def entry(trace, stderr):
        gap, se = trace - fisher_mean, math.hypot(stderr, fisher_se)
        return {"trace": trace, "stderr": stderr, "gap": gap, "z": gap / se if se > 0 else None,
                "rel_gap": gap / fisher_mean if fisher_mean else None}

    for i, source in enumerate(label_sources):
        k = jax.random.fold_in(key, i)
        if source == "expected":
            out[source] = entry(*_hessian_trace(_loss_fn(apply_fn, "expected"), params, bs, k, hessian, num_probes))
        elif source == "true":
            out[source] = entry(*_hessian_trace(ce, params, bs, k, hessian, num_probes))
        elif source == "sampled":
            draws = []
            for d in range(num_label_draws):
                kd = jax.random.fold_in(k, d)
                lab = [model_labels(apply_fn, params, b, jax.random.fold_in(kd, j)) for j, b in enumerate(bs)]
                draws.append(_hessian_trace(ce, params, lab, jax.random.fold_in(kd, 10**6), hessian, num_probes))
            means = np.array([m for m, _ in draws])
            # the draws' spread already holds each draw's probe noise: with one draw, that noise alone
            se = (means.std(ddof=1) / math.sqrt(len(means)) if len(means) > 1
                  else math.sqrt(sum(s**2 for _, s in draws)) / len(draws))
            out[source] = entry(float(means.mean()), float(se))
        else:
            raise ValueError(f"unknown label source {source!r}; use expected, sampled or true")
    grads = [jax.grad(ce)(params, b) for b in bs]
    out["grad_norm"] = float(np.linalg.norm(np.mean([np.asarray(ravel_pytree(g)[0]) for g in grads], axis=0)))
    return out


# --------------------------------------------------------------------------------------------------------------
# A teacher's population and fresh samples of it, and the GD-vs-SGD ablation from a converged point.


def population_batch(apply_fn: ApplyFn, teacher_params, tokens_NT) -> Batch:
    """The teacher's population over the contexts `tokens_NT` (uniform) as one MLM batch: row (n, y) carries target
    y at every position, weighted by the teacher's p(y | context n, position); its cross-entropy is the population
    loss, minimised (gradient 0) by any params whose conditionals equal the teacher's."""
    tokens_NT = jnp.asarray(tokens_NT)
    logits_NTV = apply_fn({"params": teacher_params}, tokens_NT, deterministic=True)
    p_NTV = jax.nn.softmax(logits_NTV.astype(acc_dtype(logits_NTV)), axis=-1)
    N, T, V = p_NTV.shape
    return {"tokens": jnp.repeat(tokens_NT, V, axis=0),
            "targets": jnp.tile(jnp.repeat(jnp.arange(V)[:, None], T, axis=1), (N, 1)),
            "weights": jnp.transpose(p_NTV, (0, 2, 1)).reshape(N * V, T)}


def teacher_sampler(apply_fn: ApplyFn, teacher_params, tokens_NT) -> Callable[[jax.Array, int], Batch]:
    """sample(key, B): B contexts drawn uniformly from `tokens_NT`, every position's target drawn from the teacher
    (fresh samples of `population_batch`'s distribution; jittable)."""
    tokens_NT = jnp.asarray(tokens_NT)
    logits_NTV = apply_fn({"params": teacher_params}, tokens_NT, deterministic=True)

    def sample(key, B):
        k_idx, k_y = jax.random.split(key)
        idx = jax.random.randint(k_idx, (B,), 0, tokens_NT.shape[0])
        y = sample_labels(k_y, logits_NTV[idx])
        return {"tokens": tokens_NT[idx], "targets": y, "weights": jnp.ones(y.shape, logits_NTV.dtype)}

    return sample


def noise_ablation(apply_fn: ApplyFn, params, population: Batch, sample: Callable[[jax.Array, int], Batch],
                   runs: Sequence[tuple[float, int]], steps: int, log_every: int, key: jax.Array,
                   trace_fn: Callable[[Any], float] | None = None) -> list[dict[str, Any]]:
    """From the same (converged) params, one run per (lr, batch_size): batch_size 0 is full-batch GD on the
    `population` loss, B > 0 is SGD on fresh batches `sample(key, B)`. Every `log_every` steps record the population
    loss and `trace_fn(params)` (default: exact Tr(H) of the population loss; tiny models). Each run's dict has lr,
    batch_size, step, loss, trace, rate = (trace[0] - trace[-1]) / steps and mean_rate = (trace[0] - mean of the
    later logged traces) / steps (the flattening speed; SGD's iterate fluctuates, so the mean is the steadier)."""
    loss = _loss_fn(apply_fn, "ce")
    pop = {k: jnp.asarray(v) for k, v in population.items()}
    trace_fn = trace_fn or (lambda p: float(_dense_trace(loss)(p, pop)))
    loss_jit = jax.jit(loss)
    chunks: dict[int, Callable] = {}  # one compilation per batch size; lr is traced

    def make_chunk(B):
        def chunk(p, keys, lr):
            def step(p, k):
                batch = pop if B == 0 else sample(k, B)
                return jax.tree.map(lambda a, g: a - lr * g, p, jax.grad(loss)(p, batch)), None
            return jax.lax.scan(step, p, keys)[0]
        return jax.jit(chunk)

    out = []
    for lr, B in runs:
        chunk = chunks.setdefault(B, make_chunk(B))
        p, done = params, 0
        rec = {"lr": lr, "batch_size": B, "step": [0], "loss": [float(loss_jit(p, pop))], "trace": [trace_fn(p)]}
        while done < steps:
            n = min(log_every, steps - done)
            p = chunk(p, jax.random.split(jax.random.fold_in(key, done), n), lr)
            done += n
            rec["step"].append(done)
            rec["loss"].append(float(loss_jit(p, pop)))
            rec["trace"].append(trace_fn(p))
        rec["rate"] = (rec["trace"][0] - rec["trace"][-1]) / steps
        rec["mean_rate"] = (rec["trace"][0] - float(np.mean(rec["trace"][1:]))) / steps if steps else 0.0
        out.append(rec)
    return out


def checkpoint_bartlett(workdir: str, key: jax.Array, *, step: int | None = None, num_batches: int = 4,
                        batch_size: int = 32, hessian: str = "hutchinson", num_probes: int = 32,
                        num_label_draws: int = 4, fisher: str = "sampled") -> dict[str, Any]:
    """`bartlett_check` on a run's checkpoint (the last one unless `step`), on `num_batches` masked validation
    batches: labels sampled from the model (the identity in expectation) and the data's own labels (the identity
    only at saturation, where the model's conditionals are the data's), against the sampled (default) or exact
    Fisher. Adds step and workdir. Measured on the cpu HMM preset's BiLSTM at exact KL 0.012 (2 cores, 2 min, exact
    Fisher): Tr(F) 18.02, Tr(H) on model labels 18.02 +- 0.93, on the data's labels 18.20 +- 0.53."""
    run = load_run(workdir)
    steps = run.steps
    if not steps:
        raise ValueError(f"no checkpoint in {workdir}")
    step = steps[-1] if step is None else step
    params = run.load_params(step)
    batches = run.mlm_batches(num_batches, batch_size, seed=0)
    out = bartlett_check(run.apply_fn, params, batches, key, hessian=hessian, num_probes=num_probes,
                         num_label_draws=num_label_draws, label_sources=("sampled", "true"), fisher=fisher)
    return {"workdir": workdir, "step": step, **out}
