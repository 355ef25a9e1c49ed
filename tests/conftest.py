"""Shared test helpers. JAX runs on the CPU; multi-device tests run in a subprocess with XLA_FLAGS set."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The suite is compile-bound (tiny models, many shapes): glibc's default allocator, not flatlm's single-arena heap
# (flatlm/allocator.py), which buys step time with ~1 s more per cold compile. Measured, same test files, two rounds
# each: 97 / 101 s vs 102 / 116 s and 125 / 127 s vs 150 / 130 s. Numerics do not depend on it; test_allocator
# checks both settings in processes of its own. Set before flatlm is first imported; a caller's value wins.
os.environ.setdefault("FLATLM_MALLOC", "system")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache_of_this_run(tmp_path_factory):
    """One JAX compilation cache per test run, shared by every `flatlm` process the tests start, from any xdist
    worker (they compile the same tiny models again and again), never by two runs: each run compiles from
    scratch. $FLATLM_COMPILATION_CACHE set by the caller (e.g. "off") wins."""
    if "FLATLM_COMPILATION_CACHE" not in os.environ:
        root = tmp_path_factory.getbasetemp()
        root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # the run's folder, not the worker's
        os.environ["FLATLM_COMPILATION_CACHE"] = str(root / "jax-compilation-cache")


@pytest.fixture(autouse=True)
def _no_persistent_cache_in_process(monkeypatch):
    """`flatlm.cli.main.main` called in-process (many CLI tests) turned on JAX's persistent compilation cache for the
    rest of its xdist worker, and JAX decides once per process, at its first compile, whether to use it: whether a
    later test read compiled programs from disk depended on test order. In-process calls now never turn it on; the
    `flatlm` subprocesses the tests start still share the run's cache (above)."""
    monkeypatch.setattr("flatlm.run.enable_compilation_cache", lambda env=None: None)


def run_python(code: str, devices: int = 1, env: dict | None = None, timeout: int = 600,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with `devices` simulated CPU devices."""
    full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    full_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return proc


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run([sys.executable, "-m", "flatlm.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=REPO)


@pytest.fixture
def tiny_config():
    """The `configs/hmm_mlm.py:tiny` config (fresh copy)."""
    from flatlm.config import load_config

    return load_config(str(REPO / "configs" / "hmm_mlm.py") + ":tiny")
