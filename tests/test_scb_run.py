"""The SCB language through flatlm's machinery: the tfds corpus (stored conditionals = the language's, recomputed in
float64), the "position" downstream task (labels inside the last word's attention pattern, at Q's frequencies), config
validation, and a tiny MLM run through the public API (exact entropy = the corpus's, KL falls)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REPO

from flatlm.config import apply_overrides, load_config
from flatlm.data import builder, tasks
from flatlm.errors import UserError
from flatlm.languages import make_language, validate_config

TINY = str(REPO / "configs" / "scb_mlm.py") + ":tiny"
SPEC = dict(name="scb", seed=3, vocab_size=5, context_length=4, sparsity=2, concentration=0.5)


def test_builder_stores_the_languages_exact_conditionals(tmp_path):
    b = builder.build(SPEC, str(tmp_path), train_size=100, eval_size=30, seed=0, quiet=True)
    lang = make_language(SPEC)
    val = builder.data_sources(b)["validation"]
    items = val.__getitems__(list(range(len(val))))
    tokens = np.stack([it["tokens"] for it in items])
    lengths = np.array([it["length"] for it in items])
    assert tokens.shape == (30, 5) and (lengths == 5).all() and len(builder.data_sources(b)["train"]) == 100
    q = np.stack([it["conditionals"] for it in items])
    np.testing.assert_allclose(q, lang.conditionals(tokens, lengths), atol=1e-6)
    # the last position's conditional is the next-word distribution sum_s Q_{x_T}[s] P[:, x_s]
    np.testing.assert_allclose(q[:, -1], lang.next_word(tokens), atol=1e-6)


def test_position_task_labels_are_the_attended_positions():
    lang = make_language(SPEC)
    n = 20_000
    d = tasks.sample_task(lang, "scb", "position", n, seed=1)
    assert tasks.num_classes(lang, "scb", "position") == 4 and d["tokens"].shape == (n, 5)
    last = d["tokens"][:, 3]
    assert (lang.patterns[last, d["label"]] > 0).all()  # s is in the support of Q_{x_T}
    for k in range(lang.vocab_size):  # and drawn with Q_{x_T}'s weights (binomial 5 sigma)
        rows = last == k
        freq = np.bincount(d["label"][rows], minlength=4) / rows.sum()
        assert np.abs(freq - lang.patterns[k]).max() < 5 * 0.5 / np.sqrt(rows.sum())
    with pytest.raises(UserError, match="position"):
        tasks.check_task(lang, "scb", "k3")


def test_scb_config_validation():
    c = load_config(TINY)
    validate_config(c.language)
    for override, match in (("sparsity=9", "sparsity"), ("concentration=0.0", "concentration")):
        with pytest.raises(UserError, match=match):
            validate_config(apply_overrides(load_config(TINY), [f"--config.language.{override}"]).language)
    hmm = load_config(str(REPO / "configs" / "hmm_mlm.py") + ":tiny")
    hmm.language.name = "scb"
    with pytest.raises(UserError, match="context_length"):
        validate_config(hmm.language)


def test_tiny_scb_run_trains_against_the_exact_loss(tmp_path):
    from flatlm.evaluate.runner import run_exact_loss
    from flatlm.run import build_run
    from flatlm.train.loop import init_state, train_and_evaluate, train_setup

    config = apply_overrides(load_config(TINY), ["--config.train.steps=30", "--config.train.eval_every=30",
                                                 "--config.checkpoint.every=30"])
    run = build_run(config, str(tmp_path), quiet=True)
    before = run_exact_loss(run, init_state(run, train_setup(run))["params"])
    batches = list(run.eval_batches())
    q = np.concatenate([b["conditionals"] for b in batches]).astype(np.float64)
    entropy = -np.sum(np.where(q > 0, q * np.log(np.where(q > 0, q, 1)), 0)) / (q.shape[0] * q.shape[1])
    after = {k.removeprefix("eval/"): v for k, v in train_and_evaluate(config, str(tmp_path), progress=False).items()}
    assert before["entropy"] == pytest.approx(entropy, abs=1e-6) and after["entropy"] == before["entropy"]
    assert after["kl"] < before["kl"], (before, after)  # 30 steps of a tiny model: it learns (no margin claimed)
    assert after["loss"] == pytest.approx(after["entropy"] + after["kl"], abs=1e-9)
    assert run.task_names() == ("position",) and run.num_classes("position") == config.language.context_length
