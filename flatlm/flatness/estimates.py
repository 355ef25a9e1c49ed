"""The result type every trace estimator returns, the variance bookkeeping behind its standard errors, and the
parameter groups that per-group traces are reported over.

Samples come in batches: for each data batch b an estimator draws n_b scalar samples (probes, label draws or
contexts) whose mean is unbiased for that batch's trace. The population trace is the mean over batches of the
per-batch traces, so two sources of noise mix: the estimator's own randomness (probe variance) and which batches
were drawn (data variance). `summarize` reports both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flatlm.models.blocks import block_group, path_names

GroupFn = Callable[[tuple[str, ...]], str]  # parameter path, e.g. ("layer_0", "attn", "qkv") -> group name


def batch_list(batches) -> list:
    """The estimators' `batches` argument as a list: None (a loss without a batch) -> [None], one batch (a dict) ->
    [it], a sequence or iterable of batches -> its list."""
    if batches is None:
        return [None]
    return [batches] if isinstance(batches, dict) else list(batches)


@dataclasses.dataclass(frozen=True)
class TraceEstimate:
    """A trace (e.g. Tr(Hessian) of a loss in nats, per unit parameter squared) with its standard error.

    mean, stderr: the estimate and its standard error. With several data batches the stderr treats the batches as
      independent draws from the data (it contains probe and data noise); with one batch it is the probe stderr,
      as it is for the estimators that pool one operator over several batches (Hutch++, XTrace).
    num_samples: scalar samples averaged in all (probes x batches, draws x batches, contexts, ...).
    method: "exact", "hutchinson", "hutchpp", "fisher_per_sample", "fisher_summed", "empirical_fisher", ...
    num_batches: data batches the population quantity averages over.
    probe_stderr: stderr from the estimator's own randomness alone, data held fixed (the right error bar for the
      trace of the loss over exactly these batches). For the empirical Fisher the within-batch samples are contexts,
      so this is a within-batch data stderr. None where it cannot be estimated (one sample per batch).
    data_std: standard deviation across batches of the per-batch trace itself, probe noise subtracted (None with
      one batch).
    sample_std: pooled within-batch standard deviation of one sample (for Rademacher Hutchinson it estimates
      sqrt(2 (||H||_F^2 - sum_i H_ii^2))).
    per_group, per_group_stderr: traces of the diagonal blocks of the parameter groups; they sum to `mean`.
    trace_sq, trace_sq_stderr: Tr(H^2) = ||H||_F^2 (Hutchinson: E||Hv||^2), None where not computed.
    batch_means: per data batch, the mean of its samples (deterministic offsets excluded), for errors of differences
      of two estimates on the same batches (`paired_difference`); () where samples are not per batch. In memory
      only: `to_dict` leaves it out, so stored results keep one size whatever the number of batches.
    """

    mean: float
    stderr: float
    num_samples: int
    method: str = ""
    num_batches: int = 1
    probe_stderr: float | None = None
    data_std: float | None = None
    sample_std: float | None = None
    per_group: Mapping[str, float] = dataclasses.field(default_factory=dict)
    per_group_stderr: Mapping[str, float] = dataclasses.field(default_factory=dict)
    trace_sq: float | None = None
    trace_sq_stderr: float | None = None
    batch_means: tuple[float, ...] = ()

    @property
    def given_data_stderr(self) -> float:
        """The error of the trace over exactly these batches (another estimate on the same data shares their
        noise): `probe_stderr` where it could be estimated, else `stderr`."""
        return self.probe_stderr if self.probe_stderr is not None else self.stderr

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (NaN becomes None)."""
        clean = lambda x: None if isinstance(x, float) and not math.isfinite(x) else x
        out = {}
        for f in dataclasses.fields(self):
            if f.name == "batch_means":
                continue
            v = getattr(self, f.name)
            out[f.name] = {k: clean(float(x)) for k, x in v.items()} if isinstance(v, Mapping) else clean(v)
        return out


@dataclasses.dataclass(frozen=True)
class _Moments:
    mean: float
    stderr: float
    probe_stderr: float | None
    data_std: float | None
    sample_std: float | None
    batch_means: tuple[float, ...]


