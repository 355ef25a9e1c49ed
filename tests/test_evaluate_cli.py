"""`flatlm evaluate`: every checkpoint gets exact loss, probe and fine-tune results; results.json only grows."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO, run_cli

from flatlm import results
from flatlm.cli.common import parse_steps
from flatlm.errors import UserError
from flatlm.run import load_run

TINY = str(REPO / "configs" / "hmm_mlm.py") + ":tiny"
SMALL_EVAL = ["--config.eval.tasks=['k3']", "--config.eval.task_train_size=600", "--config.eval.task_eval_size=200",
              "--config.eval.probe.epochs=3", "--config.eval.probe.num_seeds=2", "--config.eval.finetune.epochs=1",
              "--config.eval.finetune.num_seeds=1", "--config.eval.finetune.warmup_steps=2",
              "--config.train.steps=20", "--config.checkpoint.every=10", "--config.train.eval_every=20"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    wd = tmp_path_factory.mktemp("run") / "w"
    proc = run_cli("train", "--config", TINY, "--workdir", str(wd), "--quiet", *SMALL_EVAL)
    assert proc.returncode == 0, proc.stderr
    return wd


def test_two_evaluate_calls_keep_both_sets_of_results(trained):
    first = run_cli("evaluate", "--workdir", str(trained), "--steps", "10", "--quiet", "--json")
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    kinds = sorted({(e["kind"], e["step"]) for e in out["entries"]}, key=str)
    assert ("exact_loss", 10) in kinds and ("probe", 10) in kinds and ("finetune", 10) in kinds
    assert ("lookup_table", None) in kinds
    assert all(e["seconds"] > 0 for e in out["entries"])  # each measurement's own time (reproduce_suite.py)
    task = load_run(str(trained)).load_task("k3")  # the majority-class rate of each headline split, by hand
    for e in (e for e in out["entries"] if e["kind"] != "exact_loss"):
        labels = np.asarray(task[e["split"]]["label"])
        assert e["majority"] == pytest.approx(np.bincount(labels).max() / len(labels))
    n1 = len(results.load(str(trained)))
    second = run_cli("evaluate", "--workdir", str(trained), "--steps", "last", "--quiet", "--no-lookup",
                     "--no-finetune")
    assert second.returncode == 0, second.stderr
    assert "probe:k3" in second.stdout and "appended" in second.stdout
    entries = results.load(str(trained))
    assert len(entries) > n1
    assert entries[:n1] == json.loads((trained / "results.json").read_text())["results"][:n1]
    steps = {e["step"] for e in entries if e["kind"] == "probe"}
    assert steps == {10, 20}
    exact = [e for e in entries if e["kind"] == "exact_loss"]
    assert all(abs(e["loss"] - e["entropy"] - e["kl"]) < 1e-9 for e in exact)
    assert all(0.0 <= e["accuracy"] <= 1.0 for e in entries if "accuracy" in e)
    assert list((trained / "features").glob("*.npz"))  # features cached per checkpoint


def test_bad_steps_and_workdirs_are_user_errors(tmp_path, trained):
    with pytest.raises(UserError, match="no checkpoint at step"):
        parse_steps("7", [10, 20])
    with pytest.raises(UserError, match="not all, last"):
        parse_steps("ten", [10, 20])
    proc = run_cli("evaluate", "--workdir", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "not a flatlm run" in proc.stderr
    proc = run_cli("evaluate", "--workdir", str(trained), "--task", "k99")
    assert proc.returncode == 2 and "task-1 .. task-8" in proc.stderr
