"""Step time of the adversarial train step as a multiple of the plain MLM step at the same shape.

Setting (defaults): the paper's HMM vocabulary (200 words), sentences of T=16 tokens, a pre-LN Bert (d_model 128,
2 layers, dropout 0.1), AdamW as in `flatlm.train.optim`, MLM batches of 256, 1024 and 4096 (the paper's
pre-training batch) and D1/D2 batches of 256 each (task-6 labels, 100 classes). Both steps are `train_step` jitted
with a donated state; they run interleaved in rounds (up to `--steps` of each per round) so machine load affects
both alike, and the table reports the median per-step time over rounds. The goal is a ratio <= 1.5x. The XLA
cost model's FLOP ratio of the two compiled steps is printed too: it is what the ratio tends to where the step is
compute bound (a CPU), about 1 + (d1 + d2) / (MLM batch); an accelerator can hide part of it at small shapes.
Measured on 2 CPU cores (2026-11-28): 3.90x at MLM batch 256 (FLOPs 3.11x), 1.76x at 1024 (1.53x), 1.22x at
4096 (1.13x); 1.53-1.59x at 4096 before flatlm's allocator kept its 2156 MiB of temporaries on the heap.

  .venv/bin/python benchmarks/adversarial_step.py [--layers 2] [--batch 256,1024,4096] [--d1 256]
      [--projection 0,512] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from _util import compiled_flops

from flatlm.config import base_config
from flatlm.data.masking import mask_batch
from flatlm.models import Bert, BertConfig
from flatlm.train import adversarial as adv
from flatlm.train import optim
from flatlm.train.step import mlm_objective, train_step


def compiled_step(model, optimizer, objective, state, batch):
    step = jax.jit(functools.partial(train_step, apply_fn=model.apply, optimizer=optimizer, seed=0,
                                     objective=objective, dropout=True), donate_argnums=0)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    seconds = time.perf_counter() - t0
    return compiled, seconds, compiled_flops(compiled)


def run_steps(step, state, batch, n: int):
    t0 = time.perf_counter()
    for _ in range(n):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return state, (time.perf_counter() - t0) / n


def measure(a, mlm_batch: int) -> list[dict]:
    """Rows (plain, adversarial per projection) at one MLM batch size."""
    cfg = BertConfig(num_words=a.words, max_len=a.length + 1, d_model=a.d_model, num_layers=a.layers)
    model = Bert(cfg)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((2, a.length), jnp.int32))["params"])
    optimizer = optim.optimizer(base_config().train)
    rng = np.random.default_rng(0)
    lengths = np.full(mlm_batch, a.length)
    batch = mask_batch(rng.integers(0, a.words, (mlm_batch, a.length)), lengths, a.words, rng)
    batch.update({"down1_tokens": rng.integers(0, a.words, (a.d1, a.length)).astype(np.int32),
                  "down1_labels": rng.integers(0, a.classes, a.d1).astype(np.int32),
                  "down2_tokens": rng.integers(0, a.words, (a.d2, a.length)).astype(np.int32),
                  "down2_labels": rng.integers(0, a.classes, a.d2).astype(np.int32)})
    batch = jax.device_put(batch)
    fresh = lambda: {"step": jnp.zeros((), jnp.int32), "params": jax.tree.map(jnp.copy, params),
                     "opt_state": optimizer.init(params)}

    kinds = {"plain": mlm_objective}
    for proj in (int(x) for x in a.projection.split(",")):
        acfg = adv.AdversarialConfig(lam=0.1, d1_size=a.d1, d2_size=a.d2, num_classes=a.classes, loss=a.loss,
                                     projection_dim=proj)
        kinds[f"adversarial proj={proj}" if proj else "adversarial"] = adv.make_objective(acfg)
    steps, states, info = {}, {}, {}
    for name, objective in kinds.items():
        states[name] = fresh()
        steps[name], compile_s, flops = compiled_step(model, optimizer, objective, states[name], batch)
        states[name], first = run_steps(steps[name], states[name], batch, 1)  # warm-up
        info[name] = {"compile_s": compile_s, "flops": flops, "times": [], "first": first}
    per_round = max(1, min(a.steps, int(np.ceil(0.5 / max(info["plain"]["first"], 1e-6)))))
    for _ in range(a.rounds):
        for name in kinds:
            states[name], dt = run_steps(steps[name], states[name], batch, per_round)
            info[name]["times"].append(dt)

    base_t = float(np.median(info["plain"]["times"]))
    base_f = info["plain"]["flops"]
    rows = []
    for name, d in info.items():
        t = float(np.median(d["times"]))
        ratios = np.asarray(d["times"]) / np.asarray(info["plain"]["times"])
        rows.append({"mlm_batch": mlm_batch, "step": name, "ms": 1e3 * t, "ratio": t / base_t,
                     "ratio_min": float(ratios.min()), "ratio_max": float(ratios.max()),
                     "flops_ratio": d["flops"] / base_f, "compile_s": d["compile_s"], "steps_per_round": per_round})
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--words", type=int, default=200)
    p.add_argument("--length", type=int, default=16)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", default="256,1024,4096", help="comma-separated MLM batch sizes")
    p.add_argument("--d1", type=int, default=256)
    p.add_argument("--d2", type=int, default=256)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--projection", default="0", help="comma-separated projection dims to time (0 = raw T*D)")
    p.add_argument("--loss", default="squared", choices=adv.LOSSES)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="at most this many steps of each kind per round")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)

    rows = []
    for b in (int(x) for x in a.batch.split(",")):
        print(f"measuring MLM batch {b} ...", file=sys.stderr)
        rows += measure(a, b)
    out = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
           "shape": {"words": a.words, "T": a.length, "d_model": a.d_model, "layers": a.layers,
                     "d1": a.d1, "d2": a.d2, "classes": a.classes, "loss": a.loss},
           "rounds": a.rounds, "goal_ratio": 1.5, "results": rows}
    if a.json:
        print(json.dumps(out))
        return out
    s = out["shape"]
    print(f"{out['backend']} ({out['device']}): d_model {s['d_model']}, {s['layers']} layers, T={s['T']}, "
          f"D1/D2 {s['d1']}/{s['d2']}, {s['classes']} classes; median of {a.rounds} interleaved rounds")
    print(f"{'MLM batch':>9}  {'step':<24}{'ms/step':>10}{'x plain':>9}{'(range)':>13}{'FLOPs x':>9}"
          f"{'compile s':>11}")
    for r in rows:
        rng_s = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
        print(f"{r['mlm_batch']:>9}  {r['step']:<24}{r['ms']:>10.1f}{r['ratio']:>9.2f}{rng_s:>13}"
              f"{r['flops_ratio']:>9.2f}{r['compile_s']:>11.1f}")
    print(f"goal: adversarial <= {out['goal_ratio']}x plain with D1/D2 of 256. The extra work is a forward and "
          "backward pass of the encoder over d1 + d2 sentences, so where the step is compute bound (a CPU) the "
          "ratio tracks the FLOPs column, about 1 + (d1 + d2) / (MLM batch): the goal holds from an MLM batch of "
          "about 2 (d1 + d2) (the paper pre-trains with 4096).")
    return out


if __name__ == "__main__":
    main()
