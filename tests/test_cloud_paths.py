"""A workdir in a bucket (issue 16, item 1): every file the library writes goes through `flatlm.paths` (etils
epath), tested against a fake gs:// (fsspec's in-memory file system registered as `gcs`, tests/fake_gcs.py); a
gs:// workdir without gcsfs is one line naming `pip install 'flatlm[gcs]'` and nothing written anywhere."""

from __future__ import annotations

import hashlib
import json
import logging
import os

import fake_gcs
import pytest
from etils import epath

from flatlm import checkpoint, locks, metrics, paths, results
from flatlm.cli.main import main
from flatlm.config import load_workdir_config, save_workdir_config
from flatlm.errors import UserError

ROOT = "gs://bucket/run"


@pytest.fixture
def fake_gcs_bucket():
    fake_gcs.install()
    yield fake_gcs.FakeGCS.store
    fake_gcs.uninstall()


@pytest.fixture
def no_gcsfs(monkeypatch):
    """gs:// with neither gcsfs nor TensorFlow installed (the state of a fresh `pip install flatlm`)."""
    fake_gcs.uninstall()
    real = paths.importlib.util.find_spec
    monkeypatch.setattr(paths.importlib.util, "find_spec", lambda name, *a: None if name == "tensorflow"
                        else real(name, *a))
    try:
        import gcsfs  # noqa: F401 - present only if the gcs extra is installed
        pytest.skip("gcsfs is installed here")
    except ImportError:
        pass


def _keys(store) -> set[str]:
    return {k.removeprefix("/bucket/run/") for k in store if k.startswith("/bucket/run/")}


def test_gs_workdir_without_gcsfs_is_one_line_and_writes_nothing(no_gcsfs, tmp_path, monkeypatch, capsys,
                                                                   tiny_config):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"pip install 'flatlm\[gcs\]'"):
        paths.path(ROOT)
    from conftest import REPO
    code = main(["train", "--config", str(REPO / "configs" / "hmm_mlm.py") + ":tiny", "--workdir", ROOT])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"flatlm: error: {ROOT} is on gs://, which needs packages that are not installed: "
                   "pip install 'flatlm[gcs]'"]
    assert list(tmp_path.iterdir()) == []  # was: ./gs:/bucket/run/config.json, then a traceback


def test_unknown_scheme_is_one_line():
    with pytest.raises(UserError, match="not ftp://"):
        paths.path("ftp://host/run")


def test_config_round_trip_and_refusal_in_bucket(fake_gcs_bucket, tiny_config):
    save_workdir_config(tiny_config, ROOT)
    assert _keys(fake_gcs_bucket) == {"config.json"}  # no temporary object left behind
    assert load_workdir_config(ROOT).model.to_dict() == tiny_config.model.to_dict()
    tiny_config.model.d_model = 2 * tiny_config.model.d_model
    with pytest.raises(UserError, match="different config"):
        save_workdir_config(tiny_config, ROOT)


def test_results_append_replace_in_bucket(fake_gcs_bucket):
    results.append(ROOT, [{"kind": "probe", "step": 1, "task": "A", "accuracy": 0.5}])
    results.append(ROOT, [{"kind": "probe", "step": 1, "task": "A", "accuracy": 0.75},
                          {"kind": "probe", "step": 2, "task": "A", "accuracy": 0.9}])
    got = results.load(ROOT)
    assert [(e["step"], e["accuracy"]) for e in got] == [(1, 0.75), (2, 0.9)]
    keys = _keys(fake_gcs_bucket)  # no lock file, no temporary file in the bucket; TensorBoard events uploaded
    assert {k for k in keys if not k.startswith("tensorboard/results/events.out.tfevents")} == {"results.json"}
    assert len(keys) == 3  # one event file per append


def test_metrics_rewrite_and_resume_truncation_in_bucket(fake_gcs_bucket):
    w = metrics.MetricWriter(ROOT, resume_step=0)
    for step in (10, 20, 30):
        w.write(step, {"train/loss": step / 10})
    w.close()
    assert [r["train/loss"] for r in metrics.read_metrics(ROOT)] == [1.0, 2.0, 3.0]
    events = [k for k in _keys(fake_gcs_bucket) if k.startswith("tensorboard/")]
    assert len(events) == 1 and events[0].startswith("tensorboard/events.out.tfevents")
    w = metrics.MetricWriter(ROOT, resume_step=20)  # resumed from step 20: step 30 is dropped, then logged again
    w.write(30, {"train/loss": 3.5})
    w.close()
    assert [(r["step"], r["train/loss"]) for r in metrics.read_metrics(ROOT)] == [(10, 1.0), (20, 2.0), (30, 3.5)]


def test_checkpoint_checksums_in_bucket(fake_gcs_bucket):
    step = epath.Path(ROOT, "checkpoints", "5")
    (step / "state").mkdir(parents=True, exist_ok=True)
    blobs = {"state/a.bin": b"\x00\x01" * 100, "_CHECKPOINT_METADATA": b"{}"}
    for rel, data in blobs.items():
        (step / rel).write_bytes(data)
    checkpoint.write_manifest(step)
    manifest = json.loads((step / checkpoint.MANIFEST).read_text())["files"]
    assert manifest == {rel: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for rel, d in blobs.items()}
    assert checkpoint.check_files(step) == (None, True)
    (step / "state/a.bin").write_bytes(b"\x00\x02" * 100)
    assert checkpoint.check_files(step) == ("state/a.bin does not match its checksum", True)
    assert os.fspath(checkpoint.paths.local_path(paths.path(ROOT, "checkpoints"))) == ROOT + "/checkpoints"


def test_workdir_lock_in_bucket_warns_once(fake_gcs_bucket, caplog):
    with caplog.at_level(logging.WARNING, logger="flatlm"):
        with locks.exclusive(ROOT, "training"), locks.exclusive(ROOT, "training"):
            pass
    warned = [r.getMessage() for r in caplog.records if "no file locks" in r.getMessage()]
    assert len(warned) == 1 and ROOT in warned[0]
    assert _keys(fake_gcs_bucket) == set()  # no lock object


def test_local_write_text_is_atomic(tmp_path):
    target = tmp_path / "x.json"
    paths.write_text(target, "one")
    paths.write_text(target, "two", fsync=True)
    assert target.read_text() == "two" and sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_probe_feature_cache_of_a_cloud_workdir_is_local(tmp_path):
    from flatlm.evaluate.runner import feature_cache_dir

    assert feature_cache_dir(str(tmp_path)) == str(tmp_path / "features")
    a, b = feature_cache_dir(ROOT), feature_cache_dir("gs://bucket/other")
    assert a != b and "://" not in a and a.startswith(os.path.expanduser("~"))
