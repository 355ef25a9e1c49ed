"""Throughput of exact PCFG conditionals q[b, t, w] = P(x_t = w | x_-t) for every position and word.

    python benchmarks/pcfg_conditionals.py [--rules PATH] [--batch 1024] [--dense-length 32] [--json]

Rows: the released-shape grammar (`random_grammar` defaults, or `--rules` for a rules file) on a batch of
sampled sentences; a dense 50-nonterminal grammar on sentences of exactly `--dense-length` words; sampling.
Times are the median of `--repeats` runs after a first (compiling) run; "compile" is that first run minus the
median run. GFLOP/s counts the floating-point operations the kernels execute (the grammar's structural zeros
are skipped, so a sparse grammar executes far fewer than a dense N^3 chart would), against the peak of a
2048 x 2048 float32 matmul timed in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from flatlm.languages.pcfg import PCFG, dense_grammar, random_grammar
from flatlm.languages.pcfg.engine import bucket
from flatlm.languages.pcfg.kernels import default_layout


def matmul_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Best-of float32 GFLOP/s of one n x n matmul (the ceiling: its best sample)."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def executed_flops(g: PCFG, lengths: np.ndarray) -> float:
    """Floating-point operations of one `conditionals` call (inside + outside + the [T, N] x [N, V] product),
    following the same length-sorted chunks and chart sizes as the call."""
    order = np.sort(lengths)
    total = 0.0
    for a in range(0, len(order), g.batch_size):
        chunk = order[a: a + g.batch_size]
        T = pcfg_bucket(g, int(chunk.max()))
        plan = g._plan(T)
        batch_minor = default_layout(plan) == "batch_minor"  # its outside pass multiplies each block's parents only
        N = g.num_nonterminals
        per_sentence = 2.0 * T * N * g.vocab_size
        for w, spec in plan.widths.items():
            I = T - w + 1
            gemm = sum((k.l1 - k.l0) * (k.r1 - k.r0) * (N + ((k.n1 - k.n0) if batch_minor else N))
                       for k in spec.blocks)  # inside + outside
            outer = sum(2 * (k.l1 - k.l0) * (k.r1 - k.r0) * (k.d1 - k.d0 + 1) for k in spec.blocks)
            per_sentence += I * (2 * gemm + 3 * outer)  # GEMMs, 3 outer passes
        total += g.batch_size * per_sentence  # every chunk is padded to the batch
    return total


def pcfg_bucket(g: PCFG, length: int) -> int:
    """The chart size `conditionals` uses for a chunk whose longest sentence has `length` words."""
    return bucket(length) if g.bucket_lengths else g.max_length


def bench_conditionals(g: PCFG, tokens, lengths, repeats: int) -> dict:
    """Median-of-`repeats` time of `g.conditionals` on this batch, its compile time and executed GFLOP/s."""
    first = _timed(lambda: g.conditionals(tokens, lengths))
    sec = float(np.median([_timed(lambda: g.conditionals(tokens, lengths)) for _ in range(repeats)]))
    flops = executed_flops(g, lengths)
    return {"sentences": len(lengths), "seconds": sec, "sentences_per_s": len(lengths) / sec,
            "compile_s": max(first - sec, 0.0), "gflops": flops / sec / 1e9,
            "mean_length": float(np.mean(lengths))}


def main(argv=None) -> int:
    """Run the benchmark rows and print them as a table (or one JSON object with --json); returns 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rules", help="released-format rules file (default: random_grammar(0))")
    p.add_argument("--batch", type=int, default=1024, help="sentences per conditionals call")
    p.add_argument("--dense-length", type=int, default=32)
    p.add_argument("--dense-batch", type=int, default=256)
    p.add_argument("--sample", type=int, default=200_000, help="sentences for the sampling row")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-dense", action="store_true")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = p.parse_args(argv)

    peak = matmul_peak_gflops()
    rows = {}
    g = PCFG.from_rules_file(args.rules) if args.rules else random_grammar(0)
    corpus = g.sample(args.batch, seed=1)
    rows["released-shape"] = bench_conditionals(g, corpus.tokens, corpus.lengths, args.repeats)
    if not args.skip_dense:
        d = dense_grammar(0, max_length=args.dense_length)
        T = args.dense_length
        tokens = np.random.default_rng(0).integers(0, d.vocab_size, (args.dense_batch, T)).astype(np.int32)
        rows[f"dense N=50 T={T}"] = bench_conditionals(d, tokens, np.full(args.dense_batch, T), args.repeats)
    g.sample(1000, seed=0)
    secs = float(np.median([_timed(lambda: g.sample(args.sample, seed=2)) for _ in range(args.repeats)]))
    rows["sampling"] = {"sentences": args.sample, "seconds": secs, "sentences_per_s": args.sample / secs}

    result = {"matmul_peak_gflops": peak, "device": str(jax.devices()[0]), "rows": rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"float32 matmul peak: {peak:.1f} GFLOP/s ({result['device']})")
    print(f"{'case':<22}{'sentences/s':>14}{'GFLOP/s':>10}{'% peak':>8}{'compile s':>11}{'mean len':>10}")
    for name, r in rows.items():
        gf = r.get("gflops")
        print(f"{name:<22}{r['sentences_per_s']:>14,.0f}"
              + (f"{gf:>10.1f}{100 * gf / peak:>7.1f}%{r['compile_s']:>11.1f}{r['mean_length']:>10.1f}"
                 if gf is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
