"""Shared timing helpers for the benchmarks: the machine's float32 matmul peak, interleaved timing, load.

    .venv/bin/python benchmarks/_util.py [--n 2048] [--repeats 5]   # prints the matmul peak and the load

Timings on a shared machine are noisy: compare things measured in the same run, interleaved (`interleave`), and
look at CPU-seconds (all threads of this process) next to wall time; they are less disturbed by other load.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from collections.abc import Callable

import numpy as np

from flatlm.cpu_codegen import usable_cpus


def cpu_count() -> int:
    """CPUs this process may run on (what XLA's CPU thread pool sizes itself to): `flatlm.cpu_codegen.usable_cpus`."""
    return usable_cpus()


def load_line() -> str:
    """e.g. '2 CPUs, load average 11.8 (oversubscribed: ...)'."""
    n, load = cpu_count(), os.getloadavg()[0]
    line = f"{n} CPUs, 1-min load average {load:.1f}"
    if load > n + 0.5:
        line += " (oversubscribed: other processes share the cores, so wall times are noisy and inflated)"
    return line


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (MiB; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def matmul_case(n: int = 2048, dtype=np.float32) -> tuple[Callable[[], object], float]:
    """(call, flops): one jitted [n, n] @ [n, n] matmul that blocks until done, and its FLOPs (2 n^3)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((n, n)).astype(dtype))
    b = jnp.asarray(rng.standard_normal((n, n)).astype(dtype))
    f = jax.jit(jnp.matmul)
    f(a, b).block_until_ready()
    return (lambda: f(a, b).block_until_ready()), 2.0 * n**3


def compiled_flops(compiled) -> float:
    """XLA's FLOP count of a compiled program (`jax.jit(f).lower(*args).compile()`; NaN where the backend gives
    none). Machine-independent: the floor under a time ratio, for goals judged on noisy machines."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float((cost or {}).get("flops", float("nan")))


def xla_flops(fn: Callable, *args, **jit_kwargs) -> float:
    """`compiled_flops` of `jax.jit(fn, **jit_kwargs)` at `args` (compiled here, not run)."""
    import jax

    return compiled_flops(jax.jit(fn, **jit_kwargs).lower(*args).compile())


def time_once(fn: Callable[[], object], reps: int = 1) -> tuple[float, float]:
    """(wall, cpu) seconds per call, averaged over `reps` back-to-back calls."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps, (time.process_time() - c0) / reps


def interleave(cases: dict[str, Callable[[], object]], rounds: int,
               min_sample_s: float = 0.2, settle_s: float = 0.0, states: list | None = None) -> dict[str, np.ndarray]:
    """Time every case round-robin, `rounds` samples each: {name: float[rounds, 2]} of (wall, cpu) s per call.

    Each case must block until its work is done, and should be warm (compiled, called once). The first round
    calls every case once; later rounds repeat a fast case until a sample lasts about `min_sample_s`, so that
    every case sees the same stretch of machine load as its neighbours. `settle_s` > 0: before each sample an
    untimed pause, then one untimed call, for peers whose idle threads keep spinning after a call (torch's OpenMP
    pool): they would take cores from the case that follows, and after a pause they run their next call slower
    (Torch-Struct 2.0 instead of 2.9 sent/s): each case is then timed as it runs back to back, on a quiet machine.
    `states`: a list to append, before each round, the cross-core round trip in ns (`_cores.round_trip_ns`: None
    where not measured), for ratios by the machine's state (`_cores.by_state`).
    """
    if states is not None:
        from _cores import round_trip_ns  # reason: compiles its probe on first use; only the scripts that ask
    reps = dict.fromkeys(cases, 1)
    out = {name: [] for name in cases}
    for _ in range(rounds):
        if states is not None:
            time.sleep(settle_s)  # a peer's spinning threads would take the probe's cores
            states.append(round_trip_ns())
        for name, fn in cases.items():
            if settle_s > 0:
                time.sleep(settle_s)
                fn()
            out[name].append(time_once(fn, reps[name]))
        for name in cases:
            reps[name] = max(1, min(50, int(np.ceil(min_sample_s / max(out[name][0][0], 1e-6)))))
    return {name: np.asarray(v) for name, v in out.items()}


def paired_ratio(num: np.ndarray, den: np.ndarray, col: int) -> tuple[float, float, float]:
    """Median, min and max over paired `interleave` rounds of num/den (col 0: wall, 1: CPU-seconds)."""
    r = num[:, col] / den[:, col]
    return float(np.median(r)), float(r.min()), float(r.max())


def best_of(samples: dict, side: str) -> tuple[str, dict]:
    """(variant, {variant: median wall ms}) of the cases named "`side`:VARIANT" in `samples` (interleave's
    {name: float[rounds, 2]}): the one with the lowest median wall time is the side at its best. Chosen from the
    same rounds as the ratio that uses it, for both sides alike (a 3-call pre-timing had picked a JAX variant that
    then ran 20 % slower than the other in the rounds: benchmarks/RESULTS.md, 2026-11-30)."""
    ms = {n.split(":", 1)[1]: float(np.median(v[:, 0])) * 1e3 for n, v in samples.items() if n.startswith(side + ":")}
    return min(ms, key=ms.get), ms


def optional_modules(*names: str) -> tuple[list | None, str | None]:
    """(the modules, None), or (None, why not) when one does not import (the peers are an optional extra)."""
    try:
        return [__import__(n) for n in names], None
    except ImportError as e:
        return None, f"{e} (install the peers: make bench, or pip install -e '.[bench]' after torch==2.13.0)"


def matmul_peak(n: int = 2048, repeats: int = 5) -> dict:
    """Achieved float32 GFLOP/s of a large jitted matmul: best and median of `repeats` (wall and per CPU-second)."""
    fn, flops = matmul_case(n)
    s = interleave({"mm": fn}, repeats)["mm"]
    return dict(n=n, gflops_best=flops / s[:, 0].min() / 1e9, gflops_median=flops / np.median(s[:, 0]) / 1e9,
                gflops_per_cpu_s=flops / np.median(s[:, 1]) / 1e9)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="The machine's float32 matmul peak (JAX, all CPU threads).")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    import jax

    print(f"machine: {load_line()}; JAX {jax.__version__} on {jax.devices()[0].platform}")
    p = matmul_peak(args.n, args.repeats)
    print(f"float32 matmul peak ({args.n}^3, jitted jnp.matmul, {args.repeats} samples): best "
          f"{p['gflops_best']:.1f} GFLOP/s, median {p['gflops_median']:.1f} GFLOP/s, "
          f"{p['gflops_per_cpu_s']:.1f} GFLOP per CPU-second")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
