"""`flatlm evaluate`: every checkpoint gets exact loss, probe and fine-tune results; results.json only grows."""

from __future__ import annotations

import json

import jax
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


def _main(capsys, *argv) -> tuple[int, list[str]]:
    """`flatlm ARGV` in this process (the command line's own error handling, without an interpreter's start-up):
    exit code and stderr lines."""
    from flatlm.cli.main import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


def test_bad_steps_and_workdirs_are_user_errors(tmp_path, trained, capsys):
    with pytest.raises(UserError, match="no checkpoint at step"):
        parse_steps("7", [10, 20])
    with pytest.raises(UserError, match="not all, last, none"):
        parse_steps("ten", [10, 20])
    assert parse_steps("none", [10, 20]) == [] and parse_steps("none", []) == []
    code, err = _main(capsys, "evaluate", "--workdir", tmp_path / "nothing")
    assert code == 2 and len(err) == 1 and "not a flatlm run" in err[0], err
    code, err = _main(capsys, "evaluate", "--workdir", trained, "--task", "k99")
    assert code == 2 and len(err) == 1 and "task-1 .. task-8" in err[0], err


@pytest.mark.slow  # make test: test_finetune's grid and from-init
def test_eval_overrides_choose_the_rate_and_fine_tune_the_initialisation(trained):
    """A new fine-tuning protocol on a trained run: the rate chosen on validation and the "no pre-training"
    control, whose input must be exactly the weights training started from (rebuilt here by the train loop's
    own `init_state`, then fine-tuned in this process as the reference)."""
    stored = (trained / "config.json").read_text()
    proc = run_cli("evaluate", "--workdir", str(trained), "--steps", "20", "--no-probe", "--no-lookup", "--quiet",
                   "--json", "--config.eval.finetune.lr_grid=[1e-3,1e-2]", "--config.eval.finetune.from_init=true")
    assert proc.returncode == 0, proc.stderr
    assert (trained / "config.json").read_text() == stored  # how it was evaluated lives in the entries
    out = json.loads(proc.stdout)
    kinds = {(e["kind"], e["step"]) for e in out["entries"]}
    assert kinds == {("exact_loss", 20), ("finetune", 20), ("finetune_init", None)}
    assert any(r["step"] == "init" and "finetune:k3" in r for r in out["rows"])
    saved = {e["kind"]: e for e in results.load(str(trained)) if e["kind"] in ("finetune", "finetune_init")
             and e["detail"]["config"].get("lr_grid")}
    assert set(saved) == {"finetune", "finetune_init"}
    for e in saved.values():
        assert e["detail"]["lr"] in (1e-3, 1e-2) and e["detail"]["lr_selection"]["grid"] == [1e-3, 1e-2]

    from flatlm.evaluate.finetune import FinetuneConfig, finetune  # reason: the reference, in this process
    from flatlm.train.loop import init_state, train_setup

    run = load_run(str(trained))
    start = init_state(run, train_setup(run))["params"]
    jax.tree.map(np.testing.assert_array_equal, run.init_params(), start)
    task = run.load_task("k3", quiet=True)
    c = run.config
    ref = finetune(run.apply_fn, start, {s: v["tokens"] for s, v in task.items()},
                   {s: v["label"] for s, v in task.items()},
                   FinetuneConfig(**{**c.eval.finetune, "lr_grid": (1e-3, 1e-2), "from_init": True}, seed=c.seed),
                   num_classes=run.num_classes("k3"), num_words=run.num_words, max_len=run.language.max_length + 1,
                   progress=False)
    assert saved["finetune_init"]["detail"]["accuracy"] == ref["accuracy"]
    # another checkpoint under the same protocol: the control is already measured, so it is not redone
    again = run_cli("evaluate", "--workdir", str(trained), "--steps", "10", "--no-probe", "--no-lookup", "--quiet",
                    "--no-exact", "--json", "--config.eval.finetune.lr_grid=[1e-3,1e-2]",
                    "--config.eval.finetune.from_init=true")
    assert again.returncode == 0, again.stderr
    assert {(e["kind"], e["step"]) for e in json.loads(again.stdout)["entries"]} == {("finetune", 10)}


def test_evaluate_refuses_overrides_outside_the_eval_section(trained, capsys):
    n = len(results.load(str(trained)))
    for bad, message in (("--config.model.d_model=8", "eval section only"),
                         ("--config.eval.finetune.lr_grid=[0.001,-1.0]", "positive learning rates"),
                         ("--config.eval.finetune.lr_grd=[0.001]", "did you mean 'lr_grid'"),
                         ("--config.eval.probe.layers=[0]", "must name layers 1..1"),
                         ("--frobnicate", "unrecognised argument")):
        code, err = _main(capsys, "evaluate", "--workdir", trained, "--steps", "last", bad)
        assert code == 2 and len(err) == 1 and message in err[0], (bad, err)
    assert len(results.load(str(trained))) == n  # nothing measured, nothing written


