"""Gradient accumulation (`train.microbatches`): what it costs in step time and what it saves in memory.

    .venv/bin/python benchmarks/microbatches.py [--shape L6-H256] [--batch 256] [--ks 1,2,4,8] [--rounds 5]
        [--memory-shape L12-H768] [--memory-batch 1024] [--memory-ks 1,4,8] [--json]

Time: the library's jitted, donated MLM train step as `train_step.py` builds it (`JaxStep`: AdamW, dropout on,
the head at the predicted positions as in training) at one global batch, split into k microbatches, every k timed
round-robin in one process (medians of --rounds samples; wall and CPU-s ratios against k = 1 with their min-max).
Memory: XLA's own buffer assignment of the compiled step (`memory_analysis().temp_size_in_bytes`: activations
and other temporaries, not the parameters, optimizer state or batch), exact for the backend it compiled for. The
memory rows (bfloat16 activations, the paper's width) are compiled, never run: on a 2-core CPU a step at B1024
L12-H768 would take minutes. On a GPU XLA's scheduler orders the program for memory and reports its own figure
(an H100 needed 51.75 GiB at B4096, k = 1: launch/README.md); this script run there prints that backend's.
No goal: the trade-off a user picks `train.microbatches` by.
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
from _util import interleave, load_line, paired_ratio
from train_step import NUM_WORDS, SEQ_LEN, JaxStep, make_batch, make_model

from flatlm.config import base_config
from flatlm.models import SHAPES, Bert, model_config
from flatlm.train import optim
from flatlm.train.step import train_step

GIB = 2**30


def abstract_step(shape: str, batch_size: int, k: int, dtype: str):
    """(compiled step, compile seconds) of the train step with k microbatches, compiled from shapes alone (the
    paper's width at a large batch: never run here)."""
    c = base_config()
    c.model.shape, c.model.dtype = shape, dtype
    model, optimizer = Bert(model_config(c.model, NUM_WORDS, SEQ_LEN)), optim.optimizer(c.train)

    def init(key):
        params = nn.unbox(model.init(key, jnp.zeros((2, SEQ_LEN), jnp.int32))["params"])
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}

    state = jax.eval_shape(init, jax.random.key(0))
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), make_batch(batch_size))
    fn = jax.jit(functools.partial(train_step, apply_fn=model.apply, optimizer=optimizer, seed=0, dropout=True,
                                   microbatches=k), donate_argnums=0)
    t0 = time.perf_counter()
    compiled = fn.lower(state, batch).compile()
    return compiled, time.perf_counter() - t0


def timing_rows(args) -> list[dict]:
    """The real step (`train_step.JaxStep`: float32, dropout on, donated) at each k, timed round-robin."""
    model, _, train = make_model(args.shape)
    optimizer, batch = optim.optimizer(train), make_batch(args.batch)
    steps = {k: JaxStep(model, optimizer, batch, dropout=True, compiler_options={}, microbatches=k) for k in args.ks}
    times = interleave({str(k): step for k, step in steps.items()}, args.rounds)
    base, rows = times[str(args.ks[0])], []
    for k, step in steps.items():
        t = times[str(k)]
        rows.append(dict(k=k, temp_gib=step.memory()["temp_mib"] * 2**20 / GIB, compile_s=step.compile_s,
                         step_ms=float(np.median(t[:, 0])) * 1e3, cpu_ms=float(np.median(t[:, 1])) * 1e3,
                         wall_ratio=paired_ratio(t, base, 0), cpu_ratio=paired_ratio(t, base, 1)))
    return rows


def memory_rows(args) -> list[dict]:
    rows = []
    for k in args.memory_ks:
        compiled, compile_s = abstract_step(args.memory_shape, args.memory_batch, k, "bfloat16")
        rows.append(dict(k=k, temp_gib=compiled.memory_analysis().temp_size_in_bytes / GIB, compile_s=compile_s))
    return rows


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="L6-H256", help="Table 3 shape of the timed step")
    ap.add_argument("--batch", type=int, default=256, help="global batch of the timed step (sentences)")
    ap.add_argument("--ks", type=ints, default=[1, 2, 4, 8], help="microbatch counts timed; the first is the base")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved samples per k")
    ap.add_argument("--memory-shape", default="L12-H768", help="shape of the compiled-only memory rows")
    ap.add_argument("--memory-batch", type=int, default=1024)
    ap.add_argument("--memory-ks", type=ints, default=[1, 4, 8])
    ap.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = ap.parse_args(argv)
    bad = [k for k in args.ks + args.memory_ks if k < 1] + [k for k in args.ks if args.batch % k] + [
        k for k in args.memory_ks if args.memory_batch % k]
    if unknown := [x for x in (args.shape, args.memory_shape) if x not in SHAPES]:
        print(f"error: unknown shape(s) {unknown}; choose from {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    if bad:
        print(f"error: microbatch counts {bad} must be >= 1 and divide their batch; fix --ks / --memory-ks",
              file=sys.stderr)
        return 2
    print(f"machine: {load_line()}; JAX {jax.__version__} on {jax.devices()[0].platform}")
    timed = timing_rows(args)
    print(f"\n{args.shape}, batch {args.batch} x seq {SEQ_LEN}, float32, AdamW, dropout on; medians of {args.rounds} "
          "interleaved samples; ratios against k = {} [min-max over the rounds]".format(args.ks[0]))
    print(f"{'k':>3} {'rows/slice':>10} {'step ms':>9} {'CPU ms':>9} {'wall x':>18} {'CPU-s x':>18} {'temp GiB':>9}")
    for r in timed:
        w, c = r["wall_ratio"], r["cpu_ratio"]
        print(f"{r['k']:>3} {args.batch // r['k']:>10} {r['step_ms']:>9.1f} {r['cpu_ms']:>9.1f} "
              f"{w[0]:>6.3f} [{w[1]:.2f}-{w[2]:.2f}] {c[0]:>6.3f} [{c[1]:.2f}-{c[2]:.2f}] {r['temp_gib']:>9.3f}")
    mem = memory_rows(args)
    print(f"\n{args.memory_shape}, batch {args.memory_batch} x seq {SEQ_LEN}, bfloat16 activations: XLA's temporaries "
          f"of the compiled step on {jax.default_backend()} (compiled, not run)")
    for r in mem:
        print(f"  k={r['k']:<3} temp {r['temp_gib']:7.2f} GiB   (compile {r['compile_s']:.1f} s)")
    if args.json:
        print(json.dumps(dict(machine=load_line(), backend=jax.default_backend(), shape=args.shape, batch=args.batch,
                              timed=timed, memory_shape=args.memory_shape, memory_batch=args.memory_batch,
                              memory=mem)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
