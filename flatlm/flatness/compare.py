"""One-call flatness measurements on `(apply_fn, params, batches)`: what the CLI and notebooks use.

- `measure(method, apply_fn, params, batches, key, ...)` -> TraceEstimate, method in METHODS.
- `gap_report(apply_fn, params, batches, key, ...)` -> dict: Tr(H) on true labels, Tr(Fisher) under the model,
  the empirical Fisher and the loss, to show when the saturation-regime identity E[H] = F holds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from flatlm.flatness.estimates import GroupFn, TraceEstimate
from flatlm.flatness.fisher import ApplyFn, empirical_fisher_trace, fisher_trace, fisher_vp
from flatlm.flatness.hessian import exact_trace, hutchinson_trace, hutchpp_trace
from flatlm.models.losses import mlm_loss

METHODS = ("fisher", "hutchinson", "hutchpp", "exact", "empirical_fisher")


@functools.lru_cache(maxsize=16)
def _mlm_loss_fn(apply_fn: ApplyFn):
    """loss_fn(params, batch), cached per apply_fn so jitted estimators compile once per model."""
    return functools.partial(_loss, apply_fn=apply_fn)


def _loss(params, batch, apply_fn):
    return mlm_loss(params, batch, apply_fn)


@functools.lru_cache(maxsize=16)
def _fisher_matvec(apply_fn: ApplyFn):
    return lambda p, v, b: fisher_vp(apply_fn, p, b, v)


def measure(
    method: str,
    apply_fn: ApplyFn,
    params,
    batches: Iterable[dict],
    key: jax.Array,
    *,
    num_probes: int = 100,
    num_draws: int = 50,
    fisher_form: str = "per_sample",
    chunk_size: int = 1,
    groups: GroupFn | str | None = None,
) -> TraceEstimate:
    """Flatness of the MLM loss over `batches` (deterministic model, no dropout).

    fisher: Tr(Fisher) under the model, the paper's measure (`num_draws` per context, `fisher_form` per_sample or
    summed); hutchinson: Tr(Hessian) on true labels, `num_probes` Rademacher probes per batch (the released code's
    measure, with Rademacher instead of Gaussian probes); hutchpp: Tr(Fisher) by Hutch++ with `num_probes`
    Fisher-vector products; exact: Tr(Hessian) via jax.hessian (tiny models); empirical_fisher: true labels.
    """
    batches = [batches] if isinstance(batches, dict) else list(batches)
    if method == "fisher":
        return fisher_trace(apply_fn, params, batches, key, num_draws=num_draws, method=fisher_form, groups=groups)
    if method == "hutchinson":
        return hutchinson_trace(_mlm_loss_fn(apply_fn), params, key, num_probes, batches=batches,
                                chunk_size=chunk_size, groups=groups)
    if method == "hutchpp":
        return hutchpp_trace(_fisher_matvec(apply_fn), params, key, num_probes, batches=batches,
                             chunk_size=chunk_size, groups=groups)
    if method == "exact":
        return exact_trace(_mlm_loss_fn(apply_fn), params, batches=batches, groups=groups)
    if method == "empirical_fisher":
        return empirical_fisher_trace(apply_fn, params, batches, groups=groups)
    raise ValueError(f"unknown flatness method {method!r}; choose one of {', '.join(METHODS)}")


def gap_report(
    apply_fn: ApplyFn,
    params,
    batches: Iterable[dict],
    key: jax.Array,
    *,
    num_probes: int = 100,
    num_draws: int = 50,
    fisher_form: str = "per_sample",
    chunk_size: int = 1,
    groups: GroupFn | str | None = None,
) -> dict[str, Any]:
    """Hessian vs Fisher on the same params and batches, as a JSON-able dict.

    hessian: Hutchinson Tr(H) of the MLM loss on true labels; fisher: Tr(F) under the model; empirical_fisher:
    true-label Fisher; loss: mean MLM loss (nats). E[H] = F holds when the model's conditionals equal the data's
    (saturation regime); `hessian_minus_fisher` with its stderr and z-score says how far from that a model is.
    """
    batches = [batches] if isinstance(batches, dict) else list(batches)
    k_h, k_f = jax.random.split(key)
    hess = measure("hutchinson", apply_fn, params, batches, k_h, num_probes=num_probes, chunk_size=chunk_size,
                   groups=groups)
    fish = measure("fisher", apply_fn, params, batches, k_f, num_draws=num_draws, fisher_form=fisher_form,
                   groups=groups)
    emp = measure("empirical_fisher", apply_fn, params, batches, k_f, groups=groups)
    loss = float(np.mean([float(jax.jit(_mlm_loss_fn(apply_fn))(params, b)) for b in batches]))
    gap = hess.mean - fish.mean
    gap_se = math.sqrt(hess.stderr**2 + fish.stderr**2)
    return {
        "loss": loss,
        "num_batches": len(batches),
        "hessian": hess.to_dict(),
        "fisher": fish.to_dict(),
        "empirical_fisher": emp.to_dict(),
        "hessian_minus_fisher": gap,
        "hessian_minus_fisher_stderr": gap_se,
        "hessian_minus_fisher_z": gap / gap_se if gap_se > 0 else None,
        "fisher_over_hessian": fish.mean / hess.mean if hess.mean != 0 else None,
        "empirical_over_fisher": emp.mean / fish.mean if fish.mean != 0 else None,
        "identity_within_3se": bool(abs(gap) <= 3 * gap_se),
    }
