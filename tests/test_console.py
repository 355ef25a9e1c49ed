"""The console of `flatlm train` and `demo` (issue 16, item 7): the progress bar names the training objective and
the exact eval loss as separate fields; --quiet prints nothing on stderr (not even tfds' dataset banner); the
device count and mesh shape are printed once; the final line carries units; an unwritable workdir is one line."""

from __future__ import annotations

import re

import pytest
from conftest import REPO, run_cli

TINY = [str(REPO / "configs" / "hmm_mlm.py") + ":tiny", "--config.train.steps=4", "--config.train.eval_every=4",
        "--config.checkpoint.every=4", "--config.train.log_every=2"]


@pytest.mark.slow  # 40 s on 2 shared cores: two tiny trainings in fresh processes
def test_train_console(tmp_path):
    quiet = run_cli("train", "--config", TINY[0], "--workdir", str(tmp_path / "q"), "--quiet", *TINY[1:],
                    f"--config.data.data_dir={tmp_path / 'data'}")
    assert quiet.returncode == 0 and quiet.stderr == ""  # was: "Downloading and preparing dataset ..." lines
    (done,) = quiet.stdout.strip().splitlines()
    fields = dict(re.findall(r"(eval/\w+)=(\S+ ?(?:nats)?)", done))
    assert all(v.endswith(" nats") for k, v in fields.items() if k != "eval/log_kl")
    assert not fields["eval/log_kl"].endswith("nats") and len(fields) == 6

    loud = run_cli("train", "--config", TINY[0], "--workdir", str(tmp_path / "l"), *TINY[1:],
                   f"--config.data.data_dir={tmp_path / 'data'}")
    assert loud.returncode == 0, loud.stderr
    mesh = [line for line in loud.stderr.splitlines() if "device(s)" in line]
    assert len(mesh) == 1 and mesh[0].startswith("flatlm: 1 cpu device(s) on 1 process(es); mesh {")
    bar = loud.stderr.replace("\r", "\n").splitlines()
    last = [line for line in bar if line.startswith("train")][-1]
    assert "train_objective=" in last and "exact_loss=" in last and " nats" in last and "loss=" not in \
        last.replace("exact_loss=", "")


def test_demo_unwritable_workdir_is_one_line(tmp_path):
    proc = run_cli("demo", "--workdir", "/proc/flatlm-demo", "--quiet", "--steps", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "flatlm: error: cannot write /proc/flatlm-demo: No such file or directory; choose a writable --workdir / "
        "--data-dir / --out"]
