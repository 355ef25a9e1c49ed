"""Throughput of exact HMM conditionals P(x_t = w | x_{-t}) for the paper-sized HMM (100 states, 200 words,
length 16), against a straightforward numpy forward-backward measured in the same run.

    .venv/bin/python benchmarks/hmm_conditionals.py [--batch 4096] [--repeats 10] [--x64]

Prints sentences/s after warm-up (median of `repeats`, and the best: the least disturbed by other processes
on a shared machine), sentences per CPU-second (all threads; less sensitive to other load than wall
time), the compile time (first call minus a median call), and the speed-up over the baseline.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from flatlm.languages.hmm import HMM, random_hmm


def numpy_conditionals(hmm: HMM, tokens_BT: np.ndarray) -> np.ndarray:
    """The baseline: float64 numpy, full-length sentences, scaled forward and backward passes one position at
    a time, then per position the [B, V] conditionals normalised over words. [B, T, V]."""
    B, T = tokens_BT.shape
    A_KK, E_KV = hmm.transition, hmm.emission
    preds, betas = [np.broadcast_to(hmm.initial, (B, hmm.num_states))], [np.ones((B, hmm.num_states))]
    for t in range(T - 1):
        alpha_BK = preds[-1] * E_KV[:, tokens_BT[:, t]].T
        preds.append((alpha_BK / alpha_BK.sum(1, keepdims=True)) @ A_KK)
    for t in range(T - 1, 0, -1):
        beta_BK = (E_KV[:, tokens_BT[:, t]].T * betas[-1]) @ A_KK.T
        betas.append(beta_BK / beta_BK.sum(1, keepdims=True))
    betas.reverse()
    q_BTV = np.empty((B, T, hmm.vocab_size))
    for t in range(T):
        q_BV = (preds[t] * betas[t]) @ E_KV
        q_BTV[:, t] = q_BV / q_BV.sum(1, keepdims=True)
    return q_BTV


def time_calls(fn, repeats: int) -> tuple[float, float, float, float]:
    """(first call, best, median) wall-clock seconds and the least CPU seconds (all threads) of one call."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    walls, cpus = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - start_cpu)
    return first, min(walls), float(np.median(walls)), min(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4096, help="sentences per call")
    parser.add_argument("--baseline-batch", type=int, default=None,
                        help="sentences per numpy baseline call (default: --batch, so both run at equal batch)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--x64", action="store_true", help="run the JAX kernels in float64")
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", args.x64)

    hmm = random_hmm(seed=0)
    corpus = hmm.sample(args.batch, seed=1)
    tokens, lengths = corpus.tokens, corpus.lengths
    small = tokens[: args.baseline_batch or args.batch]

    rows = []  # (name, batch, first call s, best s, median s, cpu s)
    for name, fn, n in [
        ("sample (numpy)", lambda: hmm.sample(args.batch, seed=2), args.batch),
        ("log_prob", lambda: hmm.log_prob(tokens, lengths), args.batch),
        ("state_posteriors", lambda: hmm.state_posteriors(tokens, lengths), args.batch),
        ("conditionals", lambda: hmm.conditionals(tokens, lengths), args.batch),
        ("conditionals, numpy baseline", lambda: numpy_conditionals(hmm, small), len(small)),
    ]:
        rows.append((name, n, *time_calls(fn, args.repeats)))

    ours = hmm.conditionals(small, lengths[: len(small)])
    max_err = np.abs(ours - numpy_conditionals(hmm, small)).max()

    dtype = "float64" if args.x64 else "float32"
    device = jax.devices()[0].device_kind
    print(f"HMM K={hmm.num_states} V={hmm.vocab_size} T={hmm.max_length}, {dtype}, {device}")
    header = ("", "batch", "compile s", "best sent/s", "median sent/s", "sent/CPU-s")
    print("{:30s} {:>6s} {:>10s} {:>12s} {:>14s} {:>11s}".format(*header))
    for name, n, first, best, median, cpu in rows:
        compile_s = max(first - median, 0.0)
        print(f"{name:30s} {n:6d} {compile_s:10.2f} {n / best:12,.0f} {n / median:14,.0f} {n / cpu:11,.0f}")
    jax_rate, base_rate = rows[3][1] / rows[3][4], rows[4][1] / rows[4][4]
    print(f"conditionals speed-up over the numpy baseline: {jax_rate / base_rate:.1f}x (median vs median, "
          f"batch {rows[3][1]} vs {rows[4][1]}); hmmlearn: benchmarks/peers.py")
    print(f"max |conditionals - baseline| = {max_err:.2e}")


if __name__ == "__main__":
    main()
