"""Multi-host, proven on one machine (issue 20): N processes x M simulated CPU devices, joined by
jax.distributed (gloo), train, checkpoint, resume, evaluate and measure flatness like one process with N x M
devices. The references are independent runs of one process with 8 devices (or 1), compared number by number.

The fast smoke test (default suite) runs launch/local_multihost.sh for one step against the golden numbers of the
one-process run (tests/test_golden.py); the rest is `slow`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import REPO, run_cli, xla_flags
from multihost import run_processes
from test_golden import GOLDEN

from flatlm import results as results_lib
from flatlm import sharding
from flatlm.cli.main import main
from flatlm.config import load_config
from flatlm.errors import UserError
from flatlm.run import coordinator_settings, load_run

TINY = str(REPO / "configs" / "hmm_mlm.py") + ":tiny"
SHORT = ["--config.train.steps=20", "--config.checkpoint.every=10", "--config.train.eval_every=10"]
MESHES = {  # parallelism -> flags; dp names its 8-device mesh explicitly (evaluators must re-fit it)
    "dp": ["--config.mesh.data=8"],
    "fsdp": ["--config.mesh.parallelism=fsdp"],
    "tp": ["--config.mesh.parallelism=tp", "--config.mesh.data=2", "--config.mesh.model=4"],
}
ENV = {"FLATLM_DEBUG_SIGKILL_WORKDIR": ""}  # the fault hooks act in every workdir (the default)


def _ok(procs) -> None:
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{p.stderr[-3000:]}"


def _rows(workdir) -> list[dict]:
    """metrics.jsonl without the wall-clock fields."""
    rows = [json.loads(line) for line in Path(workdir, "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("time", "train/steps_per_sec") and not k.startswith("time/")}
            for r in rows]


def _params(workdir, step=20) -> list[np.ndarray]:
    """Parameters of checkpoint `step`, loaded here (one device: the run's mesh is re-fitted)."""
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(load_run(str(workdir)).load_params(step)))]


def _seen(prefix, process: int) -> dict[int, np.ndarray]:
    """{step: targets} of the batches process `process` read (FLATLM_DEBUG_DATA_LOG)."""
    lines = Path(f"{prefix}.{process}.jsonl").read_text().splitlines()
    return {r["step"]: np.asarray(r["targets"]) for r in map(json.loads, lines)}


def _train_both(tmp: Path, data_dir, extra: list[str], via_config: bool = False) -> tuple[Path, Path]:
    """The same run as 2 processes x 4 devices and as 1 process x 8 devices, each logging the data it read."""
    args = ["--config", TINY, "--quiet", *SHORT, f"--config.data.data_dir={data_dir}", *extra]
    two, one = tmp / "two", tmp / "one"
    _ok(run_processes("train", "--workdir", str(two), *args, env={"FLATLM_DEBUG_DATA_LOG": str(tmp / "seen2")},
                      logs=tmp, via_config=via_config))
    proc = run_cli("train", "--workdir", str(one), *args,
                   env={"XLA_FLAGS": xla_flags(8),
                        "FLATLM_DEBUG_DATA_LOG": str(tmp / "seen1")})
    assert proc.returncode == 0, proc.stderr
    return two, one


def _assert_like_one(two: Path, one: Path, seen2, seen1) -> None:
    a, b = _rows(two), _rows(one)
    assert [sorted(r) for r in a] == [sorted(r) for r in b]  # same rows, each written once
    for ra, rb in zip(a, b):
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=2e-5, abs=1e-6), (ra["step"], k)
    for x, y in zip(_params(two), _params(one)):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6)
    one_saw, p0, p1 = _seen(seen1, 0), _seen(seen2, 0), _seen(seen2, 1)
    assert sorted(one_saw) == sorted(p0) == sorted(p1) == list(range(1, 21))
    for step, rows in one_saw.items():  # each process read only its half of every global batch
        half = len(rows) // 2
        np.testing.assert_array_equal(p0[step], rows[:half])
        np.testing.assert_array_equal(p1[step], rows[half:])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


# ---------------------------------------------------------------------------------------------- fast (default)


