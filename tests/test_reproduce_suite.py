"""`flatlm reproduce` running a suite: one claim end to end (slow), `--jobs`' single queue over every experiment,
`--seeds` and the workdir that keeps them, and the one-line errors that write nothing, on toy experiments. The
claims' verdicts and the report on synthetic workdirs: test_reproduce.py."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, write_toy_experiment

from flatlm import reproduce_run
from flatlm.errors import UserError


@pytest.mark.slow
def test_reproduce_runs_one_claim_end_to_end(tmp_path):
    """C3 at the tiny preset through the real CLI: experiments, evaluation, verdicts, report."""
    proc = run_cli("reproduce", "--preset", "tiny", "--workdir", str(tmp_path), "--claims", "C3", "--quiet",
                   "--json", timeout=3000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert [c["claim"] for c in out["claims"]] == ["C3"] and out["claims"][0]["verdict"] in ("reproduced",
                                                                                            "not reproduced",
                                                                                            "inconclusive")
    assert "## C3" in (tmp_path / "report" / "reproduction.md").read_text()


def test_reproduce_jobs_trains_the_runs_of_every_experiment_in_one_queue(tmp_path, monkeypatch):
    """`run_suite(jobs=2)` on a two-experiment suite (exp_a: runs a1, a2 of 20 steps; exp_b: b1 of 40): exp_b's run
    trains beside exp_a's, so the experiments' spans (first run's start to last one's end) overlap and sum to more
    than the suite's wall time, which `suite.json` records; an experiment listed by two claims runs once; a rerun
    trains nothing and adds nothing."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    for name, runs in (("exp_a", [("a1", []), ("a2", [])]), ("exp_b", [("b1", ["--config.train.steps=40"])])):
        write_toy_experiment(tmp_path / f"{name}.py", tmp_path / "data", runs, name=name)
    plan = {"C1": [("exp_a", "hmm")], "C2": [("exp_b", "hmm")], "C3": [], "C4": [], "C5": [("exp_a", "hmm")]}
    monkeypatch.setattr(reproduce_run, "CONFIGS", tmp_path)
    monkeypatch.setattr(reproduce_run, "plan", lambda preset: plan)
    wd = tmp_path / "suite"
    timings = reproduce_run.run_suite("tiny", str(wd), progress=False, jobs=2)
    for run in ("exp_a-hmm/runs/a1", "exp_a-hmm/runs/a2", "exp_b-hmm/runs/b1"):
        assert (wd / run / "DONE").exists() and (wd / run / "experiment.log").exists(), run
    wall = reproduce_run.load_wall(str(wd))
    assert set(timings) == {"exp_a-hmm", "exp_b-hmm"} and min(timings.values()) > 0
    assert timings["exp_a-hmm"] + timings["exp_b-hmm"] > wall > max(timings.values()), (timings, wall)
    assert reproduce_run.run_suite("tiny", str(wd), progress=False, jobs=2) == timings
    assert reproduce_run.load_wall(str(wd)) < wall + 5


def test_reproduce_refuses_a_job_count_below_one_before_writing_anything(tmp_path):
    """`run_suite(jobs=0)` through the Python API: a UserError, no workdir made (the queue would never start a run)."""
    with pytest.raises(UserError, match="--jobs 0: pass the number of runs"):
        reproduce_run.run_suite("tiny", str(tmp_path / "suite"), progress=False, jobs=0)
    assert not (tmp_path / "suite").exists()


@pytest.mark.parametrize("jobs", [1, pytest.param(2, marks=pytest.mark.slow)])  # jobs 2: in the queue test above
def test_reproduce_seeds_trains_every_experiment_over_the_given_seeds_and_the_workdir_keeps_them(
        tmp_path, monkeypatch, jobs):
    """`run_suite(seeds=(5,))` on an experiment whose preset repeats its runs over seeds 0, 1: only a-seed5 trains
    (in-process and through `--jobs`' child processes, which are given --seeds); suite.json records the seeds; a
    call without seeds resumes with them; other seeds or another preset on that workdir are one-line errors that
    change nothing (the preset used to be overwritten before the experiments refused it)."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    write_toy_experiment(tmp_path / "exp_a.py", tmp_path / "data", [("a", [])], name="exp_a", seeds=(0, 1))
    monkeypatch.setattr(reproduce_run, "CONFIGS", tmp_path)
    plan = {cid: [("exp_a", "hmm")] if cid == "C1" else [] for cid in reproduce_run.SUITE}
    monkeypatch.setattr(reproduce_run, "plan", lambda preset: plan)
    wd = tmp_path / "suite"
    reproduce_run.run_suite("tiny", str(wd), progress=False, jobs=jobs, seeds=(5,))
    assert sorted(p.name for p in (wd / "exp_a-hmm" / "runs").iterdir()) == ["a-seed5"]
    assert (wd / "exp_a-hmm" / "runs" / "a-seed5" / "DONE").exists()
    assert reproduce_run.load_seeds(str(wd)) == (5,) and reproduce_run.load_preset(str(wd)) == "tiny"
    meta = (wd / "suite.json").read_text()
    with pytest.raises(UserError, match=r"was made with --seeds 5, not --seeds 0,1; use a new --workdir"):
        reproduce_run.run_suite("tiny", str(wd), progress=False, jobs=jobs, seeds=(0, 1))
    with pytest.raises(UserError, match="holds the suite of --preset tiny, not cpu; rerun with --preset tiny"):
        reproduce_run.run_suite("cpu", str(wd), progress=False, jobs=jobs)
    assert (wd / "suite.json").read_text() == meta
    done = (wd / "exp_a-hmm" / "runs" / "a-seed5" / "DONE").stat().st_mtime_ns
    reproduce_run.run_suite("tiny", str(wd), progress=False, jobs=jobs)  # resumes with the recorded seeds
    assert sorted(p.name for p in (wd / "exp_a-hmm" / "runs").iterdir()) == ["a-seed5"]
    assert (wd / "exp_a-hmm" / "runs" / "a-seed5" / "DONE").stat().st_mtime_ns == done
    assert reproduce_run.load_seeds(str(wd)) == (5,)


def test_reproduce_seeds_that_are_not_integers_are_a_one_line_error(tmp_path):
    proc = run_cli("reproduce", "--preset", "tiny", "--workdir", str(tmp_path / "w"), "--seeds", "1,x")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "'1,x': write comma-separated integers, e.g. --seeds 3,4,5" in proc.stderr
    assert not (tmp_path / "w").exists()
