"""Run a flatlm command as N local processes of one multi-host run (tests/test_multihost.py): each process gets
JAX_COORDINATOR_ADDRESS (a free port), JAX_NUM_PROCESSES, JAX_PROCESS_ID and `devices` simulated CPU devices, as
launch/local_multihost.sh sets them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, xla_flags


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(*args: str, n: int = 2, devices: int = 4, env: dict | None = None,
                  per_process_env: dict | None = None, timeout: int = 300, logs: Path | None = None,
                  via_config: bool = False) -> list[subprocess.CompletedProcess]:
    """`python -m flatlm.cli ARGS` as `n` processes of one run; per_process_env: {process id: {var: value}}.
    `via_config`: the coordinator settings as --config.mesh.* flags instead of environment variables (train).
    All are killed when the slowest is not done after `timeout` seconds (the results then say so: returncode -9)."""
    port = free_port()
    logs = Path(logs or os.environ.get("TMPDIR", "/tmp"))
    procs, files = [], []
    for i in range(n):
        settings = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(n),
                    "JAX_PROCESS_ID": str(i)}
        flags = []
        if via_config:
            flags = [f"--config.mesh.{k}={v}" for k, v in zip(("coordinator_address", "num_processes", "process_id"),
                                                               settings.values())]
            settings = dict.fromkeys(settings, "")
        full = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {}), **(per_process_env or {}).get(i, {}),
                "XLA_FLAGS": xla_flags(devices), **settings}
        out, err = (open(logs / f"p{port}_{i}.{k}", "w+") for k in ("out", "err"))  # noqa: SIM115 - closed below
        files.append((out, err))
        procs.append(subprocess.Popen([sys.executable, "-m", "flatlm.cli", *args, *flags], stdout=out, stderr=err,
                                      env=full, cwd=REPO))
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            p.wait()
    results = []
    for p, (out, err) in zip(procs, files):
        p.wait()
        out.seek(0), err.seek(0)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
        out.close(), err.close()
    return results
