"""launch/ (issue 16, items 5 and 6) in dry-run mode: the exact gcloud / pip commands, the detached training with
its log, one job per experiment run, the Python >= 3.11 choice on TPU workers, and jax[cuda12] into a CPU venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from conftest import REPO

LAUNCH = REPO / "launch"


def _sh(*args, env=None, cwd=REPO):
    proc = subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()


def test_tpu_train_is_detached_with_a_log():
    (line,) = _sh(LAUNCH / "tpu.sh", "--dry-run", "train", "s", "us-central2-b", "configs/hmm_mlm.py:paper",
                  "gs://b/hmm", "--config.train.steps=5")
    assert line == ("gcloud compute tpus tpu-vm ssh s --zone us-central2-b --worker=all --command 'mkdir -p "
                    "~/flatlm-logs && cd ~/flatlm && nohup .venv/bin/flatlm train --config configs/hmm_mlm.py:paper "
                    "--workdir gs://b/hmm --config.mesh.multihost=True --config.train.steps=5 > "
                    "~/flatlm-logs/train.log 2>&1 < /dev/null & echo started train on $(hostname), log "
                    "~/flatlm-logs/train.log'")
    assert _sh(LAUNCH / "tpu.sh", "--dry-run", "create", "s", "z") == [
        "gcloud compute tpus tpu-vm create s --zone z --accelerator-type v4-32 --version tpu-ubuntu2204-base"]
    assert _sh(LAUNCH / "tpu.sh", "--dry-run", "logs", "s", "z") == [
        "gcloud compute tpus tpu-vm ssh s --zone z --worker=0 --command 'tail -n 50 ~/flatlm-logs/train.log'"]


def test_tpu_experiment_starts_one_job_per_run(tmp_path):
    flatlm = tmp_path / "flatlm"  # the real CLI of this checkout
    flatlm.write_text(f"#!/bin/sh\nexec {sys.executable} -m flatlm.cli \"$@\"\n")
    flatlm.chmod(0o755)
    config = "configs/experiments/fig2_model_sizes.py:tiny"
    runs = subprocess.run([sys.executable, "-m", "flatlm.cli", "experiment", "--config", config, "--list"],
                          capture_output=True, text=True, cwd=REPO, check=True).stdout.split()
    assert len(runs) >= 2
    lines = _sh(LAUNCH / "tpu.sh", "--dry-run", "experiment", "fx", "z", config, "gs://b/fig2", "v4-8",
                env={"FLATLM": str(flatlm), "PYTHONPATH": str(REPO)})
    starts = [ln for ln in lines if "nohup" in ln]
    assert len(starts) == len(runs)
    for r, ln in zip(runs, starts):
        assert f" --run {r} " in ln and f"~/flatlm-logs/experiment-{r}.log" in ln and ln.split()[5].startswith("fx-")
        assert "--config.base.mesh.multihost=True" in ln
    assert sum("tpu-vm create" in ln and "--accelerator-type v4-8" in ln for ln in lines) == len(runs)


def test_worker_setup_gets_python_311_when_the_image_has_310(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    old = bin_ / "python3"  # the image's python3: 3.10
    old.write_text("#!/bin/sh\nexit 1\n")
    old.chmod(0o755)
    lines = _sh(LAUNCH / "worker_setup.sh", env={"FLATLM_DRY_RUN": "1", "FLATLM_PYTHONS": str(old)})
    assert any(ln.endswith("uv python install 3.11") for ln in lines)
    assert any("python find 3.11" in ln and ln.endswith("-m venv .venv") for ln in lines)
    assert lines[-2] == ".venv/bin/pip install --quiet -e '.[gcs]' 'jax[tpu]>=0.10,<0.11'"


def _fake_checkout(tmp_path, backend: str):
    root = tmp_path / backend
    shutil.copytree(LAUNCH, root / "launch")
    venv = root / ".venv" / "bin"
    venv.mkdir(parents=True)
    # a venv python: Python >= 3.11 (the version check passes); JAX's backend is `backend`
    (venv / "python").write_text("#!/bin/sh\ncase \"$*\" in *default_backend*) "
                                 f"[ {backend} = gpu ]; exit $?;; esac\nexit 0\n")
    (venv / "python").chmod(0o755)
    return root


def test_gpu_installs_cuda_jax_into_a_cpu_venv(tmp_path):
    cpu = _fake_checkout(tmp_path, "cpu")
    lines = _sh(cpu / "launch" / "gpu.sh", "--dry-run", "c.py", "w", "--config.train.steps=5", cwd=cpu)
    assert lines == [".venv/bin/pip install -q -e '.[gcs]' 'jax[cuda12]>=0.10,<0.11'",
                     ".venv/bin/flatlm train --config c.py --workdir w --config.train.steps=5"]
    gpu = _fake_checkout(tmp_path, "gpu")
    assert _sh(gpu / "launch" / "gpu.sh", "--dry-run", "c.py", "w", cwd=gpu) == [
        ".venv/bin/flatlm train --config c.py --workdir w"]
