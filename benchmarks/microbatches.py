"""Gradient accumulation (`train.microbatches`): what it costs in step time and what it saves in memory.

    .venv/bin/python benchmarks/microbatches.py [--shape L6-H256] [--batch 256] [--ks 1,2,4,8] [--rounds 5]
        [--memory-shape L12-H768] [--memory-batch 1024] [--memory-ks 1,4,8] [--json]

Time: the library's jitted, donated MLM train step (`flatlm.train.step.train_step`, AdamW, dropout on, the head
at the predicted positions as in training) at one global batch, split into k microbatches, every k timed
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

from flatlm.config import base_config
from flatlm.data.masking import mask_batch
from flatlm.models import Bert, model_config
from flatlm.train import optim
from flatlm.train.step import train_step

NUM_WORDS, SEQ_LEN = 200, 32  # the paper's PCFG vocabulary and the Table 3 sequence length (as train_step.py)
GIB = 2**30


def step_case(shape: str, batch_size: int, k: int, dtype: str, run: bool):
    """(compiled step, state, batch) of the train step with k microbatches (abstract state when not `run`)."""
    c = base_config()
    c.model.shape, c.model.dtype = shape, dtype
    model, optimizer = Bert(model_config(c.model, NUM_WORDS, SEQ_LEN)), optim.optimizer(c.train)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, NUM_WORDS, (batch_size, SEQ_LEN))
    batch = mask_batch(tokens, np.full(batch_size, SEQ_LEN), NUM_WORDS, rng, masking="bert")

    def init(key):
        params = nn.unbox(model.init(key, jnp.zeros((2, SEQ_LEN), jnp.int32))["params"])
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}

    state = jax.jit(init)(jax.random.key(0)) if run else jax.eval_shape(init, jax.random.key(0))
    batch = jax.device_put(batch) if run else jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    fn = jax.jit(functools.partial(train_step, apply_fn=model.apply, optimizer=optimizer, seed=0, dropout=True,
                                   microbatches=k), donate_argnums=0)
    t0 = time.perf_counter()
    compiled = fn.lower(state, batch).compile()
    return compiled, state, batch, time.perf_counter() - t0


def temp_gib(compiled) -> float:
    return compiled.memory_analysis().temp_size_in_bytes / GIB


def timing_rows(args) -> list[dict]:
    rows, calls = [], {}
    for k in args.ks:
        compiled, state, batch, compile_s = step_case(args.shape, args.batch, k, "float32", run=True)
        holder = {"state": state}

        def call(compiled=compiled, holder=holder, batch=batch):
            holder["state"], metrics = compiled(holder["state"], batch)
            jax.block_until_ready(metrics)

        call()
        calls[k] = call
        rows.append(dict(k=k, temp_gib=temp_gib(compiled), compile_s=compile_s))
    times = interleave({str(k): calls[k] for k in args.ks}, args.rounds)
    base = times[str(args.ks[0])]
    for r in rows:
        t = times[str(r["k"])]
        r.update(step_ms=float(np.median(t[:, 0])) * 1e3, cpu_ms=float(np.median(t[:, 1])) * 1e3,
                 wall_ratio=paired_ratio(t, base, 0), cpu_ratio=paired_ratio(t, base, 1))
    return rows


def memory_rows(args) -> list[dict]:
    rows = []
    for k in args.memory_ks:
        compiled, _, _, compile_s = step_case(args.memory_shape, args.memory_batch, k, "bfloat16", run=False)
        rows.append(dict(k=k, temp_gib=temp_gib(compiled), compile_s=compile_s))
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