def test_two_local_processes_train_one_step_like_the_golden_single_process_run(tmp_path):
    """launch/local_multihost.sh: 2 processes x 4 devices, one step of the tiny config = the golden numbers that
    one process with one device recorded (tests/test_golden.py); per-process logs; metrics written once."""
    wd, logs = tmp_path / "w", tmp_path / "logs"
    env = {**os.environ, "PYTHON": sys.executable, "FLATLM_LOG_DIR": str(logs)}
    proc = subprocess.run(["bash", str(REPO / "launch" / "local_multihost.sh"), "2", "train", "--config", TINY,
                           "--workdir", str(wd), "--quiet", "--config.train.steps=1", "--config.train.log_every=1",
                           "--config.train.eval_every=1", "--config.checkpoint.every=1",
                           f"--config.data.data_dir={tmp_path / 'data'}"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr + (logs / "process_1.log").read_text()[-2000:]
    for i in (0, 1):
        assert "done:" in (logs / f"process_{i}.log").read_text()
    rows = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(k for k in r if "/" in k)[0] for r in rows] == ["train/grad_norm", "eval/entropy"]  # once each
    assert len(list((wd / "tensorboard").iterdir())) == 1  # one event file: process 0's
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(load_run(str(wd)).load_params(1))]
    got = {"train/loss": rows[0]["train/loss"], "train/grad_norm": rows[0]["train/grad_norm"],
           "eval/loss": rows[1]["eval/loss"], "eval/kl": rows[1]["eval/kl"],
           "param_sum": sum(float(x.sum()) for x in leaves),
           "param_abs_sum": sum(float(np.abs(x).sum()) for x in leaves),
           "param_sq_sum": sum(float((x * x).sum()) for x in leaves)}
    for key, want in GOLDEN.items():
        assert got[key] == pytest.approx(want, rel=2e-5, abs=1e-6), key


