"""Concurrent writers and interrupted runs: nothing lost, nothing duplicated (issue 15).

Locks (`flatlm.locks`): one writer per workdir, one builder per dataset; results.json appends from many processes
all survive; a redone measurement replaces its entry; a resumed run logs each step once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
from conftest import REPO, run_cli, write_toy_experiment

from flatlm import locks, results
from flatlm.errors import UserError

TINY = str(REPO / "configs" / "hmm_mlm.py") + ":tiny"
PY = [sys.executable, "-c"]


def _popen(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})


def _cli(*args: str) -> subprocess.Popen:
    return _popen(sys.executable, "-m", "flatlm.cli", *args)


def _holder_process(code: str) -> subprocess.Popen:
    """A python process that runs `code` (which takes a lock and prints 'held'), then waits for a line on stdin."""
    proc = subprocess.Popen([*PY, textwrap.dedent(code)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=REPO)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _first_line(proc: subprocess.Popen, prefix: str) -> str:
    """The first line of `proc`'s stderr that starts with `prefix` (reading up to it); all of it if none does."""
    seen = []
    for line in proc.stderr:
        if line.startswith(prefix):
            return line
        seen.append(line)
    return "".join(seen)


# --- results.json --------------------------------------------------------------------------------------------------

APPENDER = """
import sys
from flatlm import results
for i in range(50):
    results.append(sys.argv[1], [{"kind": "test", "step": i, "task": sys.argv[2], "value": i}])
"""


