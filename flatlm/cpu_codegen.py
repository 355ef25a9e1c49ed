"""XLA:CPU's codegen split, set once when flatlm is imported (before XLA starts): one LLVM module per program on a
machine of at most two usable CPUs.

XLA:CPU cuts each program's LLVM module into up to 32 parts (`--xla_cpu_parallel_codegen_split_count`, default 32)
and compiles them on a thread pool. With two cores that costs more than it saves. (flatlm's single-arena heap,
flatlm/allocator.py, also makes XLA's compile threads contend; the two effects were not measured apart.) Measured on
a 2-core Intel VM (2026-11-29, benchmarks/RESULTS.md), interleaved, split 32 vs 1:
- `flatlm train` tiny, compilation cache cold, first step: 18.6 / 16.4 s -> 14.0 / 15.1 s (medians of 3);
- the L4-H128 train step (benchmarks/train_step.py): compile 10.2 / 10.3 s -> 9.4 / 10.0 s, steps no slower
  (13.7k / 11.7k -> 14.4k / 13.9k tokens/s);
- four compile-bound test files on two xdist workers: 326 / 323 -> 292 / 268 CPU-s.
The numbers are the same: 30 steps of `flatlm train` tiny gave bitwise the same parameters and optimizer state,
and tests/test_cpu_codegen.py checks a gradient's bits at LLVM -O1, -O2 and -O3 (the levels flatlm compiles with).
At -O0 (`make test`'s level) the split moves last bits (up to 1.3e-8 in that gradient).

Left alone: more than two usable CPUs (not measured there; the parallel parts may pay), and XLA_FLAGS that already
name the flag (the caller's value wins: `--xla_cpu_parallel_codegen_split_count=32` is XLA's default). Accelerator
backends ignore the flag.
"""

from __future__ import annotations

import os

SPLIT_FLAG = "--xla_cpu_parallel_codegen_split_count"
MAX_CPUS = 2  # the core counts where one module per program was measured to pay


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity mask
        return os.cpu_count() or 1


def configure(environ=os.environ, cpus: int | None = None) -> str | None:
    """Append `SPLIT_FLAG=1` to environ's XLA_FLAGS where at most `MAX_CPUS` CPUs are usable and the flag is not set
    yet; returns the flag added, or None. XLA reads XLA_FLAGS once, when its first backend starts: a process
    that ran JAX before importing flatlm keeps XLA's split (only its subprocesses inherit the flag)."""
    flags = environ.get("XLA_FLAGS", "")
    if SPLIT_FLAG in flags or (usable_cpus() if cpus is None else cpus) > MAX_CPUS:
        return None
    added = f"{SPLIT_FLAG}=1"
    environ["XLA_FLAGS"] = f"{flags} {added}".strip()
    return added
