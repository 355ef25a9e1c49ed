"""`flatlm experiment --jobs`: runs trained side by side in child processes, a failed or stopped child and what
it saves, and the queue's order (longest first, nothing started after a failure). The runner itself, the
convergence watch and the report: test_experiment.py."""

from __future__ import annotations

import json
import os

import pytest
from conftest import REPO, run_cli, write_toy_experiment

from flatlm import checkpoint as ckpt

TWO_RUNS = [("a", []), ("b", ["--config.model.d_model=32"])]


def _eval_losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval/loss"]) for r in rows if "eval/loss" in r]


@pytest.mark.slow  # make test: reproduce --jobs's queue
def test_jobs_train_runs_side_by_side_and_a_failed_one_stops_the_command(tmp_path):
    """`--jobs 2`: each run in a child process (output in runs/NAME/experiment.log); a run that dies (SIGKILL at step
    15) fails the command with exit 1 naming it, its exit code and log, while the other run finishes; the rerun
    resumes it. Every evaluation equals a one-at-a-time run of the same experiment."""
    cfg = tmp_path / "toy.py"
    write_toy_experiment(cfg, tmp_path / "data", TWO_RUNS)
    par, seq = tmp_path / "par", tmp_path / "seq"
    proc = run_cli("experiment", "--config", str(cfg), "--workdir", str(par), "--quiet", "--jobs", "2",
                   env={"FLATLM_DEBUG_SIGKILL_AT_STEP": "15", "FLATLM_DEBUG_SIGKILL_WORKDIR": "par/runs/b"})
    assert proc.returncode == 1, proc.stderr
    tail = proc.stderr.split("b (killed by SIGKILL; log ")[1].splitlines()  # the log's path, then its last lines
    assert tail[0].endswith("runs/b/experiment.log):") and tail[1].startswith("    "), proc.stderr
    assert "1 run(s) of toy failed" in proc.stderr and "b (killed by SIGKILL; log " in proc.stderr, proc.stderr
    assert (par / "runs" / "a" / "DONE").exists() and not (par / "runs" / "b" / "DONE").exists()
    assert "a  finished" in (par / "runs" / "a" / "experiment.log").read_text()
    proc = run_cli("experiment", "--config", str(cfg), "--workdir", str(par), "--quiet", "--json", "--jobs", "2")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["runs"] == {"a": "done earlier", "b": "finished"}
    proc = run_cli("experiment", "--config", str(cfg), "--workdir", str(seq), "--quiet", "--json")
    assert proc.returncode == 0, proc.stderr
    for run in ("a", "b"):
        assert _eval_losses(par / "runs" / run) == _eval_losses(seq / "runs" / run)
        assert [s for s, _ in _eval_losses(seq / "runs" / run)] == [10, 20]
    bad = run_cli("experiment", "--config", str(cfg), "--workdir", str(seq), "--jobs", "0")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "flatlm: error: --jobs 0: pass the number of runs to train at once (1 or more; e.g. 2 on a 2-core laptop, "
        "since a cpu-preset run keeps about 1.3 cores busy)"]


