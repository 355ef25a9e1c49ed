"""Config loading, overrides and validation: every listed bad input exits 2 with one line."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, run_cli

from flatlm import cli
from flatlm.config import apply_overrides, load_config
from flatlm.errors import UserError
from flatlm.train.loop import validate

TINY = str(REPO / "configs" / "hmm_mlm.py") + ":tiny"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--config", str(REPO / "configs" / "hmm_mlm.py") + ":huge"], "unknown preset 'huge'"),
        (["--config", TINY, "--config.data.batch_size=63", "--config.mesh.data=1"], None),  # valid on 1 device
        (["--config", TINY, "--config.train.optimizer=adam"], "train.optimizer='adam'"),
        (["--config", TINY, "--config.train.steps=0"], "train.steps must be positive"),
        (["--config", TINY, "--config.train.steps=-5"], "train.steps must be positive"),
        (["--config", TINY, "--config.mesh.data=16"], "needs 16 devices"),
        (["--config", TINY, "--config.train.stepz=3"], "did you mean 'steps'"),
        (["--config", TINY, "--config.train.lr=fast"], "expects float"),
        (["--config", "configs/nope.py"], "not found"),
        (["--config", TINY, "--bogus"], "unrecognised argument '--bogus'"),
        (["--config", TINY, "--config.checkpoint.log_factor=1.0"], "checkpoint.log_factor must be > 1"),
        (["--config", TINY, "--config.checkpoint.convergence_tol=1.5"], "checkpoint.convergence_tol is a relative"),
        (["--config", TINY, "--config.checkpoint.convergence_max_kl=-0.1"], "checkpoint.convergence_max_kl is in"),
        (["--config", TINY, "--config.checkpoint.convergence_patience=0"], "convergence_patience must be positive"),
        (["--config", TINY, "--config.train.microbatches=0"], "train.microbatches=0 must be >= 1"),
        (["--config", TINY, "--config.train.microbatches=5"], "train.microbatches=5 must be >= 1 and divide"),
        (["--config", TINY, "--config.train.microbatches=2", "--config.train.flat.method=sam"],
         "not with train.flat.method=sam"),
        (["--config", TINY, "--config.train.microbatches=2", "--config.train.adversarial.lam=0.5"],
         "not with train.adversarial"),
    ],
)
def test_bad_inputs_exit_2_with_one_line(args, needle, tmp_path, capsys):
    if needle is None:  # the valid control: validation passes (we only validate, not train)
        config = apply_overrides(load_config(args[1]), args[2:])
        validate(config, num_devices=1)
        return
    code = cli.main(["train", *args, "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("flatlm: error:") and needle in err, err
    assert not (tmp_path / "w" / "checkpoints").exists()


def test_batch_not_divisible_by_data_axis():
    config = load_config(TINY)
    config.data.batch_size = 63
    config.mesh.data = 2
    with pytest.raises(UserError, match="not divisible by the data axis"):
        validate(config, num_devices=8)


def test_microbatches_must_split_each_data_shard():
    config = load_config(TINY)  # batch 64
    config.train.microbatches = 4
    validate(config, num_devices=8)  # 8 rows a device: 4 slices of 2
    config.train.microbatches = 16  # divides 64, but not a device's 8 rows
    with pytest.raises(UserError, match="must divide each data shard's rows"):
        validate(config, num_devices=8)


def test_bad_input_in_a_fresh_process_has_no_traceback(tmp_path):
    proc = run_cli("train", "--config", TINY, "--workdir", str(tmp_path), "--config.train.optimizer=lion")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("flatlm: error: config.train.optimizer")


def test_overrides_are_typed():
    config = apply_overrides(load_config(TINY), ["--config.train.lr=1", "--config.model.ln_mode=post",
                                                 "--config.checkpoint.steps=[5, 10]",
                                                 "--config.model.gelu_approximate=false"])
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)
    assert config.model.ln_mode == "post"
    assert config.checkpoint.steps == (5, 10)
    assert config.model.gelu_approximate is False


def test_workdir_refuses_a_different_config(tmp_path):
    from flatlm.config import save_workdir_config

    config = load_config(TINY)
    save_workdir_config(config, str(tmp_path))
    save_workdir_config(load_config(TINY), str(tmp_path))  # same config: fine
    config.train.lr = 0.5
    with pytest.raises(UserError, match="different config.*train.lr"):
        save_workdir_config(config, str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["train"]["lr"] != 0.5


def test_a_run_stored_before_a_field_existed_resumes_with_its_default(tmp_path):
    """config.json written by an older flatlm (no `train.stacking` section) matches today's config when the new
    field is at its default, and still refuses it at another value."""
    from flatlm.config import save_workdir_config

    save_workdir_config(load_config(TINY), str(tmp_path))
    stored = json.loads((tmp_path / "config.json").read_text())
    del stored["train"]["stacking"]
    (tmp_path / "config.json").write_text(json.dumps(stored))
    save_workdir_config(load_config(TINY), str(tmp_path))  # the default: the same run
    changed = load_config(TINY)
    changed.train.stacking.rule = "top"
    with pytest.raises(UserError, match="train.stacking.rule"):
        save_workdir_config(changed, str(tmp_path))


def test_a_stream_run_stored_before_stream_block_resumes_only_with_its_block_of_8(tmp_path):
    """A stream run written before `data.stream_block` sampled blocks of 8: resuming it with today's default (512)
    would change its data, so it is refused; with 8 it resumes, and `load_workdir_config` reads 8. A tfds run
    without the field resumes with the default (the field does not touch its data)."""
    from flatlm.config import load_workdir_config, save_workdir_config

    for source, refused in (("stream", True), ("tfds", False)):
        config = load_config(TINY)
        config.data.source = source
        save_workdir_config(config, str(tmp_path / source))
        stored = json.loads((tmp_path / source / "config.json").read_text())
        del stored["data"]["stream_block"]
        (tmp_path / source / "config.json").write_text(json.dumps(stored))
        if refused:
            with pytest.raises(UserError, match="data.stream_block"):
                save_workdir_config(config, str(tmp_path / source))
            config.data.stream_block = 8
            assert load_workdir_config(str(tmp_path / source)).data.stream_block == 8
        save_workdir_config(config, str(tmp_path / source))