def test_eight_processes_appending_fifty_entries_each_keep_all_four_hundred(tmp_path):
    procs = [subprocess.Popen([*PY, APPENDER, str(tmp_path), f"p{k}"], cwd=REPO) for k in range(8)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 8
    entries = results.load(str(tmp_path))
    assert len(entries) == 400
    assert {(e["task"], e["step"]) for e in entries} == {(f"p{k}", i) for k in range(8) for i in range(50)}
    assert not list(tmp_path.glob(".results.json.*.tmp"))


def test_append_replaces_an_entry_of_the_same_identity(tmp_path):
    wd = str(tmp_path)
    results.append(wd, [{"kind": "exact_loss", "step": 10, "loss": 2.0},
                        {"kind": "probe", "step": 10, "task": "k3", "accuracy": 0.5},
                        {"kind": "probe", "step": 10, "task": "k4", "accuracy": 0.6},
                        {"kind": "lookup_table", "step": None, "task": "k3", "accuracy": 0.9}])
    grown = {"kind": "flatness", "step": 10, "method": "fisher", "trace": 1.0,
             "detail": {"method": "fisher_per_sample"}}
    results.append(wd, [{**grown, "grown_to": None}, {**grown, "grown_to": (2, 128)},
                        {**grown, "grown_to": None, "detail": {"method": "fisher_summed"}}])
    assert len(results.load(wd)) == 7  # different task, grown_to or estimator: distinct measurements
    results.append(wd, [{"kind": "exact_loss", "step": 10, "loss": 1.0},
                        {"kind": "exact_loss", "step": 20, "loss": 0.5}])
    results.append(wd, [{**grown, "grown_to": [2, 128], "trace": 3.0}])  # a tuple read back from JSON is a list
    entries = results.load(wd)
    assert len(entries) == 8
    assert [e["loss"] for e in entries if e["kind"] == "exact_loss"] == [1.0, 0.5]  # the redone one, at the end
    assert [e["trace"] for e in entries if e.get("grown_to") == [2, 128]] == [3.0]
    assert entries[0]["task"] == "k3"  # other entries keep their place
    assert results.identity({"kind": "probe", "step": 1, "task": "A", "time": 1}) == \
        results.identity({"kind": "probe", "step": 1, "task": "A", "time": 2, "accuracy": 0.1})
    # probes of two inner layers at one step (eval.probe.layers): two measurements, each redone in its place
    layer = {"kind": "layer_probe", "step": 10, "task": "k3"}
    results.append(wd, [{**layer, "layer": 1, "accuracy": 0.5}, {**layer, "layer": 2, "accuracy": 0.4}])
    results.append(wd, [{**layer, "layer": 2, "accuracy": 0.45}])
    assert [(e["layer"], e["accuracy"]) for e in results.load(wd) if e["kind"] == "layer_probe"] == [(1, 0.5),
                                                                                                      (2, 0.45)]


# --- locks ---------------------------------------------------------------------------------------------------------

def test_exclusive_lock_names_the_holder_and_a_dead_holder_does_not_block(tmp_path):
    holder = _holder_process(f"""
        from flatlm import locks
        with locks.exclusive({str(tmp_path)!r}, "training"):
            print("held", flush=True)
            input()
    """)
    try:
        with pytest.raises(UserError, match=rf"another flatlm process \(pid {holder.pid}\) is training in "):
            with locks.exclusive(tmp_path, "evaluating"):
                pass
        from flatlm.evaluate.runner import evaluate_run  # the writers take the same lock before anything else
        from flatlm.experiment import run_experiment
        from flatlm.flatness.runner import measure_run

        with pytest.raises(UserError, match=f"pid {holder.pid}"):
            evaluate_run(str(tmp_path))
        with pytest.raises(UserError, match=f"pid {holder.pid}"):
            measure_run(types.SimpleNamespace(workdir=str(tmp_path)))
        with pytest.raises(UserError, match=f"pid {holder.pid}"):
            run_experiment(types.SimpleNamespace(name="x", runs=[]), str(tmp_path))
    finally:
        holder.communicate("\n", timeout=30)
    # a lock file naming a process that died (SIGKILL leaves its pid behind) does not block
    (tmp_path / locks.LOCK).write_text(json.dumps({"pid": holder.pid, "what": "training"}))
    with locks.exclusive(tmp_path, "evaluating"), locks.exclusive(tmp_path, "re-entered by its holder"):
        assert locks.holder(tmp_path / locks.LOCK) == (os.getpid(), f"evaluating in {tmp_path}")
    assert locks.holder(tmp_path / locks.LOCK) is None


def test_two_trainings_on_one_workdir_one_stops_with_the_holders_pid(tmp_path):
    args = ["train", "--config", TINY, "--workdir", str(tmp_path / "run"), "--quiet", "--config.train.steps=20",
            "--config.checkpoint.every=10", "--config.train.eval_every=10",
            f"--config.data.data_dir={tmp_path / 'data'}"]
    procs = [_cli(*args), _cli(*args)]
    outs = [p.communicate(timeout=600) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [o[1][-2000:] for o in outs]
    winner, loser = (0, 1) if procs[0].returncode == 0 else (1, 0)
    err = outs[loser][1]
    assert f"flatlm: error: another flatlm process (pid {procs[winner].pid}) is training in " in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == [10, 20]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/kl" in r] == [10, 20]  # trained once, not twice


# --- datasets ------------------------------------------------------------------------------------------------------

def _corpus_folder(data_dir: Path, config) -> Path:
    from flatlm.data import builder

    cfg = builder.corpus_config(config.language.to_dict(), config.data.train_size, config.data.eval_size, config.seed)
    return data_dir / builder.FlatlmCorpus.name / cfg.name


def test_concurrent_builds_of_one_corpus_wait_for_each_other(tmp_path, tiny_config):
    """Two `flatlm data` from two workdirs on one data dir, started while a third process holds the corpus's lock:
    both wait (one line naming its pid), then one builds and the other finds it built."""
    data = tmp_path / "data"
    folder = _corpus_folder(data, tiny_config)
    holder = _holder_process(f"""
        from flatlm import locks
        with locks.waiting({str(folder / locks.LOCK)!r}, "building dataset (a test holding it)"):
            print("held", flush=True)
            input()
    """)
    procs = [_cli("data", "--config", TINY, "--data-dir", str(data), "--workdir", str(tmp_path / f"w{k}"),
                  "--no-tasks", "--quiet", "--json") for k in range(2)]
    try:
        waiting = [_first_line(p, "flatlm: waiting: ") for p in procs]  # both are waiting now
    finally:
        holder.communicate("\n", timeout=30)
    for line in waiting:
        assert line.startswith(f"flatlm: waiting: another flatlm process (pid {holder.pid}) is building dataset"), line
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    sizes = [{d["split"]: d["examples"] for d in json.loads(o[0])["datasets"]} for o in outs]
    assert sizes[0] == sizes[1] == {"train": 2000, "validation": 200}
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "1.0.0"]  # one copy, nothing half-written


def test_leftovers_of_a_killed_build_are_removed(tmp_path, tiny_config):
    from flatlm.data import builder, tasks

    tiny_config.data.update(train_size=64, eval_size=16)
    folder = _corpus_folder(tmp_path, tiny_config)
    (folder / "incomplete.ABC123_1.0.0" / "train").mkdir(parents=True)
    (folder / "incomplete.ABC123_1.0.0" / "train" / "shard").write_text("half")
    spec = tiny_config.language.to_dict()
    b = builder.build(spec, str(tmp_path), 64, 16, seed=tiny_config.seed, quiet=True)
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "1.0.0"]
    assert len(builder.data_sources(b)["validation"]) == 16
    task_dir = tmp_path / tasks.FlatlmTask.name
    junk = task_dir / "somewhere" / "incomplete.XYZ_1.0.0"  # another dataset's leftovers are not this build's
    junk.mkdir(parents=True)
    out = tasks.build_task(spec, "k3", str(tmp_path), (32, 8, 8), seed=0, quiet=True)
    assert len(out["test"]["label"]) == 8 and junk.exists()
    (built,) = [p for p in task_dir.iterdir() if p.name != "somewhere"]
    (built / "incomplete.QQ_1.0.0").mkdir()
    tasks.build_task(spec, "k3", str(tmp_path), (32, 8, 8), seed=0, quiet=True)
    assert sorted(p.name for p in built.iterdir()) == [".lock", "1.0.0"]


