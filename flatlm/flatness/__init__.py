"""Flatness of MLM models: Hessian-vector products, trace estimators (Hutchinson, Hutch++, exact), the paper's
Fisher estimator, the Hessian/Fisher gap report, and function-preserving growth of a small BERT into a larger one.

Every evaluator takes `(apply_fn, params, batches)` or a `loss_fn(params[, batch])`; estimates come back as
`TraceEstimate` (mean, standard error, per-group traces; `.to_dict()` for JSON).
"""

from flatlm.flatness.estimates import TraceEstimate
from flatlm.flatness.fisher import empirical_fisher_trace, exact_fisher_trace, fisher_trace, fisher_vp
from flatlm.flatness.hessian import exact_trace, hutchinson_trace, hutchpp_trace, hvp, probe_like

__all__ = [
    "TraceEstimate",
    "empirical_fisher_trace",
    "exact_fisher_trace",
    "exact_trace",
    "fisher_trace",
    "fisher_vp",
    "hutchinson_trace",
    "hutchpp_trace",
    "hvp",
    "probe_like",
]
