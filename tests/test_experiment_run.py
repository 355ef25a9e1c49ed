"""`flatlm experiment --list` and `--run NAME` (issue 16, item 6): the run names, and one run (training with its
evaluation and flatness) of an experiment, as launch/tpu.sh experiment starts them, one job per run."""

from __future__ import annotations

import json

from conftest import write_toy_experiment

from flatlm.cli.main import main


def test_list_and_run_one(tmp_path, capsys):
    cfg = tmp_path / "toy.py"
    write_toy_experiment(cfg, tmp_path / "data", [("a", []), ("b", ["--config.model.d_model=32"])], steps=4,
                         eval_every=4, checkpoint_every=4)
    assert main(["experiment", "--config", str(cfg), "--list"]) == 0
    assert capsys.readouterr().out.split() == ["a", "b"]
    wd = tmp_path / "exp"
    assert main(["experiment", "--config", str(cfg), "--workdir", str(wd), "--run", "b", "--quiet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"] == {"b": "finished"}
    assert (wd / "runs" / "b" / "DONE").exists() and not (wd / "runs" / "a").exists()
    # phase times for benchmarks/reproduce_suite.py: exact loss while training, each measurement after it
    rows = [json.loads(line) for line in (wd / "runs" / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "time/exact_loss_s" in r] == [4] and rows[-1]["time/exact_loss_s"] > 0
    assert rows[-1]["time/exact_loss_s"] < json.loads((wd / "runs" / "b" / "DONE").read_text())["seconds"]
    assert json.loads((wd / "experiment.json").read_text())["name"] == "toy"
    assert main(["experiment", "--config", str(cfg), "--workdir", str(wd), "--run", "c"]) == 2
    assert capsys.readouterr().err.strip() == ("flatlm: error: experiment toy has no run 'c'; its runs: a, b "
                                               "(flatlm experiment --list)")
    assert main(["experiment", "--config", str(cfg)]) == 2
    assert "--workdir is required" in capsys.readouterr().err
