"""Extending a finished run (issue 16, item 8): a larger `--config.train.steps` resumes it, and the extended run
equals a straight run of the larger step count bit for bit; a schedule that scales with train.steps is refused in
one line, and so is any other changed field."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import REPO

from flatlm.cli.main import main
from flatlm.run import load_run

TINY = str(REPO / "configs" / "hmm_mlm.py") + ":tiny"
CONSTANT = ["--config.train.schedule=constant", "--config.train.warmup_frac=0.0", "--config.checkpoint.every=6",
            "--config.train.eval_every=6", "--config.train.log_every=3"]


def _train(wd, data, steps, *extra):
    return main(["train", "--config", TINY, "--workdir", str(wd), "--quiet", f"--config.train.steps={steps}",
                 f"--config.data.data_dir={data}", *CONSTANT, *extra])


def _params(wd, step):
    return jax.tree.leaves(jax.device_get(load_run(str(wd)).load_params(step)))


@pytest.mark.slow  # 57 s on 2 shared cores: five tiny trainings
def test_raising_train_steps_resumes_exactly_and_unsafe_changes_are_refused(tmp_path, capsys):
    data = tmp_path / "data"
    assert _train(tmp_path / "straight", data, 12) == 0
    assert _train(tmp_path / "ext", data, 6) == 0
    assert _train(tmp_path / "ext", data, 12) == 0  # was: "already holds a run with a different config"
    for a, b in zip(_params(tmp_path / "straight", 12), _params(tmp_path / "ext", 12), strict=True):
        np.testing.assert_array_equal(a, b)
    assert json.loads((tmp_path / "ext" / "config.json").read_text())["train"]["steps"] == 12
    rows = lambda wd: [(r["step"], r.get("train/loss")) for r in  # noqa: E731
                       map(json.loads, (wd / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
    assert rows(tmp_path / "ext") == rows(tmp_path / "straight")
    capsys.readouterr()

    # lowering steps, or another field: refused as before
    assert _train(tmp_path / "ext", data, 8) == 2
    assert "different config (fields train.steps)" in capsys.readouterr().err
    assert _train(tmp_path / "ext", data, 18, "--config.train.lr=0.01") == 2
    assert "fields train.lr, train.steps" in capsys.readouterr().err

    # a linear decay over train.steps: the steps already trained would change, so extending is refused
    lin = ["--config.train.schedule=linear"]
    assert _train(tmp_path / "lin", data, 6, *lin) == 0
    capsys.readouterr()
    assert _train(tmp_path / "lin", data, 12, *lin) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flatlm: error: raising train.steps from 6 to 12 changes the "
                                               "learning rate of steps already trained (from step 1:")
    assert json.loads((tmp_path / "lin" / "config.json").read_text())["train"]["steps"] == 6