# --- resumed runs --------------------------------------------------------------------------------------------------

@pytest.mark.slow  # make test: train's SIGKILL resume
def test_metrics_have_one_row_per_step_after_sigkill_and_resume(tmp_path):
    wd = tmp_path / "run"
    args = ["train", "--config", TINY, "--workdir", str(wd), "--quiet", "--config.train.steps=20",
            "--config.checkpoint.every=10", "--config.train.eval_every=5", "--config.train.log_every=1"]
    proc = run_cli(*args, env={"FLATLM_DEBUG_SIGKILL_AT_STEP": "15"})
    assert proc.returncode == -9, proc.stderr[-2000:]
    rows = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 15  # steps 11..15 were logged, then lost with the process
    with open(wd / "metrics.jsonl", "a") as f:
        f.write('{"step": 16, "train/lo')  # a line cut short by the kill
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
    train = [r["step"] for r in rows if "train/loss" in r]
    evals = [r["step"] for r in rows if "eval/kl" in r]
    assert train == list(range(1, 21)) and evals == [5, 10, 15, 20]
    assert len(list((wd / "tensorboard").glob("events.out.tfevents.*"))) == 2  # the resumed one purges from 11


@pytest.mark.slow  # make test: test_experiment's SIGKILL resume
def test_a_resumed_experiment_redoes_a_cut_evaluation_without_duplicates(tmp_path):
    """A kill between step 20's last-layer probe and its `eval.probe.layers` probe: the resumed experiment redoes
    step 20's evaluation (it once counted a step with a probe entry as evaluated, and marked the run done without
    its layer probe), once, and leaves step 10 alone."""
    cfg = tmp_path / "toy.py"
    write_toy_experiment(cfg, tmp_path / "data", eval_every=20, evaluate=True, extra=(
        'base.eval.update(tasks=("k3",), task_train_size=200, task_eval_size=100)',
        "base.eval.probe.update(epochs=2, num_seeds=1, layers=(1,))", "base.eval.finetune.enabled = False"))
    wd = tmp_path / "exp"
    args = ["experiment", "--config", str(cfg), "--workdir", str(wd), "--quiet"]
    assert run_cli(*args).returncode == 0
    run = wd / "runs" / "a"
    (run / "DONE").unlink()
    kept = [e for e in results.load(str(run)) if not (e["kind"] == "layer_probe" and e["step"] == 20)]
    (run / "results.json").write_text(json.dumps({"results": kept}))
    t0 = time.time()
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    entries = results.load(str(run))
    for kind in ("exact_loss", "probe", "layer_probe"):
        assert sorted(e["step"] for e in entries if e["kind"] == kind) == [10, 20], kind
    redone = [(e["kind"], e["step"]) for e in entries if e["time"] >= t0]
    assert redone == [("exact_loss", 20), ("probe", 20), ("layer_probe", 20)]
    assert (run / "DONE").exists()


def test_incomplete_steps_name_every_missing_measurement():
    """`incomplete_steps`: a step lacks its evaluation until the exact loss and, per task, the probe, each layer
    probe and (fine-tuning on) the fine-tuned accuracy are all there."""
    from flatlm.config import load_config
    from flatlm.evaluate.runner import incomplete_steps

    config = load_config(TINY)
    config.eval.update(tasks=("k3", "k4"))
    config.eval.probe.layers = (1,)
    config.eval.finetune.enabled = True
    full = [{"kind": "exact_loss", "step": s} for s in (10, 20)]
    full += [{"kind": k, "step": s, "task": t} for k in ("probe", "finetune") for s in (10, 20) for t in ("k3", "k4")]
    full += [{"kind": "layer_probe", "step": s, "task": t, "layer": 1} for s in (10, 20) for t in ("k3", "k4")]
    full += [{"kind": "lookup_table", "step": None, "task": "k3"}]
    assert incomplete_steps(config, full, [10, 20]) == []
    assert incomplete_steps(config, full, [10, 20, 30]) == [30]
    for i, e in enumerate(full[:-1]):
        assert incomplete_steps(config, full[:i] + full[i + 1:], [10, 20]) == [e["step"]], e
    other_layer = [dict(e, layer=2) if e["kind"] == "layer_probe" and e["step"] == 10 else e for e in full]
    assert incomplete_steps(config, other_layer, [10, 20]) == [10]
    config.eval.finetune.enabled = False
    config.eval.probe.layers = ()
    lean = [e for e in full if e["kind"] in ("exact_loss", "probe")]
    assert incomplete_steps(config, lean, [10, 20]) == []
