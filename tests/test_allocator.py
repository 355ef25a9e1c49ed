"""flatlm.allocator: after `import flatlm`, a 64 MiB buffer freed and allocated again on a worker thread (as
XLA:CPU does each step) reuses the heap instead of page-faulting it back in; FLATLM_MALLOC=system and the
environment's own MALLOC_* settings are honoured; buffers of 2 GiB and more come from the heap too, and freed
memory stays in it (never touched, so they cost address space, not memory). Page faults are counted by the kernel
(getrusage), in fresh processes (malloc settings are per process)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from flatlm import allocator

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")

_LIBC = """
import ctypes, flatlm

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]
"""

_FAULTS = _LIBC + """
import resource, threading

def work():  # plain malloc + touch + free (numpy would ask for huge pages, XLA does not)
    for _ in range(10):
        p = libc.malloc(2**26)  # 64 MiB
        ctypes.memset(p, 1, 2**26)
        libc.free(p)

for _ in range(2):  # the first pass grows the heap; the second is measured
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = threading.Thread(target=work)
    t.start()
    t.join()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""


_LARGE = _LIBC + """
GIB = 2**30
start = libc.sbrk(0)
big = libc.malloc(5 * GIB // 2)  # never touched: address space only
print(1 - (ctypes.c_size_t.from_address(big - 8).value >> 1 & 1))  # the chunk's IS_MMAPPED bit: 0 = on the heap
libc.free(big)
parts = [libc.malloc(5 * GIB // 4) for _ in range(2)]  # each below 2 GiB: on the heap either way
for p in parts:
    libc.free(p)
# 1: the heap still holds the 2.5 GiB freed at its top, 0: given back (measured from where it started, so it cannot
# pass by the heap never having grown)
print(int(libc.sbrk(0) - start >= 5 * GIB // 2))
"""


def _run(script: str, **env) -> list[int]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "FLATLM_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", script], env={**base, **env}, capture_output=True, text=True,
                         check=True)
    return [int(x) for x in out.stdout.split()]


def _faults(**env) -> int:
    return _run(_FAULTS, **env)[-1]


def test_worker_thread_buffers_reuse_the_heap():
    pages = 10 * 2**26 // 4096  # what ten fresh 64 MiB mappings fault in (4 KiB pages)
    assert _faults() < 0.05 * pages
    assert _faults(FLATLM_MALLOC="system") > 0.5 * pages  # glibc's default: a fresh mapping each time


def test_buffers_above_2_gib_stay_on_the_heap():
    assert _run(_LARGE) == [1, 1]
    # the previous settings (2 GiB - 1, the largest positive int): a mapping of its own, and the heap trimmed
    old = str(2**31 - 1)
    assert _run(_LARGE, MALLOC_MMAP_THRESHOLD_=old, MALLOC_TRIM_THRESHOLD_=old) == [0, 0]


def test_settings_in_the_environment_win():
    assert allocator.configure({"FLATLM_MALLOC": "system"}) == {}
    applied = allocator.configure({"MALLOC_ARENA_MAX": "4"})
    assert "arena_max" not in applied and applied["mmap_threshold"] == allocator.NO_LIMIT


def test_accelerator_hosts_keep_glibc_defaults(monkeypatch):
    monkeypatch.setattr(allocator, "accelerator_installed", lambda environ: True)
    assert allocator.configure({}) == {}
    assert allocator.configure({"FLATLM_MALLOC": "heap"})["arena_max"] == 1
    monkeypatch.undo()
    assert not allocator.accelerator_installed({"JAX_PLATFORMS": "cpu"})
