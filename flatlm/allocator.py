"""Host memory allocator settings for XLA:CPU, applied once when flatlm is imported (glibc only).

Each XLA:CPU execution mallocs its temporary buffers (504 MiB for the L4-H128 train step at batch 256) and frees
them at the end. glibc mmaps any buffer of 32 MiB or more by default, and a secondary arena (a thread other than
the main one) holds at most 64 MiB: the buffer is then a fresh mapping, returned to the kernel when freed, and the
next step page-faults every page back in (about 690k minor faults in five L4-H128 steps; only one arena and a
higher threshold together remove them, so the temporaries are allocated off the main thread). A 32 MiB matmul
output ran at 170 instead of 436 GFLOP/s for that reason alone.

Settings (glibc `mallopt`): one arena (M_ARENA_MAX = 1: worker threads allocate from the main heap), every buffer
from the heap however large (M_MMAP_THRESHOLD) and freed memory never given back (M_TRIM_THRESHOLD): the process
holds its peak heap until it exits (RSS does not shrink after a large step), the usual trade for a training job.
Measured in alternating processes, L4-H128 step at batch 256 on 2 cores: 325-347 ms without, 196-206 ms with.
The cost: XLA's multi-threaded compiler contends for the single arena, about 1 s more per cold compile of the
PCFG chart (4.3-5.1 s -> 5.4-6.1 s) and of `flatlm train` tiny (first step 5.9 -> 7.7 s cold; 3.1 -> 3.5 s with
the compilation cache, the CLI's default).

"No limit" is mallopt's -1, which glibc reads as the largest size_t ("disables trimming completely", mallopt(3)).
Until 2026-11-28 both thresholds were 2 GiB - 1, the largest positive int: a temporary of 2 GiB or more was a
fresh mapping each step (the adversarial step at the paper's batch 4096 has 2156 MiB: 1314 ms, 1.53x the plain
step against 1.13x its FLOPs; now 965 ms, 1.21x), and whenever more than 2 GiB lay free at the top of the heap,
glibc gave all of it back, so a process that alternates programs (training and evaluation, benchmark cases)
page-faulted its temporaries back in: three L6-H256 steps (1.4 GiB of temporaries each) called in turn took up to
2.8 s instead of 0.8 s, with 130-420k page faults in most calls; now none after the first round
(benchmarks/results/cpu-2026-11-28/page_faults_*.txt). A glibc that refuses -1 gets 2 GiB - 1 instead; one that
caps the mmap threshold at HEAP_MAX_SIZE / 2 (32 MiB on 64-bit; some older releases) refuses both and keeps its
own (`configure` then leaves "mmap_threshold" out). glibc 2.36, on this project's machines, accepts -1.

Nothing is changed when an accelerator plugin (CUDA, ROCm, TPU) is installed and JAX_PLATFORMS does not name cpu
first: XLA:CPU's temporaries do not matter there, the compile cost would. `FLATLM_MALLOC=system` leaves glibc's
defaults alone, `FLATLM_MALLOC=heap` applies the settings even then; a MALLOC_ARENA_MAX / MALLOC_MMAP_THRESHOLD_ /
MALLOC_TRIM_THRESHOLD_ in the environment (read by glibc at start-up) wins over the setting it names. Elsewhere
than glibc (macOS, musl) nothing is changed.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameter numbers
NO_LIMIT = -1  # mallopt takes an int; glibc reads the thresholds as size_t, so -1 is the largest size
_LARGEST = 2**31 - 1  # the fallback where glibc refuses -1: 2 GiB - 1 bytes
SETTINGS = {  # parameter, the values to try in turn, the environment variable that overrides it
    "arena_max": (M_ARENA_MAX, (1,), "MALLOC_ARENA_MAX"),
    "mmap_threshold": (M_MMAP_THRESHOLD, (NO_LIMIT, _LARGEST), "MALLOC_MMAP_THRESHOLD_"),
    "trim_threshold": (M_TRIM_THRESHOLD, (NO_LIMIT, _LARGEST), "MALLOC_TRIM_THRESHOLD_"),
}


ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")


def accelerator_installed(environ=os.environ) -> bool:
    """Whether JAX may pick an accelerator: a plugin is installed and JAX_PLATFORMS does not start with cpu."""
    if environ.get("JAX_PLATFORMS", "").split(",")[0].strip() == "cpu":
        return False
    return any(importlib.util.find_spec(name) is not None for name in ACCELERATOR_PLUGINS)


def configure(environ=os.environ) -> dict[str, int]:
    """Apply the settings above once per process; {name: value} of those applied (empty when none was; -1 for a
    threshold means no limit)."""
    mode = environ.get("FLATLM_MALLOC", "").lower()
    if mode == "system" or platform.libc_ver()[0] != "glibc" or (mode != "heap" and accelerator_installed(environ)):
        return {}
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # a static or unusual libc: keep its defaults
        return {}
    applied = {}
    for name, (param, values, env) in SETTINGS.items():
        if env not in environ:
            value = next((v for v in values if mallopt(param, v) == 1), None)
            if value is not None:
                applied[name] = value
    return applied
