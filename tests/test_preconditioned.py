"""`flatlm flatness --preconditioned` on a trained AdamW run against a dense reference: the top eigenvalue of
P^-1/2 H P^-1/2 by numpy from `jax.hessian` and the Adam state of a full (not partial) checkpoint restore."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, run_cli

TINY = str(REPO / "configs" / "hmm_mlm.py") + ":tiny"
SMALL = ["--config.model.d_model=8", "--config.train.steps=20", "--config.checkpoint.every=20",
         "--config.train.eval_every=20", "--config.model.dropout=0.0", "--config.model.attention_dropout=0.0"]


@pytest.mark.slow  # make test: test_spectrum's P^-1 H against eigh
def test_preconditioned_sharpness_of_an_adamw_run_is_the_dense_top_eigenvalue(tmp_path):
    from jax.flatten_util import ravel_pytree

    from flatlm import checkpoint as ckpt
    from flatlm import results
    from flatlm.flatness.preconditioned import adam_state
    from flatlm.models.losses import mlm_loss
    from flatlm.run import load_run
    from flatlm.train import loop, optim

    wd = tmp_path / "adamw"
    data = "--config.data.data_dir=" + str(tmp_path / "data")
    assert run_cli("train", "--config", TINY, "--workdir", str(wd), "--quiet", data, *SMALL).returncode == 0
    proc = run_cli("flatness", "--workdir", str(wd), "--preconditioned", "--num-batches", "2", "--batch-size",
                   "16", "--num-probes", "2", "--num-draws", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)["preconditioned_sharpness"][0]

    run = load_run(str(wd))
    train = run.config.train
    mngr = ckpt.manager(str(wd), read_only=True)
    state = ckpt.restore(mngr, 20, loop.train_setup(run).abstract_state())  # the whole state, not restore_parts
    mngr.close()
    adam = adam_state(state["opt_state"])
    assert int(adam.count) == 20
    flat, unravel = ravel_pytree(jax.device_get(state["params"]))
    nu_hat = ravel_pytree(jax.device_get(adam.nu))[0] / (1.0 - train.b2 ** 20)
    d = 1.0 / np.sqrt(np.sqrt(np.asarray(nu_hat, np.float64)) + train.eps)
    batches = run.mlm_batches(2, 16, seed=0)  # what the verb measures on (its default seed)
    loss = lambda x: sum(mlm_loss(unravel(x), b, run.apply_fn) for b in batches) / len(batches)  # noqa: E731
    hess = np.asarray(jax.jit(jax.hessian(loss))(jnp.asarray(flat)), np.float64)
    top = np.linalg.eigvalsh(d[:, None] * (hess + hess.T) / 2 * d[None, :])[-1]

    assert got["value"] == pytest.approx(top, rel=2e-3, abs=abs(got["residual"]) + 1e-6)
    lr = float(optim.schedule(train)(19))  # the rate of the 20th (last) update
    assert got["lr"] == pytest.approx(lr) and lr > 0
    assert got["edge_of_stability"] == pytest.approx(2 * (1 + train.b1) / ((1 - train.b1) * lr))
    assert got["ratio"] == pytest.approx(got["value"] / got["edge_of_stability"])
    assert got["adam_count"] == 20 and got["b2"] == pytest.approx(train.b2)
    entries = [e for e in results.load(str(wd)) if e["kind"] == "preconditioned_sharpness"]
    assert [e["step"] for e in entries] == [20] and entries[0]["value"] == got["value"]


def test_preconditioned_sharpness_refuses_an_sgd_run_in_one_line(tmp_path):
    wd = tmp_path / "sgd"
    data = "--config.data.data_dir=" + str(tmp_path / "data")
    assert run_cli("train", "--config", TINY, "--workdir", str(wd), "--quiet", data, *SMALL,
                   "--config.train.optimizer=sgd").returncode == 0
    before = (wd / "results.json").read_text() if (wd / "results.json").exists() else None
    proc = run_cli("flatness", "--workdir", str(wd), "--preconditioned", "--num-batches", "1", "--batch-size", "8")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "AdamW" in proc.stderr and "sgd" in proc.stderr, proc.stderr
    after = (wd / "results.json").read_text() if (wd / "results.json").exists() else None
    assert after == before  # nothing half-written


def test_train_batches_are_what_training_reads(tmp_path, tiny_config):
    """`Run.train_batches` (what `flatlm flatness --split train` measures on) equals the training iterator's first
    batches at that batch size, with and without data.fixed_masks."""
    from flatlm.data import pipeline
    from flatlm.run import build_run

    for fixed in (False, True):
        c = tiny_config.copy_and_resolve_references()
        c.data.fixed_masks = fixed
        run = build_run(c, str(tmp_path / f"fixed{fixed}"), quiet=True)
        got = run.train_batches(2, 16)
        data = c.data.copy_and_resolve_references()
        data.batch_size = 16
        it = pipeline.train_iterator(data, run.num_words, c.seed, source=run.sources["train"])
        for b in got:
            want = next(it)
            assert sorted(b) == sorted(want)
            for k in want:
                np.testing.assert_array_equal(b[k], want[k])
