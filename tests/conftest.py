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

# The suite's processes compile with XLA:CPU's fusion emitters off and LLVM -O1 (flatlm.compile_options.ONE_SHOT's
# choice, process-wide): about half of the suite's time was XLA compiling tiny programs, many of them op by op.
# The whole suite, same machine: 8:20 and 8:24 of wall with XLA's defaults, 6:14 to 6:32 (three runs) with these.
# `make test` sets FLATLM_TEST_XLA=O0 (LLVM -O0): its selection is compile-bound, and that took its 17:02 to 13:17
# (31:39 -> 24:33 of CPU; Intel, 2026-11-29, benchmarks/RESULTS.md). The slow tests train for hundreds to thousands
# of steps, which -O0's code runs slower: `make test-all` and a plain `pytest` leave the variable unset (-O1).
# Every test asserts against a reference with its own tolerance, not against the default compiler's rounding;
# programs compiled with explicit options keep them (ONE_SHOT's init always, the PCFG charts except under O0: below).
# Tests that are about the default build (or whose outcome hangs on its rounding) call `with_xla_defaults`, which
# runs them in a process of their own with XLA's defaults. FLATLM_TEST_XLA=default runs the whole suite with XLA's
# defaults.
# The caller's XLA_FLAGS, kept in the environment: xdist's workers inherit the controller's environment, lines below
# included, and must not take its fast flags for the caller's.
XLA_DEFAULT_FLAGS = os.environ.setdefault("FLATLM_TEST_CALLERS_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
from flatlm.compile_options import ONE_SHOT  # noqa: E402 - after FLATLM_MALLOC, before any XLA backend starts
from flatlm.cpu_codegen import SPLIT_FLAG  # noqa: E402 - as above

TEST_XLA = os.environ.get("FLATLM_TEST_XLA", "fast")  # checked by pytest_configure below
# One LLVM module per program (XLA:CPU splits each into parts compiled on a thread pool): xdist's two workers keep
# both cores busy, so the parts wait for a core and the split only costs. Four compile-bound files under O0, two
# interleaved rounds (Intel model-85 VM, 2026-11-29): 326 / 323 s of CPU -> 292 / 268 s. flatlm sets it itself on
# <= 2 CPUs (flatlm/cpu_codegen.py); set here on any machine, so that the suite compiles alike everywhere.
TEST_COMPILE = ONE_SHOT | {SPLIT_FLAG.removeprefix("--"): 1} | (
    {"xla_backend_optimization_level": 0} if TEST_XLA == "O0" else {})
FAST_COMPILE_FLAGS = " ".join(f"--{name}={str(value).lower()}" for name, value in TEST_COMPILE.items())
if TEST_XLA != "default":
    os.environ["XLA_FLAGS"] = f"{XLA_DEFAULT_FLAGS} {FAST_COMPILE_FLAGS}".strip()
# Under O0 the PCFG charts too (flatlm.compile_options.chart_options; test_pcfg.py 74-91 -> 56-57 s), unless the
# caller chose their level; a level set here is not passed on to `with_xla_defaults`' processes (marked, as workers
# inherit it).
if TEST_XLA == "O0" and "FLATLM_CHART_XLA_LEVEL" not in os.environ:
    os.environ["FLATLM_CHART_XLA_LEVEL"] = "0"
    os.environ["FLATLM_TEST_SET_CHART_LEVEL"] = "1"

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    if TEST_XLA not in ("fast", "O0", "default"):
        raise pytest.UsageError(f"FLATLM_TEST_XLA={TEST_XLA!r}: use fast (the default), O0 or default")


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


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess with `devices` simulated CPU devices, compiling as this process does."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()


def with_xla_defaults(request) -> bool:
    """True where this process compiles with XLA's default flags. Elsewhere the calling test is run again, alone,
    in a fresh pytest process that does (its failure is this test's, with its output), and False is returned: the
    caller returns at once. For tests of the default build itself, or whose outcome depends on its rounding."""
    if os.environ.get("FLATLM_TEST_XLA") == "default":
        return True
    env = {**os.environ, "FLATLM_TEST_XLA": "default", "XLA_FLAGS": XLA_DEFAULT_FLAGS}
    if env.pop("FLATLM_TEST_SET_CHART_LEVEL", None):
        del env["FLATLM_CHART_XLA_LEVEL"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           request.node.nodeid], capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert proc.returncode == 0, f"with XLA's default flags:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    return False


def run_python(code: str, devices: int = 1, env: dict | None = None, timeout: int = 600,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with `devices` simulated CPU devices."""
    full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    full_env["XLA_FLAGS"] = xla_flags(devices)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return proc


def write_toy_experiment(path, data, runs=(("a", []),), *, steps: int = 20, eval_every: int = 10,
                         checkpoint_every: int = 10, evaluate: bool = False, name: str = "toy", extra=(),
                         seeds: tuple[int, ...] = ()):
    """Write a small experiment config to `path`: `configs/hmm_mlm.py:tiny` trained `steps` steps (corpora in
    `data`), its runs (name, overrides), each repeated over `seeds` if any (runs NAME-seedK), `extra` more lines of
    Python on `base` (e.g. evaluation settings)."""
    body = "".join(f"    {line}\n" for line in extra)
    path.write_text(
        "from flatlm.config import load_config\nfrom flatlm.experiment import experiment_config\n\n"
        f"def get_config(arg=''):\n    base = load_config({str(REPO / 'configs' / 'hmm_mlm.py') + ':tiny'!r})\n"
        f"    base.train.update(steps={steps}, eval_every={eval_every})\n"
        f"    base.checkpoint.every = {checkpoint_every}\n"
        f"    base.data.data_dir = {str(data)!r}\n{body}"
        f"    return experiment_config({name!r}, base, {[(n, list(o)) for n, o in runs]!r}, evaluate={evaluate},\n"
        f"                             seeds={tuple(seeds)!r})\n")
    return path


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run([sys.executable, "-m", "flatlm.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=REPO)


@pytest.fixture
def tiny_config():
    """The `configs/hmm_mlm.py:tiny` config (fresh copy)."""
    from flatlm.config import load_config

    return load_config(str(REPO / "configs" / "hmm_mlm.py") + ":tiny")


@pytest.fixture
def small_disk(tmp_path):
    """mount(size): a tmpfs of `size` at tmp_path/disk (root only), unmounted afterwards."""
    mounted = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        point = tmp_path / "disk"
        point.mkdir(exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)
