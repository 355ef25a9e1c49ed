"""How far apart this machine's first two CPUs are right now: a cache line's round trip between them, in ns.

    .venv/bin/python benchmarks/_cores.py [--seconds 60] [--every 1.0]   # one sample a line: the state over time

Why (benchmarks/RESULTS.md, 2026-11-28 fifth): on the project's 2-core cloud VM the two vCPUs are, for seconds to
minutes at a time, far apart on the host: a round trip of 355-440 ns instead of 73-126 ns. A program whose work
hops between XLA's pool threads runs slower then (the dense PCFG chart at batch 4: slow in 26 of 27 far windows,
in 6 of 244 near ones), and not every program alike (the d128 gradient lost more than its HVP), so a ratio of two
timings depends on the state its rounds ran in. `_util.interleave(..., states=[])` samples the state before every
round; `peers.py` and `curvature.py` print their ratios by state.

The probe (cross_core.c) is compiled with $CC (default cc) on first use and cached by its source's hash in the
temp directory. Without a compiler, or with fewer than two CPUs to run on, `round_trip_ns` gives None and the
scripts print "not measured".
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

FAR_NS = 250.0  # between the two modes seen on 11-28 (near 73-126 ns, far 355-440 ns)
SOURCE = Path(__file__).with_name("cross_core.c")


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[object | None, str]:
    """(the compiled `round_trip_ns` function, "") or (None, why it is not measured)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return None, "fewer than two CPUs to run on"
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None, f"no C compiler ({os.environ.get('CC', 'cc')}) to build {SOURCE.name}"
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    lib = Path(tempfile.gettempdir(), f"flatlm-bench-{os.getuid()}", f"cross_core-{digest}.so")
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-pthread", str(SOURCE), "-o", str(tmp)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            return None, f"{cc} could not build {SOURCE.name}: {done.stderr.strip().splitlines()[-1:]}"
        os.replace(tmp, lib)  # whole or not at all, for processes that build it at once
    fn = ctypes.CDLL(str(lib)).round_trip_ns
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_double]
    return functools.partial(fn, cpus[0], cpus[1]), ""


def round_trip_ns(trips: int = 20_000, repeats: int = 5, max_s: float = 0.02) -> float | None:
    """ns per cache-line round trip between this process's first two CPUs: the median over `repeats` runs of the
    mean of `trips` round trips (each at most ~`max_s` s of both CPUs spinning; the median, so that a thread
    preempted in one run does not count), or None when not measurable here (`not_measured_why` says why)."""
    fn, _ = _probe()
    if fn is None:
        return None
    ns = [fn(trips, max_s) for _ in range(repeats)]
    return float(np.median(ns)) if min(ns) > 0 else None


def not_measured_why() -> str:
    """Why `round_trip_ns` gives None here ("" when it measures)."""
    return _probe()[1]


def state(ns: float | None) -> str | None:
    """"near" or "far" (round trip above FAR_NS), None for a sample not measured."""
    return None if ns is None else ("far" if ns > FAR_NS else "near")


def summary(samples: list, what: str = "rounds") -> str:
    """One line on a run's samples (one before each of its `what`): median [min-max] ns and how many were far; or
    why not measured."""
    ns = np.asarray([s for s in samples if s is not None], float)
    if ns.size == 0:
        return f"cross-core round trip: not measured ({not_measured_why() or 'no samples'})"
    far = sum(state(x) == "far" for x in ns)
    return (f"cross-core round trip {np.median(ns):.0f} ns [{ns.min():.0f}-{ns.max():.0f}]; "
            f"far (> {FAR_NS:.0f} ns) before {far} of {ns.size} {what}")


def by_state(values, samples: list) -> dict[str, dict]:
    """Per-round `values` grouped by the state sampled before each round: {state: {median, min, max, rounds}}
    for each state that occurred (rounds without a sample are left out)."""
    out = {}
    for name in ("near", "far"):
        v = np.asarray([x for x, s in zip(values, samples, strict=True) if state(s) == name], float)
        if v.size:
            out[name] = {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max()),
                         "rounds": int(v.size)}
    return out


def by_state_line(groups: dict[str, dict]) -> str:
    """e.g. 'near 125.3x [118.0-131.2] (4 rounds); far 96.1x (1 round)', or 'not measured'."""
    if not groups:
        return "not measured"
    parts = []
    for name, g in groups.items():
        rng = f" [{g['min']:.2f}-{g['max']:.2f}]" if g["rounds"] > 1 else ""
        parts.append(f"{name} {g['median']:.2f}x{rng} ({g['rounds']} round{'s' * (g['rounds'] > 1)})")
    return "; ".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long to trace")
    p.add_argument("--every", type=float, default=1.0, help="seconds between samples")
    a = p.parse_args(argv)
    if round_trip_ns() is None:
        print(f"not measured: {not_measured_why()}")
        return 0
    samples, end = [], time.monotonic() + a.seconds
    while time.monotonic() < end:
        ns = round_trip_ns()
        samples.append(ns)
        print(f"{time.strftime('%H:%M:%S')}  {ns:6.0f} ns  {state(ns)}", flush=True)
        time.sleep(a.every)
    print(summary(samples, "samples"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
