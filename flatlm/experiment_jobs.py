"""Runs in parallel processes: `flatlm experiment --jobs N` (an experiment's runs), `flatlm reproduce --jobs N` (the
runs of every experiment of the suite, in one queue).

On a CPU a run of the `cpu` presets keeps about 1.3 of a machine's cores busy (its models are small: a chain of
small ops, one after the other), so two runs side by side finish in about the time of one: two 1500-step runs of
`configs/hmm_mlm.py:cpu` took 11.2 s side by side and 20.9 s one after the other (2-core AMD EPYC, 2026-11-27).
Each pending run becomes a child `flatlm experiment --run NAME --quiet` process, the mode one job per run uses
(`launch/tpu.sh experiment`): the run's own workdir lock, shared corpora built once under a lock. The queue starts
the runs with the most training steps first (`Child.steps`), so that no long run trains alone at the end. The parent
keeps the experiments' locks, shows one bar over the runs and writes each child's output to
`<experiment>/runs/NAME/experiment.log` (a local temporary folder for a workdir in a bucket). When a run fails the
others already running finish, no new one starts, and the command stops with the failed runs, their exit codes and
the last lines of their logs. SIGTERM or Ctrl-C to the parent is passed to the children, which save a checkpoint and
stop (rerun to resume); on Linux a child also gets SIGTERM if the parent is killed outright (PR_SET_PDEATHSIG), so
no run is left training alone.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time

from tqdm.auto import tqdm

from flatlm import paths
from flatlm.errors import Preempted, RunFailed, UserError

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.25
_LOG_TAIL = 6  # lines of a failed run's log in the error


def check_jobs(jobs: int) -> int:
    """`jobs` if it is a usable number of processes, else a UserError naming the fix."""
    if not isinstance(jobs, int) or jobs < 1:
        raise UserError(f"--jobs {jobs}: pass the number of runs to train at once (1 or more; e.g. 2 on a 2-core "
                        "laptop, since a cpu-preset run keeps about 1.3 cores busy)")
    return jobs


PARENT_ENV = "FLATLM_EXPERIMENT_PARENT_PID"  # set in a child's environment: the pid it must not outlive


def die_with_parent() -> None:
    """In a child that `run_children` started (its parent's pid in $FLATLM_EXPERIMENT_PARENT_PID): ask Linux for
    SIGTERM when the parent dies, and stop at once if it is already gone. Called first thing by the CLI; not in a
    preexec_fn, which would run Python between fork and exec in a multithreaded (JAX) parent."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # the parent died before prctl
        raise SystemExit(143)


def _log_dir(root) -> str:
    return tempfile.mkdtemp(prefix="flatlm-experiment-logs-") if paths.is_cloud(root) else os.fspath(root)


@dataclasses.dataclass(frozen=True)
class Child:
    """One run to train in a child process: `flatlm experiment *args --workdir WORKDIR --run NAME --quiet`. `args`
    must rebuild the parent's experiment (its --config, --seeds and overrides): a child whose experiment differs
    stops on the workdir's experiment.json (`flatlm.experiment._write_spec`)."""

    key: str  # how the bar and the errors name it, e.g. "adamw-seed0" or "fig3_sgd-hmm/sgd-lr0.5-seed0"
    args: tuple[str, ...]
    workdir: str
    name: str
    steps: int = 0  # its training steps: longer runs start first


def children(runs: list[tuple[str, int]], child_args, root, prefix: str = "") -> list[Child]:
    """A Child per (run name, training steps) of one experiment in `root`, keyed `prefix + name`."""
    return [Child(prefix + name, tuple(child_args), os.fspath(root), name, steps) for name, steps in runs]


def _tail(path: str) -> str:
    with open(path, errors="replace") as f:
        lines = [ln.rstrip() for ln in f.read().replace("\r", "\n").splitlines() if ln.strip()]
    return "\n".join(f"    {ln}" for ln in lines[-_LOG_TAIL:]) or "    (it wrote nothing)"


def run_children(todo: list[Child], jobs: int, progress: bool, label: str, on_finished=None) -> dict[str, str]:
    """Run every child, up to `jobs` at once, the most training steps first (ties in the given order); returns
    {child key: "finished"}. `on_finished(child, started, ended)` (time.time() seconds) is called as each one
    finishes. A failed child lets the running ones finish, starts no more, and raises RunFailed."""
    logs: dict[str, str] = {}  # workdir -> where its runs' logs go
    queue = collections.deque(sorted(todo, key=lambda c: -c.steps))
    running, failed, status = {}, [], {}
    bar = tqdm(total=len(todo), desc=f"{label}: runs ({jobs} at once)", unit="run", file=sys.stderr,
               disable=not progress)

    def on_sigterm(signum, frame):
        raise Preempted("interrupted by SIGTERM: the runs in progress saved a checkpoint; rerun the same command "
                        "to resume")

    old = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        while queue or running:
            while queue and len(running) < jobs and not failed:
                child = queue.popleft()
                if child.workdir not in logs:
                    logs[child.workdir] = _log_dir(child.workdir)
                log_path = os.path.join(logs[child.workdir], "runs", child.name, "experiment.log")
                os.makedirs(os.path.dirname(log_path), exist_ok=True)
                log = open(log_path, "w")  # noqa: SIM115 - closed when the child exits
                cmd = [sys.executable, "-m", "flatlm.cli", "experiment", *child.args, "--workdir", child.workdir,
                       "--run", child.name, "--quiet"]
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env={**os.environ, PARENT_ENV: str(os.getpid())})
                running[child] = (proc, log, log_path, time.time())
                bar.set_postfix_str(", ".join(c.key for c in running), refresh=True)
            time.sleep(_POLL_S)
            for child, (proc, log, log_path, started) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[child]
                if proc.returncode == 0:
                    status[child.key] = "finished"
                    bar.update(1)
                    if on_finished is not None:
                        on_finished(child, started, time.time())
                else:
                    failed.append((child.key, proc.returncode, log_path))
                bar.set_postfix_str(", ".join(c.key for c in running), refresh=True)
            if failed and not running:
                break
    finally:
        for proc, *_ in running.values():  # Ctrl-C, SIGTERM or an error here: the children stop and save
            proc.send_signal(signal.SIGTERM)
        for proc, log, *_ in running.values():
            proc.wait()
            log.close()
        signal.signal(signal.SIGTERM, old)
        bar.close()
    if failed:
        how = lambda rc: f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"  # noqa: E731
        parts = [f"{name} ({how(rc)}; log {path}):\n{_tail(path)}" for name, rc, path in failed]
        not_started = f"; not started: {', '.join(c.key for c in queue)}" if queue else ""
        raise RunFailed(f"{len(failed)} run(s) of {label} failed{not_started}; the finished ones are kept, "
                        "rerun the same command to resume:\n" + "\n".join(parts))
    return status
