"""Exact OPT conditionals P(x_t = w | x_{-t}) over a K-word restriction: time per sentence with the prefix KV cache
against recomputing every candidate sentence in full, in one run, on the OPT-125M shape with random weights.

    .venv/bin/python benchmarks/opt_conditionals.py [--K 32] [--T 24] [--sentences 1] [--shape 125m]

The paper's setting is K=2000, T=24; on a 2-core CPU one such sentence takes hours, so the default K is small
and the time is linear in K (run `--K 2000` on an accelerator). Compilation is done ahead and reported apart.
The modes alternate sentence by sentence, and CPU time (all threads) is reported beside wall time, which on a
shared machine also counts other processes' load. Token-forwards per sentence (both add the sentence pass, T):
K*T*ceil((T-1)/2) with the cache (two suffixes of T tokens together per row), K*T*(T-1) without; their ratio
(1.92 at T=24) is the arithmetic saving the cache can deliver.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np

from flatlm.languages.opt import OPTConfig, OPTLanguage, random_params


def main() -> None:
    """Time exact conditionals per sentence with and without the prefix cache; print them (or one JSON object)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--K", type=int, default=32, help="restricted vocabulary size (paper: 2000)")
    parser.add_argument("--T", type=int, default=24, help="sentence length (paper: 24)")
    parser.add_argument("--sentences", type=int, default=1, help="sentences timed per mode")
    parser.add_argument("--shape", default="125m", help="OPTConfig.named shape (125m, 350m, tiny)")
    parser.add_argument("--chunk", type=int, default=256, help="candidates per forward (memory bound)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args()

    cfg = OPTConfig.named(args.shape)
    params = random_params(cfg, seed=0, std=0.02)
    token_ids = np.arange(4, 4 + args.K)  # which K tokens does not change the cost
    langs = {mode: OPTLanguage(cfg, params, token_ids, args.T, candidate_chunk=args.chunk,
                               prefix_cache=(mode == "prefix cache")) for mode in ("prefix cache", "no cache")}
    corpus = langs["prefix cache"].sample(args.sentences, seed=1)

    T, K = args.T, args.K
    forwards = {"prefix cache": K * T * (T // 2) + T, "no cache": K * T * (T - 1) + T}
    compile_s, wall, cpu, results = {}, {m: [] for m in langs}, {m: [] for m in langs}, {}
    for mode, lang in langs.items():
        start = time.perf_counter()
        lang.precompile()
        compile_s[mode] = time.perf_counter() - start
    for i in range(args.sentences):  # modes alternate, so a change in the machine's load hits both alike
        order = list(langs) if i % 2 == 0 else list(langs)[::-1]
        for mode in order:
            start, start_cpu = time.perf_counter(), time.process_time()
            results[mode] = langs[mode].conditionals(corpus.tokens[i: i + 1], corpus.lengths[i: i + 1])
            wall[mode].append(time.perf_counter() - start)
            cpu[mode].append(time.process_time() - start_cpu)
            print(f"{mode}: sentence {i} {wall[mode][-1]:.1f} s wall, {cpu[mode][-1]:.1f} s cpu", file=sys.stderr)
    rows = [dict(mode=m, compile_s=compile_s[m], s_per_sentence=float(np.mean(wall[m])),
                 best_s=float(np.min(wall[m])), cpu_s_per_sentence=float(np.mean(cpu[m])),
                 token_forwards=forwards[m]) for m in langs]
    speedup = rows[1]["s_per_sentence"] / rows[0]["s_per_sentence"]
    cpu_speedup = rows[1]["cpu_s_per_sentence"] / rows[0]["cpu_s_per_sentence"]
    max_diff = float(np.abs(results["prefix cache"] - results["no cache"]).max())
    summary = dict(shape=args.shape, K=K, T=T, sentences=args.sentences, device=jax.devices()[0].device_kind,
                   rows=rows, speedup=speedup, cpu_speedup=cpu_speedup,
                   arithmetic_ratio=forwards["no cache"] / forwards["prefix cache"], max_abs_diff=max_diff,
                   extrapolated_s_per_sentence_K2000={r["mode"]: r["s_per_sentence"] * 2000 / K for r in rows})
    if args.json:
        print(json.dumps(summary))
        return
    print(f"OPT-{args.shape} random weights, K={K}, T={T}, {args.sentences} sentence(s), {summary['device']}")
    print(f"{'mode':14s} {'compile s':>10s} {'s/sentence':>11s} {'best s':>8s} {'cpu s/sent':>11s} "
          f"{'token-forwards':>15s}")
    for r in rows:
        print(f"{r['mode']:14s} {r['compile_s']:10.1f} {r['s_per_sentence']:11.2f} {r['best_s']:8.2f} "
              f"{r['cpu_s_per_sentence']:11.2f} {r['token_forwards']:15,d}")
    print(f"speed-up from the prefix cache: {speedup:.2f}x wall, {cpu_speedup:.2f}x cpu time "
          f"(arithmetic ratio {summary['arithmetic_ratio']:.2f}x)")
    print(f"max |cached - uncached| conditionals = {max_diff:.1e}")
    if K != 2000:
        ext = summary["extrapolated_s_per_sentence_K2000"]
        print(f"linear extrapolation to K=2000: {ext['prefix cache']:.0f} s/sentence cached, "
              f"{ext['no cache']:.0f} s uncached")


if __name__ == "__main__":
    main()