def _children_of(workdir) -> list[int]:
    """Pids of live `flatlm experiment --run` processes on `workdir` (from /proc)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"--run" in cmd and str(workdir).encode() in cmd:
                pids.append(int(d))
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the children in /proc")
@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_jobs_children_stop_and_save_when_the_parent_is_stopped_or_killed(tmp_path, signal_name):
    """SIGTERM to the parent: it passes it on and exits 143; SIGKILL: the children get SIGTERM from Linux
    (PR_SET_PDEATHSIG). Either way every child saves a checkpoint and exits, and no run is marked done (a rerun
    resumes from those checkpoints, as in test_experiment_resumes_after_sigkill_without_redoing_finished_runs)."""
    import signal
    import subprocess
    import sys
    import time

    cfg = tmp_path / "toy.py"
    write_toy_experiment(cfg, tmp_path / "data", TWO_RUNS)
    wd = tmp_path / "exp"
    args = ["experiment", "--config", str(cfg), "--workdir", str(wd), "--quiet", "--jobs", "2",
            "--config.base.train.steps=100000", "--config.base.train.eval_every=100000",
            "--config.base.checkpoint.every=100000"]
    parent = subprocess.Popen([sys.executable, "-m", "flatlm.cli", *args], cwd=REPO, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    deadline = time.time() + 300
    while not all((wd / "runs" / r / "metrics.jsonl").exists() for r in "ab"):  # both children are training
        assert parent.poll() is None and time.time() < deadline, parent.stderr.read() if parent.poll() else "slow"
        time.sleep(0.5)
    time.sleep(2)
    parent.send_signal(getattr(signal, signal_name))
    rc = parent.wait(timeout=300)
    assert rc == (143 if signal_name == "SIGTERM" else -9), parent.stderr.read()
    while _children_of(wd):
        assert time.time() < deadline, f"children left: {_children_of(wd)}"
        time.sleep(0.5)
    for r in "ab":
        saved = ckpt.all_steps(str(wd / "runs" / r))
        assert saved and 0 < max(saved) < 100000 and not (wd / "runs" / r / "DONE").exists(), (r, saved)
        assert "interrupted by SIGTERM" in (wd / "runs" / r / "experiment.log").read_text()


class _FakeChild:
    """A stand-in for a child process (`subprocess.Popen` in `flatlm.experiment_jobs`): it records when it starts
    and ends, runs for 2 of the parent's polls (`polls_of[name]` if given), and fails if its run is in `fail`."""

    log: list = []
    fail: set = set()
    polls_of: dict = {}

    def __init__(self, cmd, **kwargs):
        self.name = cmd[cmd.index("--run") + 1]
        self.returncode, self.polls = None, 0
        _FakeChild.log.append(("start", self.name))

    def poll(self):
        self.polls += 1
        if self.returncode is None and self.polls >= _FakeChild.polls_of.get(self.name, 2):
            self.returncode = 1 if self.name in _FakeChild.fail else 0
            _FakeChild.log.append(("end", self.name))
        return self.returncode

    def send_signal(self, sig):
        self.returncode = -sig

    def wait(self):
        return self.returncode


def test_the_jobs_queue_starts_the_longest_runs_first_and_stops_starting_after_a_failure(tmp_path, monkeypatch):
    """`run_children`: never more than `jobs` children at once, the most training steps first (ties in the given
    order, across experiments), `on_finished` per finished child; after a failure the running ones finish, none
    starts, and RunFailed names the failed run and those not started."""
    from flatlm import experiment_jobs
    from flatlm.errors import RunFailed

    monkeypatch.setattr(experiment_jobs.subprocess, "Popen", _FakeChild)
    monkeypatch.setattr(experiment_jobs, "_POLL_S", 0.0)
    todo = (experiment_jobs.children([("a1", 20), ("a2", 20), ("a3", 80)], ("--config", "a.py"), tmp_path / "a",
                                     "a/")
            + experiment_jobs.children([("b1", 40), ("b2", 20)], ("--config", "b.py"), tmp_path / "b", "b/"))
    _FakeChild.log, _FakeChild.fail, finished = [], set(), []
    status = experiment_jobs.run_children(todo, 2, False, "suite", lambda c, t0, t1: finished.append(c.key))
    starts = [n for kind, n in _FakeChild.log if kind == "start"]
    assert starts == ["a3", "b1", "a1", "a2", "b2"]
    running = peak = 0
    for kind, _ in _FakeChild.log:
        running += 1 if kind == "start" else -1
        peak = max(peak, running)
    assert peak == 2 and status == {k: "finished" for k in ("a/a1", "a/a2", "a/a3", "b/b1", "b/b2")}
    assert sorted(finished) == sorted(status)
    assert (tmp_path / "b" / "runs" / "b2" / "experiment.log").exists()
    _FakeChild.log, _FakeChild.fail, _FakeChild.polls_of = [], {"b1"}, {"a3": 5}
    with pytest.raises(RunFailed, match=r"1 run\(s\) of suite failed; not started: a/a1, a/a2, b/b2;") as e:
        experiment_jobs.run_children(todo, 2, False, "suite")
    assert "b/b1 (exit 1; log " in str(e.value)
    assert _FakeChild.log == [("start", "a3"), ("start", "b1"), ("end", "b1"), ("end", "a3")]  # a3 ran to its end
