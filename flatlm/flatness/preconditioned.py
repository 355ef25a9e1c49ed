"""Preconditioned sharpness of an AdamW run's checkpoints (beyond the paper; issue 18's curvature panel).

The top eigenvalue of P^-1 H, with P = diag(sqrt(nu_hat) + eps) Adam's preconditioner read from the checkpoint's
optimizer state (nu bias-corrected at the checkpoint's step) and H the Hessian of the MLM loss on the measurement
batches of `flatlm flatness` (the operator `--spectrum-k` uses). Full-batch Adam trains at the "edge of stability",
where this value hovers near 2 (1 + b1) / ((1 - b1) lr) (Cohen et al. 2022, "Adaptive gradient methods at the edge
of stability"; 38 / lr for b1 = 0.9), lr the rate of the last update: printed beside it as a cheap sanity check.
Minibatch training, weight decay (AdamW adds weight_decay * lr to every eigenvalue of the update's Jacobian,
negligible at flatlm's 0.01) and measurement batches other than the training batch all move the value off that
line, so it is a reference, not a prediction.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax

from flatlm import checkpoint as ckpt
from flatlm.errors import UserError
from flatlm.flatness import compare, spectrum
from flatlm.run import Run
from flatlm.train import loop, optim


def adam_state(opt_state) -> optax.ScaleByAdamState:
    """The one `ScaleByAdamState` (count, mu, nu) inside an optimizer state (AdamW, maybe chained with clipping)."""
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x)]
    if len(found) != 1:
        raise ValueError(f"expected one Adam state in the optimizer state, found {len(found)}")
    return found[0]


def adam_loader(run: Run) -> Callable[[int], optax.ScaleByAdamState]:
    """step -> Adam's moments of checkpoint `step` (only the optimizer state is read; verified first, as params
    are). UserError (one line) at once unless `run` was trained with AdamW, so nothing is measured first; the state's
    abstract shapes are worked out once, not per checkpoint."""
    if run.config.train.optimizer != "adamw":
        raise UserError(f"the preconditioned sharpness needs an AdamW run; {run.workdir} was trained with "
                        f"train.optimizer={run.config.train.optimizer!r}")
    abstract = loop.train_setup(run).abstract_state()["opt_state"]
    return lambda step: adam_state(ckpt.restore_parts(run.workdir, step, {"opt_state": abstract})["opt_state"])


def measure(apply_fn, params, batches: list[dict], adam: optax.ScaleByAdamState, train, step: int,
            key: jax.Array, num_iters: int = 20) -> dict:
    """{"value", "residual"} of P^-1 H's top eigenvalue (Lanczos, `num_iters` HVPs), "edge_of_stability" =
    2 (1 + b1) / ((1 - b1) lr) and "ratio" value / that, with Adam's settings (`train`: the run's `config.train`).
    lr is the schedule's rate of the last update before checkpoint `step`; nu is bias-corrected by Adam's own count
    (which restarts where `train.stacking` resets the moments; the schedule does not)."""
    count = int(adam.count)
    lr = float(optim.schedule(train)(max(step - 1, 0)))
    top = spectrum.preconditioned_sharpness(None, params, adam.nu, key, b2=train.b2, step=count, eps=train.eps,
                                            num_iters=num_iters,
                                            matvec=compare.hessian_matvec(apply_fn, params, batches))
    value = float(top.values[0])
    eos = spectrum.adam_edge_of_stability(lr, train.b1) if lr > 0 else float("inf")
    return {"value": value, "residual": float(top.residual[0]), "edge_of_stability": eos, "ratio": value / eos,
            "lr": lr, "b1": float(train.b1), "b2": float(train.b2), "eps": float(train.eps), "adam_count": count,
            "num_matvecs": top.num_matvecs}
