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
os.environ.setdefault("FLATLM_COMPILATION_CACHE", "off")  # tests compile from scratch: no cache shared between runs

REPO = Path(__file__).resolve().parents[1]


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