def test_launcher_stops_the_other_processes_when_one_fails(tmp_path):
    """Process 1 fails at once, process 0 would run for 10 minutes: the launcher kills it after the grace period
    and exits with the failure's status."""
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        if [[ $1 == -c ]]; then exec {sys.executable} "$@"; fi
        if [[ $JAX_PROCESS_ID == 1 ]]; then echo "boom $JAX_COORDINATOR_ADDRESS $JAX_NUM_PROCESSES"; exit 3; fi
        echo $$ > {tmp_path}/pid0; exec sleep 600
        """))
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "FLATLM_LOG_DIR": str(tmp_path / "logs"), "FLATLM_GRACE": "1"}
    proc = subprocess.run(["bash", str(REPO / "launch" / "local_multihost.sh"), "2", "train"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 3
    assert "process 1 exited with 3" in proc.stderr
    assert (tmp_path / "logs" / "process_1.log").read_text().startswith("boom 127.0.0.1:")
    assert (tmp_path / "logs" / "process_1.log").read_text().split()[-1] == "2"
    pid0 = int((tmp_path / "pid0").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid0, 0)


@pytest.mark.parametrize("env, wrong", [
    ({"JAX_NUM_PROCESSES": "2"}, "mesh.coordinator_address (JAX_COORDINATOR_ADDRESS), mesh.process_id"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     "process id 2 is not in 0..1"),
    ({"JAX_COORDINATOR_ADDRESS": "localhost", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "not HOST:PORT"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, "must be integers"),
])
def test_incomplete_or_inconsistent_coordinator_settings_are_one_line(monkeypatch, capsys, tmp_path, env, wrong):
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["train", "--config", TINY, "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and wrong in err[0], err
    assert not (tmp_path / "w").exists()


def test_multihost_without_a_cluster_or_coordinator_settings_is_one_line(tmp_path):
    env = {k: "" for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
    proc = run_cli("train", "--config", TINY, "--workdir", str(tmp_path / "w"), "--config.mesh.multihost=True", env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "mesh.multihost=True but JAX detected no TPU pod or cluster" in lines[0], lines
    assert "mesh.coordinator_address, mesh.num_processes and mesh.process_id" in lines[0]
    assert not (tmp_path / "w").exists()


def test_coordinator_settings_from_config_fields_override_the_environment(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:99")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.delenv("JAX_PROCESS_ID", raising=False)
    mesh = load_config(TINY).mesh
    with pytest.raises(UserError, match="mesh.process_id"):
        coordinator_settings(mesh)
    mesh.process_id = 3
    assert coordinator_settings(mesh) == ("10.0.0.1:99", 4, 3)
    mesh.update(coordinator_address="127.0.0.1:5", num_processes=2, process_id=1)
    assert coordinator_settings(mesh) == ("127.0.0.1:5", 2, 1)
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES"):
        monkeypatch.delenv(k)
    assert coordinator_settings(load_config(TINY).mesh) is None  # nothing set: one process (or auto-detection)


@pytest.mark.parametrize("mesh, devices, want", [
    (dict(data=8, model=1), 8, (8, 1)),  # fits: unchanged
    (dict(data=8, model=1), 1, (1, 1)),
    (dict(data=8, model=1), 6, (4, 1)),  # the largest data axis that divides the batch (64) and fits
    (dict(data=2, model=4, parallelism="tp"), 4, (1, 4)),
    (dict(data=2, model=4, parallelism="tp"), 2, (1, 2)),
    (dict(data=-1, model=1), 3, (2, 1)),  # all 3 devices would not divide the batch of 64
])
def test_evaluators_fit_the_mesh_to_the_devices_there_are(mesh, devices, want):
    c = load_config(TINY)
    c.mesh.update(**mesh)
    fitted = sharding.fit_mesh(c, devices)
    data, model = sharding.mesh_shape(fitted, devices)
    assert (data, model) == want
    sharding.validate_config(fitted, devices)  # what training would refuse, evaluation accepts
    assert (c.mesh.data, c.mesh.model) == (mesh["data"], mesh["model"])  # the run's config is left alone


def test_only_process_0_writes_results(tmp_path, monkeypatch):
    results_lib.append(str(tmp_path), [{"kind": "x", "step": 1, "v": 1.0}])
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    results_lib.append(str(tmp_path), [{"kind": "x", "step": 2, "v": 2.0}])
    assert [e["step"] for e in results_lib.load(str(tmp_path))] == [1]


def test_launch_fields_are_not_stored_with_the_run(tmp_path):
    from flatlm.config import load_workdir_config, save_workdir_config  # noqa: PLC0415 - one test's import

    c = load_config(TINY)
    c.mesh.update(coordinator_address="127.0.0.1:5", num_processes=2, process_id=1)
    save_workdir_config(c, str(tmp_path))
    c.mesh.update(coordinator_address="127.0.0.1:6", process_id=0)  # the other process, a later restart
    save_workdir_config(c, str(tmp_path), write=False)  # the same run: no refusal
    stored = load_workdir_config(str(tmp_path)).mesh
    assert (stored.coordinator_address, stored.num_processes, stored.process_id) == ("", 0, -1)


@pytest.mark.parametrize("source", ["tfds", "stream"])
def test_the_global_batch_is_the_same_for_any_number_of_processes(tmp_path, source):
    """Pipeline level: the rows processes 0..P-1 read, concatenated, are the one-process batch (P = 2, 4), for 12
    steps (the tfds corpus of 80 sentences is 5 batches of 16: epochs 1 to 3), and only their share each."""
    from flatlm.data import builder, pipeline  # noqa: PLC0415 - one test's imports
    from flatlm.languages import make_language  # noqa: PLC0415

    c = load_config(TINY)
    c.data.update(batch_size=16, source=source, num_workers=0)
    spec = c.language.to_dict()
    src = builder.data_sources(builder.build(spec, str(tmp_path), 80, 8, seed=0, quiet=True))["train"]
    kw = dict(source=src, language=make_language(c.language))

    def batches(p, n):
        it = pipeline.train_iterator(c.data, 20, 3, process_index=p, process_count=n, **kw)
        return [next(it) for _ in range(12)]

    one = batches(0, 1)
    for n in (2, 4):
        shares = [batches(p, n) for p in range(n)]
        for step, batch in enumerate(one):
            for k in batch:
                assert all(s[step][k].shape[0] == 16 // n for s in shares)
                np.testing.assert_array_equal(np.concatenate([s[step][k] for s in shares]), batch[k])
    if source == "tfds":  # each epoch is a permutation of the corpus: every sentence once per 5 batches
        seen = np.concatenate([b["targets"] for b in one[:5]])
        assert sorted(map(bytes, seen)) == sorted(bytes(src[i]["tokens"]) for i in range(80))


# ---------------------------------------------------------------------------------------------- slow


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp("dp")
    return (*_train_both(tmp, data_dir, MESHES["dp"]), tmp)


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["dp", "fsdp", "tp"])
def test_two_processes_train_like_one_with_eight_devices(parallelism, dp_runs, tmp_path, data_dir):
    if parallelism == "dp":
        two, one, tmp = dp_runs
    else:
        (two, one), tmp = _train_both(tmp_path, data_dir, MESHES[parallelism]), tmp_path
    _assert_like_one(two, one, tmp / "seen2", tmp / "seen1")
    assert len(list((two / "tensorboard").iterdir())) == 1


@pytest.mark.slow
def test_sigkill_both_mid_run_then_rerun_is_bit_identical(dp_runs, tmp_path, data_dir):
    two, _, _ = dp_runs
    wd = tmp_path / "w"
    args = ["train", "--config", TINY, "--workdir", str(wd), "--quiet", *SHORT, f"--config.data.data_dir={data_dir}",
            *MESHES["dp"]]
    killed = run_processes(*args, env={**ENV, "FLATLM_DEBUG_SIGKILL_AT_STEP": "13"}, logs=tmp_path)
    assert [p.returncode for p in killed] == [-9, -9]
    assert sorted(int(p.name) for p in (wd / "checkpoints").iterdir() if p.name.isdigit()) == [10]
    _ok(run_processes(*args, logs=tmp_path))  # both restore checkpoint 10 (state and data position)
    for a, b in zip(_params(two), _params(wd)):
        np.testing.assert_array_equal(a, b)
    assert _rows(wd) == _rows(two)


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_cleanly_and_the_rerun_is_bit_identical(dp_runs, tmp_path, data_dir):
    two, _, _ = dp_runs
    wd = tmp_path / "w"
    args = ["train", "--config", TINY, "--workdir", str(wd), "--quiet", *SHORT, f"--config.data.data_dir={data_dir}",
            *MESHES["dp"]]
    stopped = run_processes(*args, env=ENV, per_process_env={1: {"FLATLM_DEBUG_SIGTERM_AT_STEP": "7"}},
                            logs=tmp_path)
    assert [p.returncode for p in stopped] == [143, 143]
    for p in stopped:
        lines = [line for line in p.stderr.splitlines() if line.startswith("flatlm")]
        assert lines == ["flatlm: interrupted by SIGTERM at step 7 of 20; checkpoint 7 is saved; rerun the same "
                         "command to resume"]
        assert "done:" not in p.stdout
    assert sorted(int(p.name) for p in (wd / "checkpoints").iterdir() if p.name.isdigit()) == [7]
    _ok(run_processes(*args, logs=tmp_path))
    for a, b in zip(_params(two), _params(wd)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_evaluate_and_flatness_of_a_two_process_run_with_two_processes_and_with_one(dp_runs, tmp_path):
    two, _, _ = dp_runs
    evaluate = ["evaluate", "--steps", "20", "--no-finetune", "--no-lookup", "--json", "--quiet"]
    flatness = ["flatness", "--steps", "20", "--method", "hutchinson", "--num-probes", "8", "--num-batches", "2",
                "--batch-size", "16", "--json", "--quiet"]
    out = {}
    for n in (2, 1):
        wd = tmp_path / f"eval{n}"
        shutil.copytree(two, wd)  # each from the trained run alone (no shared feature cache)
        for verb in (evaluate, flatness):
            if n == 2:
                procs = run_processes(verb[0], "--workdir", str(wd), *verb[1:], logs=tmp_path)
                _ok(procs)
                stdout = procs[0].stdout
            else:  # one process, one device: the run's 8-device mesh is re-fitted
                proc = run_cli(verb[0], "--workdir", str(wd), *verb[1:])
                assert proc.returncode == 0, proc.stderr
                stdout = proc.stdout
            out[n, verb[0]] = json.loads(stdout)  # stdout holds only flatlm's JSON (gloo's lines: stderr)
        out[n, "results"] = results_lib.load(str(wd))
    e2, e1 = out[2, "evaluate"]["entries"], out[1, "evaluate"]["entries"]
    assert [(e["kind"], e.get("task")) for e in e2] == [(e["kind"], e.get("task")) for e in e1]
    for a, b in zip(e2, e1):
        for k in ("loss", "entropy", "kl"):
            if k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-5), k
        if "accuracy" in a:
            assert a["accuracy"] == pytest.approx(b["accuracy"], abs=0.01)
    f2, f1 = out[2, "flatness"]["results"][0], out[1, "flatness"]["results"][0]
    assert f2["mean"] == pytest.approx(f1["mean"], rel=1e-4)
    r2, r1 = out[2, "results"], out[1, "results"]
    assert len(r2) == len(r1) == len({results_lib.identity(e) for e in r2})  # written once each


@pytest.mark.slow
def test_stream_source_global_batch_is_the_same_with_two_processes(tmp_path, data_dir):
    """... with the coordinator settings given as config fields (--config.mesh.coordinator_address, ...)."""
    two, one = _train_both(tmp_path, data_dir, ["--config.data.source=stream"], via_config=True)
    _assert_like_one(two, one, tmp_path / "seen2", tmp_path / "seen1")
    stored = json.loads((two / "config.json").read_text())["mesh"]
    assert (stored["coordinator_address"], stored["num_processes"], stored["process_id"]) == ("", 0, -1)


@pytest.mark.slow
def test_a_multihost_mesh_that_leaves_a_process_without_rows_is_one_line(tmp_path, data_dir):
    procs = run_processes("train", "--config", TINY, "--workdir", str(tmp_path / "w"), "--quiet",
                          f"--config.data.data_dir={data_dir}", "--config.mesh.data=4", logs=tmp_path)
    for p in procs:
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip().splitlines()[-1] == (
            "flatlm: error: a multi-host mesh must use all 8 devices with a data axis that is a multiple of the 2 "
            "processes, not 4x1; set --config.mesh.data / --config.mesh.model accordingly (e.g. mesh.data=-1)")


@pytest.mark.slow
def test_lanczos_curvature_of_an_fsdp_run_with_two_processes_finishes_like_one(tmp_path, data_dir):
    """Two processes x 4 CPU devices, FSDP: the preconditioned sharpness (Lanczos over 2 batches' HVPs) hung in every
    run: the two independent per-batch HVPs, both with cross-process collectives, ran in another order in each
    process (`flatlm.sharding.one_at_a_time`). Now it finishes, with the values one process gets."""
    wd = tmp_path / "fsdp"
    _ok(run_processes("train", "--workdir", str(wd), "--config", TINY, "--quiet", *SHORT,
                      f"--config.data.data_dir={data_dir}", *MESHES["fsdp"], logs=tmp_path))
    verb = ["flatness", "--workdir", str(wd), "--steps", "20", "--spectrum-k", "2", "--preconditioned",
            "--num-batches", "2", "--batch-size", "16", "--json", "--quiet"]
    procs = run_processes(*verb, logs=tmp_path, timeout=240)
    _ok(procs)
    two = json.loads(procs[0].stdout)
    proc = run_cli(*verb)
    assert proc.returncode == 0, proc.stderr
    one = json.loads(proc.stdout)
    assert two["spectrum"][0]["top"]["values"] == pytest.approx(one["spectrum"][0]["top"]["values"], rel=1e-4)
    pre2, pre1 = two["preconditioned_sharpness"][0], one["preconditioned_sharpness"][0]
    assert pre2["value"] == pytest.approx(pre1["value"], rel=1e-4)