def _moments(per_batch: Sequence[np.ndarray]) -> _Moments:
    """Mean of per-batch means, with total, within-batch (probe) and between-batch (data) spreads."""
    xs = [np.asarray(x, np.float64).reshape(-1) for x in per_batch]
    B = len(xs)
    m_b = np.array([x.mean() for x in xs])
    n_b = np.array([x.size for x in xs])
    mean = float(m_b.mean())
    if np.all(n_b > 1):
        var_b = np.array([x.var(ddof=1) for x in xs])
        probe_se = float(np.sqrt(np.sum(var_b / n_b)) / B)
        sample_std = float(np.sqrt(var_b.mean()))
        noise_of_mean_b = float(np.mean(var_b / n_b))
    else:
        probe_se = sample_std = None
        noise_of_mean_b = 0.0
    if B == 1:
        stderr = probe_se if probe_se is not None else float("nan")
        data_std = None
    else:
        between = float(m_b.var(ddof=1))
        stderr = math.sqrt(between / B)
        data_std = math.sqrt(max(0.0, between - noise_of_mean_b))
    return _Moments(mean, stderr, probe_se, data_std, sample_std, tuple(float(m) for m in m_b))


def summarize(
    group_samples: Sequence[np.ndarray],
    group_names: Sequence[str],
    *,
    method: str,
    sq_samples: Sequence[np.ndarray] | None = None,
    offset_per_group: np.ndarray | None = None,
    num_batches: int | None = None,
) -> TraceEstimate:
    """Build a TraceEstimate from per-batch samples.

    group_samples: one array [n_b, G] per batch; row j holds sample j split over the G parameter groups
      (the total sample is the row sum). offset_per_group: a deterministic part added to the estimate
      (Hutch++'s low-rank trace). sq_samples: per-batch [n_b] samples of Tr(H^2). num_batches: the data batches
      behind one pooled array of samples (an operator averaged over several batches, as Hutch++'s): metadata only,
      the stderr stays the samples' own (probe) error; default: one per array.
    """
    gs = [np.asarray(g, np.float64).reshape(np.shape(g)[0], -1) for g in group_samples]
    off = np.zeros(len(group_names)) if offset_per_group is None else np.asarray(offset_per_group, np.float64)
    total = _moments([g.sum(axis=1) for g in gs])
    per_group, per_group_se = {}, {}
    for j, name in enumerate(group_names):
        mj = _moments([g[:, j] for g in gs])
        per_group[name] = mj.mean + float(off[j])
        per_group_se[name] = mj.stderr
    sq = _moments(sq_samples) if sq_samples is not None else None
    return TraceEstimate(
        mean=total.mean + float(off.sum()),
        stderr=total.stderr,
        num_samples=int(sum(g.shape[0] for g in gs)),
        method=method,
        num_batches=len(gs) if num_batches is None else int(num_batches),
        probe_stderr=total.probe_stderr,
        data_std=total.data_std,
        sample_std=total.sample_std,
        per_group=per_group,
        per_group_stderr=per_group_se,
        trace_sq=None if sq is None else sq.mean,
        trace_sq_stderr=None if sq is None else sq.stderr,
        batch_means=total.batch_means if len(gs) > 1 else (),
    )


