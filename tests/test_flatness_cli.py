"""The `flatness` and `grow` verbs (flatlm.cli.flatness / flatlm.cli.grow) end to end on a stand-in for a Run."""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest
from flatness_tiny import fast_compile, init, mlm_batch

from flatlm import results
from flatlm.cli import flatness as flatness_cli
from flatlm.cli import grow as grow_cli
from flatlm.errors import UserError
from flatlm.flatness import compare
from flatlm.models.bert import Bert, BertConfig
from flatlm.table import format_table


@pytest.fixture(autouse=True, scope="module")
def _fast_compile():
    with fast_compile():
        yield


@dataclasses.dataclass
class FakeRun:
    """The part of `flatlm.run.Run` that the flatness and grow verbs use."""

    model: Bert
    params: dict
    steps: tuple = (100, 200)
    config: object = None
    language: object = None
    workdir: str = ""

    def load_params(self, step: int) -> dict:
        return self.params

    def checkpoint_params(self, steps):
        for step in steps:
            yield step, self.params

    def mlm_batches(self, num_batches: int, batch_size: int, seed: int = 0):
        return self.eval_batches(num_batches, batch_size, seed)

    def eval_batches(self, num_batches: int, batch_size: int, seed: int):
        return [mlm_batch(seed + i, batch_size=batch_size, num_words=self.model.cfg.num_words, length=8)
                for i in range(num_batches)]


@pytest.fixture(scope="module")
def run():
    cfg = BertConfig(num_words=7, max_len=8, d_model=16, num_layers=1, num_heads=2, dropout=0.0,
                     attention_dropout=0.0)
    model = Bert(cfg)
    return FakeRun(model=model, params=init(model, 0, scale=4.0))


def _main(argv, run, monkeypatch, capsys):
    run = dataclasses.replace(run, workdir=argv[argv.index("--workdir") + 1])
    for verb in (flatness_cli, grow_cli):
        monkeypatch.setattr(verb, "load_run", lambda workdir: run)
    parser = argparse.ArgumentParser(prog="flatlm")
    sub = parser.add_subparsers(dest="verb", required=True)
    flatness_cli.add_parser(sub)
    grow_cli.add_parser(sub)
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_spectrum_steps_limit_the_spectrum_to_those_checkpoints(run, monkeypatch):
    """`measure_run(spectrum_steps=...)` (an experiment's `flatness.spectrum_at="last"`): every step gets its trace,
    only the steps named get the spectrum."""
    from flatlm.flatness import runner

    monkeypatch.setattr(compare, "spectrum_report", lambda *a, **kw: {"dim": 3, "top": {"values": [1.0]}})
    entries = runner.measure_run(run, [100, 200], "fisher", num_batches=1, batch_size=4, draws=2, spectrum_k=2,
                                 spectrum_steps=[200], append=False, progress=False)
    assert [(e["kind"], e["step"]) for e in entries] == [("flatness", 100), ("flatness", 200), ("spectrum", 200)]


def test_flatness_json_and_table(run, monkeypatch, capsys, tmp_path):
    w = str(tmp_path)  # the verb appends to the workdir's results.json
    calls = []  # the spectrum's numbers are checked against eigh in test_hessian; here what the verb passes and stores

    def fake_spectrum(apply_fn, params, batches, key, *, k, density_probes, density_iters):
        calls.append((apply_fn, params, len(batches), k, density_probes, density_iters))
        return {"dim": 3, "top": {"values": [2.0, 1.0], "residual": [0.0, 0.1], "num_matvecs": k + 5},
                "density": {"nodes": [[1.0]], "weights": [[1.0]], "dim": 3, "moments": [{"p": 1, "value": 3.0}]}}

    monkeypatch.setattr(compare, "spectrum_report", fake_spectrum)
    out = _main(["flatness", "--workdir", w, "--method", "fisher", "--fisher-form", "summed", "--num-draws", "4",
                 "--num-batches", "2", "--batch-size", "4", "--steps", "all", "--groups", "block", "--json",
                 "--spectrum-k", "2", "--density-probes", "2", "--density-iters", "4"], run, monkeypatch, capsys)
    res = json.loads(out)
    spec = res["spectrum"]  # one spectrum per checkpoint, after its trace
    assert [e["step"] for e in spec] == [100, 200] and spec[0]["top"]["num_matvecs"] == 7
    assert [c[2:] for c in calls] == [(2, 2, 2, 4)] * 2 and calls[0][0] == run.model.apply
    assert spec[0]["settings"] == {"spectrum_k": 2, "density_probes": 2, "density_iters": 4, "seed": 0,
                                   "num_batches": 2, "batch_size": 4}
    stored = results.load(w)  # appended to results.json next to the traces (drawn: test_report_estimators)
    assert [e["kind"] for e in stored] == ["flatness", "spectrum", "flatness", "spectrum"]
    assert stored[1]["top"] == spec[0]["top"]
    assert res["method"] == "fisher" and [r["step"] for r in res["results"]] == [100, 200]
    assert res["results"][0]["mean"] > 0 and res["results"][0]["num_batches"] == 2
    per = res["results"][0]["per_group"]  # blocks: embeddings, the layer's attention and MLP, head
    assert list(per) == ["head", "layer_0/attn", "layer_0/mlp", "embed"]
    assert sum(per.values()) == pytest.approx(res["results"][0]["mean"], rel=1e-6)
    table = _main(["flatness", "--workdir", w, "--method", "fisher", "--fisher-form", "summed", "--num-draws", "4",
                   "--num-batches", "2", "--batch-size", "4", "--groups", "block", "--spectrum-k", "2"],
                  run, monkeypatch, capsys)
    assert table.splitlines()[0].split()[:3] == ["step", "method", "mean"] and "200" in table
    assert table.splitlines()[3].split() == ["step", "top_eigenvalues", "tr_slq"] and "2, 1" in table
    gap = json.loads(_main(["flatness", "--workdir", w, "--gap", "--num-probes", "4", "--chunk-size", "4",
                            "--num-draws", "4", "--fisher-form", "summed", "--num-batches", "2", "--batch-size", "4",
                            "--groups", "block", "--json"], run, monkeypatch, capsys))  # gap_report through the CLI
    rep = gap["results"][0]
    assert gap["method"] == "gap" and rep["step"] == 200 and rep["loss"] > 0
    assert {"hessian", "fisher", "empirical_fisher", "hessian_minus_fisher_z", "identity_within_3se"} <= set(rep)
    assert rep["hessian"]["num_batches"] == 2 and rep["fisher"]["method"] == "fisher_summed"
    with pytest.raises(UserError, match="no checkpoint"):
        _main(["flatness", "--workdir", w, "--steps", "5"], run, monkeypatch, capsys)


