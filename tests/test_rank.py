"""Rank of W - W0 (flatlm.train.rank): known answers, and its logging during training (train.rank_every)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO, run_cli

from flatlm.train import rank


def test_a_rank_one_update_has_rank_one_and_its_singular_value():
    rng = np.random.default_rng(0)
    w0 = {"layer_0": {"mlp": {"wi": rng.normal(size=(8, 32)), "bi": rng.normal(size=32)},
                      "attn": {"qkv": rng.normal(size=(8, 3, 2, 4)), "out": rng.normal(size=(2, 4, 8))}}}
    u, v = rng.normal(size=8), rng.normal(size=32)
    uq, vq = rng.normal(size=8), rng.normal(size=24)
    w = {"layer_0": {"mlp": {"wi": w0["layer_0"]["mlp"]["wi"] + np.outer(u, v), "bi": w0["layer_0"]["mlp"]["bi"] + 1},
                     "attn": {"qkv": w0["layer_0"]["attn"]["qkv"] + np.outer(uq, vq).reshape(8, 3, 2, 4),
                              "out": w0["layer_0"]["attn"]["out"]}}}
    got = rank.update_ranks(w, w0)
    assert got["rank/layer_0/mlp/wi"] == 1 and got["sv0/layer_0/mlp/wi"] == pytest.approx(
        np.linalg.norm(u) * np.linalg.norm(v))
    assert got["rank/layer_0/attn/qkv"] == 1  # read as [D, 3 H Dh]: one outer product
    assert got["rank/layer_0/attn/out"] == 0 and "rank/layer_0/mlp/bi" not in got  # unchanged; vectors skipped
    w["layer_0"]["mlp"]["wi"] = w0["layer_0"]["mlp"]["wi"] + np.outer(u, v) + np.outer(v[:8], u.repeat(4))
    assert rank.update_ranks(w, w0)["rank/layer_0/mlp/wi"] == 2


@pytest.mark.slow
def test_training_logs_the_rank_of_what_it_learned(tmp_path):
    out = run_cli("train", "--config", f"{REPO}/configs/hmm_mlm.py:tiny", "--workdir", str(tmp_path), "--quiet",
                  "--config.train.steps=10", "--config.train.rank_every=5", "--config.train.eval_every=10",
                  "--config.checkpoint.every=10")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ranked = {r["step"]: r for r in rows if any(k.startswith("rank/") for k in r)}
    assert sorted(ranked) == [5, 10]
    qkv = "rank/layer_0/attn/qkv"
    assert 1 <= ranked[5][qkv] <= 64 and ranked[10]["sv0/layer_0/attn/qkv"] > ranked[5]["sv0/layer_0/attn/qkv"]


def test_the_report_draws_rank_vs_steps(tmp_path):
    """`flatlm report` on a run with rank rows in metrics.jsonl gets the rank panel (png and pdf)."""
    from flatlm.config import base_config
    from flatlm.report import make_report

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(base_config().to_json_best_effort())
    rows = [{"step": s, "eval/loss": 2.0, "eval/kl": 0.1, "eval/entropy": 1.9} for s in (5, 10)]
    rows += [{"step": s, "rank/layer_0/mlp/wi": r, "sv0/layer_0/mlp/wi": 0.1 * s} for s, r in ((5, 1.0), (10, 3.0))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = make_report([str(run)], str(tmp_path / "report"))
    assert "Rank of W - W0" in out.read_text()
    assert (tmp_path / "report" / "rank_vs_steps.png").exists() and (tmp_path / "report" / "rank_vs_steps.pdf").exists()
