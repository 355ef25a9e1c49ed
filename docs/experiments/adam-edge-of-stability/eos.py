"""Full-batch Adam on one fixed MLM batch: does the preconditioned sharpness (top eigenvalue of P^-1 H) rise to
and hover near 2 (1 + b1) / ((1 - b1) lr), as Cohen et al. (2022) report for Adam at the edge of stability?

The sanity check issue 18 names for `flatlm.flatness.spectrum.preconditioned_sharpness`. A small BERT (d 32, one
layer, two heads) on `--sentences` random 8-token sentences with fixed 15% BERT masks (so the objective is
deterministic: full batch), optax.adam (b1 0.9, b2 0.999, eps 1e-8) at a constant rate; every `--every` steps
the top eigenvalue of P^-1 H (20 Lanczos steps) with P = diag(sqrt(nu_hat) + eps) from Adam's own state.

    python docs/experiments/adam-edge-of-stability/eos.py --lr 1e-2 --sentences 2048 --seed 0
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from flatlm.data.masking import mask_batch
from flatlm.flatness import spectrum
from flatlm.models.bert import Bert, BertConfig
from flatlm.models.losses import mlm_loss

B1, B2, EPS, WORDS, LENGTH = 0.9, 0.999, 1e-8, 20, 8


def fixed_mask_problem(sentences: int, seed: int):
    """(model, batch, params): a BERT of d 32, one layer, two heads, and `sentences` random 8-token sentences with
    fixed 15 % BERT masks (a deterministic full-batch objective), drawn from `seed`; also ../sam-edge-of-stability."""
    model = Bert(BertConfig(num_words=WORDS, max_len=LENGTH, d_model=32, num_layers=1, num_heads=2, dropout=0.0,
                            attention_dropout=0.0))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, WORDS, (sentences, LENGTH))
    batch = {k: jnp.asarray(v) for k, v in
             mask_batch(tokens, np.full(sentences, LENGTH), WORDS, rng, masking="bert").items()}
    params = nn.unbox(model.init(jax.random.key(seed), jnp.zeros((1, LENGTH), jnp.int32))["params"])
    return model, batch, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--sentences", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model, batch, params = fixed_mask_problem(args.sentences, args.seed)
    loss_fn = lambda p: mlm_loss(p, batch, model.apply)  # noqa: E731
    opt = optax.adam(args.lr, b1=B1, b2=B2, eps=EPS)
    state = opt.init(params)

    @jax.jit
    def step(p, s):
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    edge = spectrum.adam_edge_of_stability(args.lr, B1)
    print(f"lr {args.lr:g}, sentences {args.sentences}, seed {args.seed}: 2 (1 + b1) / ((1 - b1) lr) = {edge:.0f}")
    for t in range(1, args.steps + 1):
        params, state, loss = step(params, state)  # loss before this update
        if t % args.every == 0:
            top = spectrum.preconditioned_sharpness(loss_fn, params, state[0].nu, jax.random.key(t), b2=B2, step=t,
                                                    eps=EPS, num_iters=20)
            value = float(top.values[0])
            print(f"step {t:5d}  loss {float(loss):.4f}  P^-1 H top {value:9.1f} (+-{float(top.residual[0]):.1g})"
                  f"  / edge {value / edge:.3f}", flush=True)


if __name__ == "__main__":
    main()