def test_grow_check_and_out(run, monkeypatch, capsys, tmp_path):
    out = tmp_path / "big.npz"
    res = json.loads(_main(["grow", "--workdir", str(tmp_path), "--d-model", "32", "--num-layers", "2", "--check",
                            "--batch-size", "4", "--num-batches", "1", "--out", str(out), "--json"],
                           run, monkeypatch, capsys))
    assert res["big"]["d_model"] == 32 and res["max_abs_logit_diff"] < 1e-5
    assert res["loss_big"] == pytest.approx(res["loss_small"], abs=1e-5)
    saved = np.load(out)
    assert json.loads(str(saved["__config__"]))["num_layers"] == 2 and saved["layer_1/mlp/wo"].shape == (128, 32)
    with pytest.raises(UserError, match="cannot grow"):
        _main(["grow", "--workdir", str(tmp_path), "--d-model", "24", "--num-layers", "2"], run, monkeypatch, capsys)
    with pytest.raises(UserError, match="--to"):
        _main(["grow", "--workdir", str(tmp_path), "--to", "L3-H7"], run, monkeypatch, capsys)


def test_format_table():
    text = format_table([{"a": 1.23456789, "b": None}, {"a": 2.0, "b": "x"}], ["a", "b"])
    assert text.splitlines() == ["     a  b", "------  -", "1.2346  -", "     2  x"]


def test_the_experiment_counts_only_its_own_trace_at_a_step(run, tmp_path, monkeypatch):
    """`flatness_pending` measures what `measured_by` recognises (settings as `measure_run` records them); a
    Hutchinson trace, other batches or another Fisher form at the same step are other measurements, so neither an
    experiment's resume nor `flatlm reproduce` (which reads the trace through `measured_by`) takes them for its own."""
    from flatlm import experiment  # here: the experiment layer, only for this test
    from flatlm.config import base_config
    from flatlm.flatness.runner import measure_run

    fcfg = experiment.experiment_config("x", base_config(), [("a", [])],
                                        flatness=dict(enabled=True, num_batches=1, batch_size=4, draws=3)).flatness
    calls = []
    monkeypatch.setattr(experiment, "flatness_run", lambda workdir, **kw: calls.append(kw))
    monkeypatch.setattr(experiment, "_final_shape_steps", lambda run_dir: [100, 200])
    quiet = dict(append=False, progress=False)
    others = (measure_run(run, [100], "hutchinson", num_probes=2, num_batches=1, batch_size=4, **quiet)
              + measure_run(run, [100], "fisher", num_batches=2, batch_size=4, draws=3, **quiet)
              + measure_run(run, [100], "fisher", num_batches=1, batch_size=4, draws=3, fisher_form="summed", **quiet))
    results.append(str(tmp_path), others)
    experiment.flatness_pending(tmp_path, fcfg, progress=False)
    assert calls[-1]["steps"] == [100, 200] and not any(experiment.measured_by(e, fcfg) for e in others)
    own = measure_run(run, **{**calls[-1], **quiet})
    assert [e["step"] for e in own] == [100, 200] and all(experiment.measured_by(e, fcfg) for e in own)
    results.append(str(tmp_path), own[:1])
    experiment.flatness_pending(tmp_path, fcfg, progress=False)
    assert calls[-1]["steps"] == [200]
    assert not experiment.measured_by({**own[0], "settings": {**own[0]["settings"], "split": "train"}}, fcfg)
    assert not experiment.measured_by({**own[0], "grown_to": [2, 32]}, fcfg)
    assert experiment.measured_by({k: v for k, v in own[0].items() if k != "settings"}, fcfg)  # older entries
