"""`flatlm grow` (issue 16, item 11): without --out it writes a new run workdir (orbax checkpoint) and says where;
`flatlm evaluate` reads that run and finds the small model's exact loss; .npz stays an option; the help texts name
presets, overrides and each target shape once."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO

from flatlm.cli.main import build_parser, main
from flatlm.run import load_run

TINY_BERT = [str(REPO / "configs" / "hmm_mlm.py") + ":tiny", "--config.model.kind=bert", "--config.train.steps=4",
             "--config.checkpoint.every=4", "--config.train.eval_every=4", "--config.model.d_model=16",
             "--config.model.num_heads=2"]


@pytest.mark.slow  # 20 s on 2 shared cores: a tiny training, growing, two evaluations
def test_grow_writes_a_run_that_evaluate_reads(tmp_path, capsys):
    wd = tmp_path / "small"
    assert main(["train", "--config", *TINY_BERT[:1], "--workdir", str(wd), "--quiet", *TINY_BERT[1:]]) == 0
    capsys.readouterr()
    assert main(["grow", "--workdir", str(wd), "--num-layers", "2", "--d-model", "32", "--json"]) == 0
    out = capsys.readouterr()
    grown = wd / "grown" / "L2-H32-step4"
    assert json.loads(out.out)["out"] == str(grown)
    assert out.err.strip().splitlines()[-1] == (f"grow: wrote the grown run to {grown} (checkpoint 4); evaluate it "
                                                f"with flatlm evaluate --workdir {grown}")
    big = load_run(str(grown))
    assert (big.model.cfg.num_layers, big.model.cfg.d_model) == (2, 32) and big.steps == [4]
    small = load_run(str(wd))
    (batch,) = small.mlm_batches(1, 16, seed=0)
    logits_small = small.model.apply({"params": small.load_params(4)}, batch["tokens"])
    logits_big = big.model.apply({"params": big.load_params(4)}, batch["tokens"])
    np.testing.assert_allclose(np.asarray(logits_big), np.asarray(logits_small), atol=2e-4)
    losses = []
    for w in (wd, grown):
        assert main(["evaluate", "--workdir", str(w), "--steps", "4", "--no-probe", "--no-finetune", "--no-lookup",
                     "--json", "--quiet"]) == 0
        losses.append(json.loads(capsys.readouterr().out)["rows"][0]["loss"])
    assert losses[1] == pytest.approx(losses[0], abs=1e-4)
    # .npz on request; a second run into the same folder is refused
    assert main(["grow", "--workdir", str(wd), "--num-layers", "2", "--d-model", "32",
                 "--out", str(tmp_path / "g.npz")]) == 0
    assert json.loads(str(np.load(tmp_path / "g.npz")["__config__"]))["d_model"] == 32
    capsys.readouterr()
    assert main(["grow", "--workdir", str(wd), "--num-layers", "2", "--d-model", "32"]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_help_texts_name_presets_overrides_and_each_shape_once():
    sub = next(a for a in build_parser()._actions if a.dest == "verb").choices
    train_help = sub["train"].format_help()
    assert "preset" in train_help and "--config.section.field=value" in train_help
    grow_help = " ".join(sub["grow"].format_help().split())
    shapes = grow_help.split("Table 3 or 4: ")[1].split(" --d-model")[0].split(", ")
    assert len(shapes) == len(set(shapes)) and "L8-H512" in shapes and "L20-H1920" in shapes  # Tables 3 and 4
