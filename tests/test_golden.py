"""Golden numbers after one step of the tiny config (as nanodo pins its metrics), so that a refactor cannot
silently change what flatlm computes. The values were recorded on the code before the run-layer
restructuring (issue "One house"); a deliberate numerical change must update them in its own commit and say why.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from flatlm.run import load_run
from flatlm.train.loop import train_and_evaluate

# recorded with jax 0.10 on CPU (float32 training, float64 sums here). Updated for issue 20 (multi-host): masks
# depend on a sentence's position in the (per-epoch reshuffled) global stream, so that N processes see the same
# global batch as one. Updated again for issue 17 (input pipeline): batches are gathered from the corpus's arrays
# (generation order, permuted per epoch by numpy) and masked by `RowHash` instead of an rng per sentence, which
# changes which sentences form a batch and which words are masked; the semantics above are unchanged.
GOLDEN = {
    "train/loss": 3.0004377365112305,
    "train/grad_norm": 2.6360557079315186,
    "eval/loss": 2.9257722294330595,
    "eval/kl": 1.143687874674797,
    "param_sum": 248.57441140467546,
    "param_abs_sum": 1147.9991908952682,
    "param_sq_sum": 278.57722381018795,
}


def test_one_step_of_the_tiny_config_is_golden(tiny_config, tmp_path):
    c = tiny_config
    c.train.update(steps=1, log_every=1, eval_every=1)
    c.checkpoint.every = 1
    out = train_and_evaluate(c, str(tmp_path), progress=False)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = next(m for m in lines if "train/loss" in m)
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(load_run(str(tmp_path)).load_params(1))]
    got = {
        "train/loss": train["train/loss"], "train/grad_norm": train["train/grad_norm"],
        "eval/loss": out["eval/loss"], "eval/kl": out["eval/kl"],
        "param_sum": sum(float(x.sum()) for x in leaves),
        "param_abs_sum": sum(float(np.abs(x).sum()) for x in leaves),
        "param_sq_sum": sum(float((x * x).sum()) for x in leaves),
    }
    for key, want in GOLDEN.items():
        assert got[key] == pytest.approx(want, rel=2e-5, abs=1e-6), key
