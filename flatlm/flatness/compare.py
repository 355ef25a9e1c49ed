"""One-call flatness measurements on `(apply_fn, params, batches)`: what the CLI and notebooks use.

- `measure(method, apply_fn, params, batches, key, ...)` -> TraceEstimate, method in METHODS.
- `gap_report(apply_fn, params, batches, key, ...)` -> dict: Tr(H) on true labels, Tr(Fisher) under the model,
  the empirical Fisher and the loss, to show when the saturation-regime identity E[H] = F holds.
- `spectrum_report(apply_fn, params, batches, key, ...)` -> dict: the Hessian's top-k eigenvalues (Lanczos, with
  Ritz error bounds) and its stochastic-Lanczos-quadrature density with the moments Tr(H^p), p = 1..4.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from flatlm.flatness import spectrum, trace_estimators
from flatlm.flatness.estimates import GroupFn, TraceEstimate, batch_list, paired_difference
from flatlm.flatness.fisher import ApplyFn, empirical_fisher_trace, fisher_trace, fisher_vp
from flatlm.flatness.hessian import exact_trace, hutchinson_trace, hutchpp_trace, hvp, mean_over_batches
from flatlm.models.losses import mlm_loss
from flatlm.sharding import keep_layout, layout, place_like

METHODS = ("fisher", "hutchinson", "hutchpp", "xtrace", "exact", "empirical_fisher")


@functools.lru_cache(maxsize=16)
def _mlm_loss_fn(apply_fn: ApplyFn):
    """loss_fn(params, batch), cached per apply_fn so jitted estimators compile once per model."""
    return functools.partial(_loss, apply_fn=apply_fn)


def _loss(params, batch, apply_fn):
    return mlm_loss(params, batch, apply_fn)


@functools.lru_cache(maxsize=16)
def _fisher_matvec(apply_fn: ApplyFn):
    return lambda p, v, b: fisher_vp(apply_fn, p, b, v)


@functools.lru_cache(maxsize=16)
def _hvp_batch(apply_fn: ApplyFn):
    """Jitted (params, v, batch, kept=layout) -> H_batch v for the MLM loss (forward-over-reverse; nothing kept
    between calls), returned in the layout `kept` (`flatlm.sharding.layout` form; None: XLA's)."""
    loss = _mlm_loss_fn(apply_fn)

    @functools.partial(jax.jit, static_argnames="kept")
    def mlm_hvp(p, v, b, kept=None):
        return keep_layout(hvp(lambda q: loss(q, b), p, v), kept)

    return mlm_hvp


def hessian_matvec(apply_fn: ApplyFn, params, batches: list[dict]):
    """v -> H v, H the Hessian of the MLM loss averaged over `batches` (one HVP = one pass over them), v and H v
    laid out as `params` (on a mesh XLA laid the product out its own way, so Lanczos's ravel of it compiled a
    second time, for that layout, and resharded every product)."""
    hv, kept = _hvp_batch(apply_fn), layout(params)

    def matvec(v):
        v = place_like(params, v)  # as the params are, whichever program made it (Lanczos, a preconditioner)
        return mean_over_batches(lambda b: hv(params, v, b, kept=kept), batches)

    return matvec


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
    Fisher-vector products; xtrace: Tr(Hessian) on true labels by XTrace (`trace_estimators.xtrace`) with a budget
    of `num_probes` Hessian-vector products (each a pass over the batches; num_probes / 2 parameter copies held);
    exact: Tr(Hessian) via jax.hessian (tiny models); empirical_fisher: true labels.
    """
    batches = batch_list(batches)
    if method == "fisher":
        return fisher_trace(apply_fn, params, batches, key, num_draws=num_draws, method=fisher_form, groups=groups)
    if method == "hutchinson":
        return hutchinson_trace(_mlm_loss_fn(apply_fn), params, key, num_probes, batches=batches,
                                chunk_size=chunk_size, groups=groups)
    if method == "hutchpp":
        return hutchpp_trace(_fisher_matvec(apply_fn), params, key, num_probes, batches=batches,
                             chunk_size=chunk_size, groups=groups)
    if method == "xtrace":
        return trace_estimators.xtrace(_mlm_loss_fn(apply_fn), params, key, num_probes, batches=batches,
                                       chunk_size=chunk_size)
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
    Both traces see the same batches, so over several batches the gap's stderr is that of the per-batch
    differences (`estimates.paired_difference`; "hessian_minus_fisher_error" says which form was used): the data
    noise the two share cancels instead of being counted twice. That error has B - 1 degrees of freedom
    ("hessian_minus_fisher_dof"), so judge the gap by "hessian_minus_fisher_p" (two-sided, Student's t; normal for
    one batch) rather than by `identity_within_3se`, which reads z as normal.
    """
    batches = batch_list(batches)
    k_h, k_f = jax.random.split(key)
    hess = measure("hutchinson", apply_fn, params, batches, k_h, num_probes=num_probes, chunk_size=chunk_size,
                   groups=groups)
    fish = measure("fisher", apply_fn, params, batches, k_f, num_draws=num_draws, fisher_form=fisher_form,
                   groups=groups)
    emp = measure("empirical_fisher", apply_fn, params, batches, k_f, groups=groups)
    loss = float(np.mean([float(jax.jit(_mlm_loss_fn(apply_fn))(params, b)) for b in batches]))
    from scipy import stats  # here: the CLI imports this module at start-up

    gap, gap_se, paired = paired_difference(hess, fish)
    z = gap / gap_se if gap_se > 0 else None
    # the paired error is estimated from the batches' differences: B - 1 degrees of freedom (1 with two batches,
    # where a z of 3 means little); the probe errors are from many samples (normal)
    dof = hess.num_batches - 1 if paired == "paired" else None
    p = None if z is None else float(2 * (stats.t.sf(abs(z), dof) if dof else stats.norm.sf(abs(z))))
    return {
        "loss": loss,
        "num_batches": len(batches),
        "hessian": hess.to_dict(),
        "fisher": fish.to_dict(),
        "empirical_fisher": emp.to_dict(),
        "hessian_minus_fisher": gap,
        "hessian_minus_fisher_stderr": gap_se,
        "hessian_minus_fisher_z": z,
        "hessian_minus_fisher_error": paired,
        "hessian_minus_fisher_dof": dof,
        "hessian_minus_fisher_p": p,
        "fisher_over_hessian": fish.mean / hess.mean if hess.mean != 0 else None,
        "empirical_over_fisher": emp.mean / fish.mean if fish.mean != 0 else None,
        "identity_within_3se": bool(abs(gap) <= 3 * gap_se),
    }


def spectrum_report(apply_fn: ApplyFn, params, batches: Iterable[dict], key: jax.Array, *, k: int = 20,
                    density_probes: int = 0, density_iters: int = 30, moments: int = 4) -> dict[str, Any]:
    """The spectrum of H, the Hessian of the MLM loss averaged over `batches` (the operator `hutchinson` traces),
    as a JSON-able dict: "top" (k > 0): the k largest Ritz values of k + 5 Lanczos steps, descending, each within
    its "residual" of an eigenvalue of H (`spectrum.top_eigenvalues`); "density" (density_probes > 0): SLQ nodes
    and weights of `density_probes` probes x `density_iters` steps (`spectrum.spectral_density`) and "moments",
    Tr(H^p) for p = 1..`moments` with standard errors over probes (None with one probe). One HVP = one pass over
    the batches; "num_matvecs" counts those computed (all steps run, even past an exhausted Krylov space)."""
    batches = batch_list(batches)
    matvec = hessian_matvec(apply_fn, params, batches)
    k_top, k_density = jax.random.split(key)
    report: dict[str, Any] = {"dim": spectrum.num_params(params), "num_batches": len(batches)}
    if k > 0:
        report["top"] = spectrum.top_eigenvalues(None, params, k_top, k=k, matvec=matvec).to_dict()
    if density_probes > 0:
        density = spectrum.spectral_density(None, params, k_density, num_probes=density_probes,
                                            num_iters=density_iters, matvec=matvec)
        rows = []
        for p in range(1, moments + 1):
            value, se = density.moment(p)
            rows.append({"p": p, "value": value, "stderr": se if math.isfinite(se) else None})
        report["density"] = {**density.to_dict(), "moments": rows, "num_matvecs": density_probes * density_iters}
    return report
