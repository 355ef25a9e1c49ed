"""Full-batch GD and full-batch SAM on one fixed MLM batch: does the top Hessian eigenvalue settle at the edge of
stability each predicts, 2 / lr for GD (Cohen et al. 2021) and, for SAM with the normalised ascent step flatlm uses,
the SAM edge of Long & Bartlett (2023),

    lambda_SAM = (|g| / (2 rho)) (sqrt(1 + 8 rho / (lr |g|)) - 1),   |g| the full-batch gradient norm,

(the lambda at which lr * lambda * (1 + rho lambda / |g|) = 2: a quadratic's top direction under SAM's gradient)?

Issue 18 item 1 says full-batch SAM penalises the top eigenvalue; this checks flatlm's SAM objective
(`flatlm.train.flat_objectives`, the train step's own, with one ascent group) against that closed form. Model and
data as ../adam-edge-of-stability/eos.py: a BERT of d 32, one layer, two heads, `--sentences` random 8-token
sentences with fixed 15 % BERT masks; plain gradient descent (no momentum) at a constant rate; every `--every` steps
the top eigenvalue of the loss's Hessian (20 Lanczos steps) and |g|.

    python docs/experiments/sam-edge-of-stability/sam_eos.py --lr 0.1 --rho 0 --seed 0    # GD
    python docs/experiments/sam-edge-of-stability/sam_eos.py --lr 0.1 --rho 0.05 --seed 0 # SAM
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from flatlm.flatness import spectrum
from flatlm.models.losses import mlm_loss
from flatlm.train import flat_objectives


def _adam_page():
    """../adam-edge-of-stability/eos.py as a module: the same model and fixed-mask batch."""
    path = Path(__file__).resolve().parents[1] / "adam-edge-of-stability" / "eos.py"
    spec = importlib.util.spec_from_file_location("adam_eos", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sam_edge(lr: float, rho: float, grad_norm: float) -> float:
    """The top eigenvalue at which full-batch SAM (normalised ascent rho g / |g|) is at its edge of stability."""
    if rho == 0:
        return 2 / lr
    return grad_norm / (2 * rho) * (math.sqrt(1 + 8 * rho / (lr * grad_norm)) - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--rho", type=float, default=0.0, help="0: plain gradient descent")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--sentences", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--midpoint", action="store_true",
                    help="also the top eigenvalue at the midpoint of this iterate and the next (a period-2 "
                         "oscillation across a valley puts the iterates on its walls)")
    args = ap.parse_args()
    model, batch, params = _adam_page().fixed_mask_problem(args.sentences, args.seed)
    loss_fn = lambda p: mlm_loss(p, batch, model.apply)  # noqa: E731
    if args.rho:
        sam = flat_objectives.make_objective(flat_objectives.FlatConfig(method="sam", rho=args.rho))
        objective = lambda p: sam(p, batch, model.apply, None)[0]  # noqa: E731
    else:
        objective = loss_fn

    @jax.jit
    def step(p):
        g = jax.grad(objective)(p)
        return jax.tree.map(lambda x, d: x - args.lr * d, p, g)

    @jax.jit
    def loss_and_grad_norm(p):
        loss, g = jax.value_and_grad(loss_fn)(p)
        return loss, jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))

    print(f"lr {args.lr:g}, rho {args.rho:g}, sentences {args.sentences}, seed {args.seed}: 2 / lr = {2 / args.lr:.2f}")
    for t in range(args.steps + 1):
        if t % args.every == 0:
            loss, norm = (float(x) for x in loss_and_grad_norm(params))
            top = spectrum.top_eigenvalues(loss_fn, params, jax.random.key(t), k=1, num_iters=20)
            value, edge = float(top.values[0]), sam_edge(args.lr, args.rho, norm)
            mid = ""
            if args.midpoint:
                halfway = jax.tree.map(lambda a, b: (a + b) / 2, params, step(params))
                m = float(spectrum.top_eigenvalues(loss_fn, halfway, jax.random.key(t), k=1, num_iters=20).values[0])
                mid = f"  midpoint top {m:8.3f} / edge {m / edge:.3f}"
            print(f"step {t:5d}  loss {loss:.4f}  |g| {norm:.4f}  top {value:8.3f} (+-{float(top.residual[0]):.1g})"
                  f"  edge {edge:8.3f}  top / edge {value / edge:.3f}{mid}", flush=True)
        if t < args.steps:
            params = step(params)


if __name__ == "__main__":
    main()
