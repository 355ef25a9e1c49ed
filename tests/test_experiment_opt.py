"""The OPT experiments (Figures 1b, 2c, 5b): `,opt` presets with GLUE downstream tasks from local files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO, run_cli

from flatlm.config import load_config
from flatlm.errors import UserError
from flatlm.experiment import load_experiment, run_config
from flatlm.languages import make_language
from flatlm.languages.opt.hf import save_hf_checkpoint
from flatlm.languages.opt.model import OPTConfig, random_params


def _glue_fixture(root, words: list[str]) -> None:
    """SST-2 whose label is the first word (words[0] positive, words[1] negative) and a small QNLI, GLUE format."""
    rng = np.random.default_rng(0)
    filler = words[2:] + ["zebra"]  # "zebra" is out of the vocabulary: dropped
    for split, n in (("train", 80), ("dev", 40)):
        rows = ["sentence\tlabel"]
        for _ in range(n):
            label = int(rng.integers(2))
            rows.append(" ".join([words[1 - label], *rng.choice(filler, size=rng.integers(1, 5))]) + f"\t{label}")
        (root / "SST-2").mkdir(exist_ok=True)
        (root / "SST-2" / f"{split}.tsv").write_text("\n".join(rows) + "\n")
        q = ["index\tquestion\tsentence\tlabel"] + [
            f"{i}\t{words[2]} {words[3]}\t{words[i % 4]} {words[4]}\t{('entailment', 'not_entailment')[i % 2]}"
            for i in range(n)]
        (root / "QNLI").mkdir(exist_ok=True)
        (root / "QNLI" / f"{split}.tsv").write_text("\n".join(q) + "\n")


def test_opt_presets_select_the_glue_tasks_and_reject_the_tables():
    for name in ("fig1_after_convergence", "fig2_model_sizes", "fig5_grown_sizes"):
        exp = load_experiment(f"{REPO}/configs/experiments/{name}.py:tiny,opt")
        assert {run_config(exp, r).language.name for r in exp.runs} == {"opt"}
    for name in ("table1", "table2", "fig3_sgd"):
        with pytest.raises(UserError, match="use hmm or pcfg"):
            load_experiment(f"{REPO}/configs/experiments/{name}.py:tiny,opt")


def test_glue_task_feeds_the_probe_splits_in_the_k_words(tmp_path):
    """`Run.load_task` for OPT: GLUE files -> {train, validation} in the language's K words, sizes honoured."""
    import types

    import ml_collections

    from flatlm.data import tasks

    token_ids = np.array([11, 12, 13, 14, 15, 16])
    words = [f"w{i}" for i in range(6)]
    (tmp_path / "vocab.json").write_text(json.dumps({w: int(t) for w, t in zip(words, token_ids, strict=True)}))
    _glue_fixture(tmp_path, words)
    language = types.SimpleNamespace(token_ids=token_ids, max_length=5)
    down = ml_collections.ConfigDict(dict(tasks=("sst2",), glue_dir=str(tmp_path), tokenizer="", oov_word=-1,
                                          source="tsv"))
    with pytest.raises(UserError, match="tokenizer is empty"):
        tasks.glue_task(language, "sst2", down, str(tmp_path))
    down.tokenizer = str(tmp_path / "vocab.json")
    out = tasks.glue_task(language, "sst2", down, str(tmp_path), train_size=50, eval_size=0)
    assert out["train"]["tokens"].shape == (50, 5) and len(out["validation"]["label"]) == 40
    first = out["train"]["tokens"][:, 0]
    np.testing.assert_array_equal(first == 0, out["train"]["label"] == 1)  # w0 starts the positive sentences
    assert out["train"]["tokens"].max() <= 6  # words 0..5 or pad (= K); "zebra" was dropped
    down.glue_dir = ""
    with pytest.raises(UserError, match="glue_dir is empty"):
        tasks.glue_task(language, "sst2", down, str(tmp_path))


@pytest.mark.slow
def test_opt_experiment_runs_end_to_end_on_local_glue(tmp_path):
    """fig1 at tiny,opt from a small local OPT checkpoint (HF layout, written here): MLM training, exact loss, then
    SST-2 probes through the GLUE adapter (a JSON vocabulary as tokenizer); nothing is downloaded."""
    cfg = OPTConfig.named("tiny")
    save_hf_checkpoint(str(tmp_path / "opt"), cfg, random_params(cfg, seed=5, std=0.3))
    spec = load_config(f"{REPO}/configs/opt_mlm.py:tiny").language
    spec.update(checkpoint=str(tmp_path / "opt"), opt_shape="")
    language = make_language(spec)
    words = [f"w{i}" for i in range(len(language.token_ids))]
    vocab = {w: int(t) for w, t in zip(words, language.token_ids, strict=True)}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    glue_dir = tmp_path / "glue"
    glue_dir.mkdir()
    _glue_fixture(glue_dir, words)
    work = tmp_path / "exp"
    out = run_cli("experiment", "--config", f"{REPO}/configs/experiments/fig1_after_convergence.py:tiny,opt",
                  "--workdir", str(work), "--quiet", f"--config.base.eval.downstream.glue_dir={glue_dir}",
                  f"--config.base.language.checkpoint={tmp_path / 'opt'}", "--config.base.language.opt_shape=",
                  f"--config.base.eval.downstream.tokenizer={tmp_path / 'vocab.json'}",
                  "--config.base.eval.downstream.source=tsv", "--config.base.eval.tasks=('sst2',)")
    assert out.returncode == 0, out.stderr[-2000:]
    entries = json.loads((work / "runs" / "adamw" / "results.json").read_text())["results"]
    probes = [e for e in entries if e["kind"] == "probe" and e["task"] == "sst2"]
    losses = [e for e in entries if e["kind"] == "exact_loss"]
    assert probes and losses and all(np.isfinite(e["kl"]) for e in losses)
    assert any(e["kind"] == "lookup_table" for e in entries) and any(e["kind"] == "flatness" for e in entries)
    # the label is the first word: a probe on the trained model's features separates it on held-out sentences
    assert max(p["accuracy"] for p in probes) >= 0.8