def test_evaluate_an_experiment_dir_evaluates_every_run_in_its_order(trained, tmp_path, capsys):
    """--workdir of an experiment: each run (experiment.json's order, not the folder's) is evaluated into its own
    results.json; two copies of one run give identical numbers. A bad override stops before any run is touched."""
    import shutil

    exp = tmp_path / "exp"
    for name in ("a", "b"):
        shutil.copytree(trained, exp / "runs" / name, ignore=shutil.ignore_patterns(".lock", "features"))
    (exp / "experiment.json").write_text(json.dumps({"name": "toy", "runs": [{"name": "b"}, {"name": "a"}]}))
    before = {n: len(results.load(str(exp / "runs" / n))) for n in ("a", "b")}
    code, err = _main(capsys, "evaluate", "--workdir", exp, "--steps", "last", "--config.train.steps=5")
    assert code == 2 and len(err) == 1 and "eval section only" in err[0], err
    assert {n: len(results.load(str(exp / "runs" / n))) for n in ("a", "b")} == before
    proc = run_cli("evaluate", "--workdir", str(exp), "--steps", "last", "--no-probe", "--no-finetune",
                   "--no-lookup", "--quiet", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert list(out["runs"]) == ["b", "a"]
    losses = [[e for e in out["runs"][n]["entries"] if e["kind"] == "exact_loss"] for n in ("b", "a")]
    assert [len(x) for x in losses] == [1, 1] and losses[0][0]["step"] == 20
    assert losses[0][0]["loss"] == losses[1][0]["loss"] and losses[0][0]["kl"] == losses[1][0]["kl"]
    for n in ("a", "b"):
        saved = results.load(str(exp / "runs" / n))
        assert saved[-1]["kind"] == "exact_loss" and saved[-1]["loss"] == losses[0][0]["loss"]
    text = run_cli("evaluate", "--workdir", str(exp), "--steps", "last", "--no-probe", "--no-finetune",
                   "--no-lookup", "--quiet")
    assert text.returncode == 0 and text.stdout.index("== b") < text.stdout.index("== a"), text.stdout


def test_probe_layers_add_layer_probe_entries_and_refuse_a_layer_the_model_lacks(trained):
    """eval.probe.layers as an evaluate override: one "layer_probe" entry per layer beside (not instead of) the
    paper's probe. tiny's BiLSTM has one layer, so layer 1 is the last: same features, same seeds, so its accuracy
    is the probe's exactly (features cached apart, under their layer). A layer beyond the model: one line."""
    from flatlm import run as run_lib
    from flatlm.config import load_workdir_config
    from flatlm.evaluate.runner import evaluate_run, table_rows, with_eval_overrides

    entries = evaluate_run(str(trained), [20], probe=True, finetune_=False, lookup=False, exact=False,
                           progress=False, overrides=("--config.eval.probe.layers=[1]",))
    assert [(e["kind"], e.get("layer")) for e in entries] == [("probe", None), ("layer_probe", 1)]
    probe, layer = entries
    assert layer["detail"]["layer"] == 1 and layer["step"] == 20 and layer["task"] == "k3"
    assert layer["detail"]["accuracy"] == probe["detail"]["accuracy"]
    assert list((trained / "features").glob("features-step20-layer1-*.npz"))
    assert table_rows(entries)[0]["probe-layer1:k3"] == table_rows(entries)[0]["probe:k3"]
    with pytest.raises(UserError, match=r"layers=\(2,\) must name layers 1..1"):
        run_lib.validate(with_eval_overrides(load_workdir_config(str(trained)), ["--config.eval.probe.layers=[2]"]))


def test_steps_none_adds_only_the_lookup_tables(trained, capsys):
    """`--steps none` with eval.lookup_words: the lookup table's and the words-added table's entries per task and
    nothing else, the latter's probe on the conditionals with the one-hot words appended (twice the features),
    cached apart. (An earlier test's lookup table entry is replaced by the new one: results.append.)"""
    import time

    t0 = time.time()
    code, err = _main(capsys, "evaluate", "--workdir", trained, "--steps", "none", "--quiet",
                      "--config.eval.lookup_words=true")
    assert code == 0, err
    new = [e for e in results.load(str(trained)) if e["time"] >= t0]
    assert [(e["kind"], e["step"], e["task"]) for e in new] == [("lookup_table", None, "k3"),
                                                                 ("lookup_words", None, "k3")]
    assert new[1]["detail"]["feature_dim"] == 2 * new[0]["detail"]["feature_dim"] == 2 * 8 * 20  # T x V, twice
    assert list((trained / "features").glob("features-steplookup_words-*.npz"))


def test_lookup_words_is_asked_for_like_the_lookup_table(trained):
    """`evaluate_run(lookup_words=False)` (what an experiment's resume passes once the entry exists) overrides the
    config's eval.lookup_words, as `lookup=False` does the table's; None leaves it to the config."""
    from flatlm.evaluate.runner import evaluate_run

    on = ("--config.eval.lookup_words=true",)
    kinds = lambda **kw: [e["kind"] for e in evaluate_run(str(trained), [], probe=True, exact=False, progress=False,  # noqa: E731
                                                           finetune_=False, **kw)]
    assert kinds(lookup=False, lookup_words=False, overrides=on) == []
    assert kinds(lookup=False, overrides=on) == ["lookup_words"]
    assert kinds(lookup=True, lookup_words=False, overrides=on) == ["lookup_table"]
    assert kinds(lookup=False) == []  # the config's default: off
