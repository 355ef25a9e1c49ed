"""Step time of the adversarial train step as a multiple of the plain MLM step at the same shape.

Setting (defaults): the paper's HMM vocabulary (200 words), sentences of T=16 tokens, a pre-LN Bert (d_model 128,
2 layers, dropout 0.1), AdamW as in `flatlm.train.optim`, an MLM batch of 256 and D1/D2 batches of 256 each
(task-6 labels, 100 classes). Both steps are `train_step` jitted with a donated state; they run interleaved in
rounds (`--steps` of each per round) so machine load affects both alike, and the table reports the median
per-step time over rounds. The goal is a ratio <= 1.5x. The XLA cost model's FLOP ratio of the two compiled
steps is printed too: it is what the ratio tends to where the step is compute bound (a CPU), while an
accelerator can hide much of it at this small shape.

  .venv/bin/python benchmarks/adversarial_step.py [--layers 2] [--d1 256] [--projection 0,512] [--json]
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

from flatlm.config import base_config
from flatlm.data.masking import mask_batch
from flatlm.evaluate.probe import model_feature_fn
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
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return compiled, seconds, float((cost or {}).get("flops", float("nan")))


def run_steps(step, state, batch, n: int):
    t0 = time.perf_counter()
    for _ in range(n):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return state, (time.perf_counter() - t0) / n


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--words", type=int, default=200)
    p.add_argument("--length", type=int, default=16)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--d1", type=int, default=256)
    p.add_argument("--d2", type=int, default=256)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--projection", default="0", help="comma-separated projection dims to time (0 = raw T*D)")
    p.add_argument("--loss", default="squared", choices=adv.LOSSES)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps of each kind per round")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)

    cfg = BertConfig(num_words=a.words, max_len=a.length + 1, d_model=a.d_model, num_layers=a.layers)
    model = Bert(cfg)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((2, a.length), jnp.int32))["params"])
    optimizer = optim.optimizer(base_config().train)
    rng = np.random.default_rng(0)
    lengths = np.full(a.batch, a.length)
    batch = mask_batch(rng.integers(0, a.words, (a.batch, a.length)), lengths, a.words, rng)
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
        kinds[f"adversarial proj={proj}" if proj else "adversarial"] = adv.make_objective(acfg, model_feature_fn(model))
    steps, states, info = {}, {}, {}
    for name, objective in kinds.items():
        states[name] = fresh()
        steps[name], compile_s, flops = compiled_step(model, optimizer, objective, states[name], batch)
        states[name], _ = run_steps(steps[name], states[name], batch, 1)  # warm-up
        info[name] = {"compile_s": compile_s, "flops": flops, "times": []}
    for _ in range(a.rounds):
        for name in kinds:
            states[name], dt = run_steps(steps[name], states[name], batch, a.steps)
            info[name]["times"].append(dt)

    base_t = float(np.median(info["plain"]["times"]))
    base_f = info["plain"]["flops"]
    rows = []
    for name, d in info.items():
        t = float(np.median(d["times"]))
        per_round = np.asarray(d["times"]) / np.asarray(info["plain"]["times"])
        rows.append({"step": name, "ms": 1e3 * t, "ratio": t / base_t, "ratio_min": float(per_round.min()),
                     "ratio_max": float(per_round.max()), "flops_ratio": d["flops"] / base_f,
                     "compile_s": d["compile_s"]})
    out = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
           "shape": {"words": a.words, "T": a.length, "d_model": a.d_model, "layers": a.layers, "batch": a.batch,
                     "d1": a.d1, "d2": a.d2, "classes": a.classes, "loss": a.loss},
           "rounds": a.rounds, "steps_per_round": a.steps, "goal_ratio": 1.5, "results": rows}
    if a.json:
        print(json.dumps(out))
        return out
    s = out["shape"]
    print(f"{out['backend']} ({out['device']}): d_model {s['d_model']}, {s['layers']} layers, T={s['T']}, "
          f"MLM batch {s['batch']}, D1/D2 {s['d1']}/{s['d2']}, {s['classes']} classes, "
          f"median of {a.rounds} interleaved rounds x {a.steps} steps")
    print(f"{'step':<24}{'ms/step':>10}{'x plain':>9}{'(range)':>16}{'FLOPs x':>9}{'compile s':>11}")
    for r in rows:
        rng_s = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
        print(f"{r['step']:<24}{r['ms']:>10.1f}{r['ratio']:>9.2f}{rng_s:>16}{r['flops_ratio']:>9.2f}"
              f"{r['compile_s']:>11.1f}")
    print(f"goal: adversarial <= {out['goal_ratio']}x plain", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