def paired_difference(a: TraceEstimate, b: TraceEstimate) -> tuple[float, float, str]:
    """(a.mean - b.mean, its standard error, how the error was formed) for two estimates on the same batches.

    "paired": both have per-batch means over the same number (> 1) of batches; the error is the spread of the
      per-batch differences / sqrt(B), which keeps the data noise the two share out of the difference (two
      curvature traces on the same batches move together: adding their errors as if independent overstates the
      difference's error, 1.8x in an audit of Tr(H) - Tr(F)). It has B - 1 degrees of freedom, so it is floored
      at the probes' error of the difference (well estimated from many samples): with two batches the spread of
      two differences once came out at 1 % of it;
    "probes": both on one batch; the two estimators' randomness is independent given the batch, so the probe
      errors add in quadrature;
    "independent": otherwise (e.g. differing batch counts), sqrt(a.stderr^2 + b.stderr^2), conservative when the
      two are positively correlated.
    """
    gap = a.mean - b.mean
    B = a.num_batches
    if B > 1 and b.num_batches == B and len(a.batch_means) == len(b.batch_means) == B:
        d = np.asarray(a.batch_means, np.float64) - np.asarray(b.batch_means, np.float64)
        se = float(d.std(ddof=1) / math.sqrt(B))
        if a.probe_stderr is not None and b.probe_stderr is not None:  # never below the probes' own noise, which
            se = max(se, math.hypot(a.probe_stderr, b.probe_stderr))  # many samples estimate well (2 batches: 1 dof)
        return gap, se, "paired"
    if B == 1 and b.num_batches == 1:
        return gap, math.hypot(a.given_data_stderr, b.given_data_stderr), "probes"
    return gap, math.hypot(a.stderr, b.stderr), "independent"


def top_level_group(path: tuple[str, ...]) -> str:
    """Default grouping: the top-level parameter key ("tok_embed", "layer_0", "head_dense", ...)."""
    return path[0] if path else "params"


def leaf_group(path: tuple[str, ...]) -> str:
    """One group per parameter tensor, named by its '/'-joined path."""
    return "/".join(path) or "params"


# BERT tensors whose Fisher trace (= Tr(H) at the saturation optimum, Lemma 4.2) is unchanged by the function-
# preserving growth of flatlm.flatness.grow (width x k and added blocks). Every other tensor's is rescaled: biases,
# LayerNorms and embeddings by 1/k, the head LayerNorm by k; added blocks' output biases add their own terms
# (tests/test_grow.py measures each factor exactly). Comparing sizes on this part needs no growth at all.
GROWTH_INVARIANT = ("qkv", "out", "wi", "wo", "head_dense", "head_bias")


def growth_group(path: tuple[str, ...]) -> str:
    """"growth_invariant" for the tensors in GROWTH_INVARIANT (by leaf name), else "growth_rescaled"."""
    return "growth_invariant" if path and path[-1] in GROWTH_INVARIANT else "growth_rescaled"


GROUP_MODES = {"top": top_level_group, "leaf": leaf_group, "growth": growth_group, "block": block_group}


def param_groups(params, groups: GroupFn | str | None = None) -> tuple[list[str], list[int]]:
    """Group names (in first-seen leaf order) and, per leaf of `jax.tree.leaves(params)`, its group index.

    groups: None or "top" (top-level keys), "leaf" (every tensor), "growth" (`growth_group`), "block"
    (`block_group`: embeddings, each layer's attention and MLP, head), or a function of the path tuple.
    """
    fn = top_level_group if groups is None else GROUP_MODES.get(groups, groups) if isinstance(groups, str) else groups
    if not callable(fn):
        raise ValueError(f"groups must be None, one of {', '.join(map(repr, GROUP_MODES))} or a callable, "
                         f"got {groups!r}")
    names: list[str] = []
    ids: list[int] = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = str(fn(path_names(path)))
        if name not in names:
            names.append(name)
        ids.append(names.index(name))
    return names, ids


def hashable(fn):
    """`fn` itself if hashable (a static jit argument, compiled once per fn), else a wrapper hashed by identity."""
    try:
        hash(fn)
        return fn
    except TypeError:
        return functools.partial(fn)


def acc_dtype(x) -> jnp.dtype:
    """The accumulation dtype for `x`: at least float32 (float64 stays float64)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def group_dots(a, b, leaf_ids: Sequence[int], num_groups: int) -> jax.Array:
    """[G] sums over each parameter group of a . b (accumulated in at least float32)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    dots = [jnp.sum(x.astype(acc_dtype(x)) * y.astype(acc_dtype(x))) for x, y in zip(la, lb)]
    acc = jnp.result_type(*dots) if dots else jnp.float32
    out = [jnp.zeros((), acc)] * num_groups
    for d, g in zip(dots, leaf_ids):
        out[g] = out[g] + d.astype(acc)
    return jnp.stack(out)
