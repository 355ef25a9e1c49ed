"""flatlm.allocator: after `import flatlm`, a 64 MiB buffer freed and allocated again on a worker thread (as
XLA:CPU does each step) reuses the heap instead of page-faulting it back in; FLATLM_MALLOC=system and the
environment's own MALLOC_* settings are honoured. Page faults are counted by the kernel (getrusage), in fresh
processes (malloc settings are per process)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from flatlm import allocator

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")

_FAULTS = """
import ctypes, resource, threading, flatlm

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

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


def _faults(**env) -> int:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "FLATLM_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", _FAULTS], env={**base, **env}, capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


def test_worker_thread_buffers_reuse_the_heap():
    pages = 10 * 2**26 // 4096  # what ten fresh 64 MiB mappings fault in (4 KiB pages)
    assert _faults() < 0.05 * pages
    assert _faults(FLATLM_MALLOC="system") > 0.5 * pages  # glibc's default: a fresh mapping each time


def test_settings_in_the_environment_win():
    assert allocator.configure({"FLATLM_MALLOC": "system"}) == {}
    applied = allocator.configure({"MALLOC_ARENA_MAX": "4"})
    assert "arena_max" not in applied and applied["mmap_threshold"] == 2**31 - 1


def test_accelerator_hosts_keep_glibc_defaults(monkeypatch):
    monkeypatch.setattr(allocator, "accelerator_installed", lambda environ: True)
    assert allocator.configure({}) == {}
    assert allocator.configure({"FLATLM_MALLOC": "heap"})["arena_max"] == 1
    monkeypatch.undo()
    assert not allocator.accelerator_installed({"JAX_PLATFORMS": "cpu"})
