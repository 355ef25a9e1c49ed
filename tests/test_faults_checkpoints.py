"""Nothing lost, nothing silently wrong (issue 15): damaged checkpoints, a full disk, a corpus too big for the disk.

One tiny run (20 steps, a checkpoint every 5) is trained once per module; each case damages the newest
checkpoint of a copy. Resuming falls back to the previous step with one line and ends bit for bit where the
undamaged run ended; evaluators skip the damaged step with one line; the damaged folder is moved aside, never
deleted. A full disk while checkpointing mounts a small tmpfs (root only; skipped otherwise; `small_disk` in
conftest). Writes that fail without a trained run (injected errors, metrics, results, orbax's reads):
test_faults_writes.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import REPO, run_cli

from flatlm import checkpoint as ckpt
from flatlm.errors import UserError

TINY = str(REPO / "configs" / "hmm_mlm.py") + ":tiny"
RUN = ["--quiet", "--config.train.steps=20", "--config.checkpoint.every=5", "--config.checkpoint.keep=10"]


def _train(workdir: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_cli("train", "--config", TINY, "--workdir", str(workdir), *RUN, f"--config.data.data_dir={data}",
                   *extra)


def _params(workdir: Path, step: int = 20) -> list[np.ndarray]:
    from flatlm.run import load_run

    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(load_run(str(workdir)).load_params(step)))]


def _assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(workdir, data dir) of the undamaged run: checkpoints 5, 10, 15, 20."""
    root = tmp_path_factory.mktemp("faults")
    workdir, data = root / "straight", root / "data"
    proc = _train(workdir, data)
    assert proc.returncode == 0, proc.stderr
    assert _steps(workdir) == [5, 10, 15, 20]
    return workdir, data


@pytest.fixture(scope="module")
def straight_params(trained):
    """The undamaged run's final parameters (step 20)."""
    return _params(trained[0])


def _biggest(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_64_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    path.write_bytes(bytes(data))


DAMAGES = {  # name -> what it does to a step folder
    "truncate_data_file": lambda s: _truncate(_biggest(s / "state" / "ocdbt.process_0" / "d")),
    "truncate_ocdbt_manifest": lambda s: _truncate(s / "state" / "manifest.ocdbt"),
    "delete_state_metadata": lambda s: (s / "state" / "_METADATA").unlink(),
    "delete_state": lambda s: shutil.rmtree(s / "state"),
    "truncate_iterator_json": lambda s: _truncate(s / "data" / "process_0-of-1.json"),
    "flip_64_bytes_of_data_file": lambda s: _flip_64_bytes(_biggest(s / "state" / "ocdbt.process_0" / "d")),
}


def _damaged_copy(trained, tmp_path: Path, damage: str, step: int = 20) -> Path:
    workdir = tmp_path / "run"
    shutil.copytree(trained[0], workdir)
    DAMAGES[damage](workdir / "checkpoints" / str(step))
    return workdir


def _assert_moved_aside(workdir: Path, step: int = 20) -> None:
    moved = workdir / "checkpoints_damaged" / str(step)
    assert moved.is_dir() and (moved / "_CHECKPOINT_METADATA").is_file()  # kept as it was, not deleted


DAMAGE_LINE = r"flatlm: checkpoint 20 is damaged \((?P<why>.+)\); moved to (?P<dest>\S+); resuming from step 15"


# Every damage is detected in make test (test_evaluators_skip_a_damaged_checkpoint); resuming past it, two of them.
RESUME_DAMAGES = [d if d in ("truncate_data_file", "delete_state_metadata") else pytest.param(d, marks=pytest.mark.slow)
                  for d in DAMAGES]


@pytest.mark.parametrize("damage", RESUME_DAMAGES)
def test_resume_skips_a_damaged_latest_checkpoint(trained, straight_params, tmp_path, damage):
    workdir = _damaged_copy(trained, tmp_path, damage)
    proc = _train(workdir, trained[1])
    assert proc.returncode == 0, proc.stderr
    lines = _lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    m = re.fullmatch(DAMAGE_LINE, lines[0])
    assert m, lines[0]
    assert m["dest"] == str((workdir / "checkpoints_damaged" / "20").absolute())
    _assert_moved_aside(workdir)
    assert _steps(workdir) == [5, 10, 15, 20]  # 20 written again by the resumed run
    _assert_same(_params(workdir), straight_params)


@pytest.mark.parametrize("damage", DAMAGES)
def test_evaluators_skip_a_damaged_checkpoint(trained, straight_params, tmp_path, damage, capsys):
    from flatlm.run import load_run

    workdir = _damaged_copy(trained, tmp_path, damage)
    run = load_run(str(workdir))
    loaded = dict(run.checkpoint_params(run.steps))
    lines = _lines(capsys.readouterr().err)
    if damage == "truncate_iterator_json":  # the parameters are intact: evaluated, nothing moved
        assert sorted(loaded) == [5, 10, 15, 20] and lines == []
        _assert_same([np.asarray(x) for x in jax.tree.leaves(loaded[20])], straight_params)
        return
    assert sorted(loaded) == [5, 10, 15]
    assert len(lines) == 1 and re.fullmatch(r"flatlm: checkpoint 20 is damaged \(.+\); moved to \S+; skipping it",
                                            lines[0]), lines
    _assert_moved_aside(workdir)
    assert 20 not in run.steps
    with pytest.raises(UserError, match="has no checkpoint 20"):  # asked for by name once it is gone: one line
        run.load_params(20)


def test_load_params_raises_on_a_damaged_checkpoint_and_moves_it(trained, tmp_path):
    workdir = _damaged_copy(trained, tmp_path, "flip_64_bytes_of_data_file")
    from flatlm.run import load_run

    with pytest.raises(ckpt.DamagedCheckpoint, match=r"checkpoint 20 is damaged \(state/.* does not match its chec"):
        load_run(str(workdir)).load_params(20)
    _assert_moved_aside(workdir)
    assert _steps(workdir) == [5, 10, 15]


def test_orbax_errors_on_intact_files_are_not_called_damage(trained, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(trained[0], workdir)
    from flatlm.run import load_run

    run = load_run(str(workdir))
    leaves, tree = jax.tree.flatten(run.abstract_params())
    wrong = jax.ShapeDtypeStruct((leaves[0].shape[0] + 1, *leaves[0].shape[1:]), leaves[0].dtype,
                                 sharding=leaves[0].sharding)
    with pytest.raises(ValueError, match="not compatible with the stored shape"):
        ckpt.restore_params(str(workdir), 20, jax.tree.unflatten(tree, [wrong, *leaves[1:]]))
    assert _steps(workdir) == [5, 10, 15, 20] and not (workdir / "checkpoints_damaged").exists()


def test_checkpoints_without_checksums_resume_and_are_checked_by_orbax(trained, straight_params, tmp_path):
    """Step folders from an older flatlm (or a kill between orbax's commit and the checksums) have no
    flatlm_sha256.json: they still resume, and orbax's own checks catch what they can."""
    workdir = tmp_path / "run"
    shutil.copytree(trained[0], workdir)
    for manifest in (workdir / "checkpoints").glob(f"*/{ckpt.MANIFEST}"):
        manifest.unlink()
    DAMAGES["truncate_data_file"](workdir / "checkpoints" / "20")
    proc = _train(workdir, trained[1])
    assert proc.returncode == 0, proc.stderr
    lines = _lines(proc.stderr)
    assert len(lines) == 1 and re.fullmatch(DAMAGE_LINE, lines[0]), proc.stderr
    assert "ValueError" in lines[0]  # orbax's (tensorstore's) own complaint
    _assert_moved_aside(workdir)
    _assert_same(_params(workdir), straight_params)


@pytest.mark.slow
def test_every_checkpoint_damaged_starts_from_scratch_and_says_so(trained, straight_params, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(trained[0], workdir)
    for step in (5, 10, 15, 20):
        DAMAGES["delete_state_metadata"](workdir / "checkpoints" / str(step))
    proc = _train(workdir, trained[1])
    assert proc.returncode == 0, proc.stderr
    lines = _lines(proc.stderr)
    assert [int(re.match(r"flatlm: checkpoint (\d+) is damaged", x)[1]) for x in lines] == [20, 15, 10, 5]
    assert all(x.endswith("; no earlier checkpoint verifies; starting from step 0") for x in lines), lines
    assert sorted(p.name for p in (workdir / "checkpoints_damaged").iterdir()) == ["10", "15", "20", "5"]
    _assert_same(_params(workdir), straight_params)


# ---- out of disk (more in test_faults_writes.py) ---------------------------------------------------------------


def test_disk_full_while_checkpointing_is_one_line_and_resumes_once_freed(trained, straight_params, small_disk,
                                                                          tmp_path):
    disk = small_disk("2m")  # room for the run's files and two checkpoints of ~0.7 MB
    workdir = disk / "run"
    proc = _train(workdir, trained[1])
    assert proc.returncode == 1, proc.stderr
    lines = _lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    m = re.fullmatch(r"flatlm: no space left on (\S+) while writing checkpoint (\d+); earlier checkpoints are intact",
                     lines[0])
    assert m and m[1] == str(workdir / "checkpoints"), lines[0]
    failed = int(m[2])
    assert not [p for p in (workdir / "checkpoints").iterdir() if "tmp" in p.name]  # the temporary folder is gone
    assert _steps(workdir) == list(range(5, failed, 5))
    subprocess.run(["mount", "-o", "remount,size=20m", str(disk)], check=True)
    proc = _train(workdir, trained[1])
    assert proc.returncode == 0, proc.stderr
    assert _lines(proc.stderr) == []
    copy = tmp_path / "copy"  # read the parameters off the tmpfs so that it unmounts cleanly
    shutil.copytree(workdir, copy)
    _assert_same(_params(copy), straight_params)


# ---- a corpus that cannot fit; a run that diverges before its first checkpoint ---------------------------------


def test_a_corpus_too_big_for_the_disk_is_refused_before_building(trained, tmp_path):
    proc = run_cli("train", "--config", TINY, "--workdir", str(tmp_path / "run"), "--quiet",
                   "--config.data.train_size=100000000000", f"--config.data.data_dir={tmp_path / 'data'}")
    assert proc.returncode == 2
    lines = _lines(proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(r"needs at least [\d,.]+ GB but \S+ has [\d,.]+ [GM]B free; lower data.train_size", lines[0])
    assert not list((tmp_path / "data").rglob("*.array_record*"))


def test_corpus_size_estimate_is_a_lower_bound(trained):
    from flatlm.config import load_config
    from flatlm.data import builder as builder_lib

    config = load_config(TINY)
    c = config.data
    b = builder_lib.build(config.language.to_dict(), str(trained[1]), c.train_size, c.eval_size, config.seed,
                          quiet=True)
    estimate = builder_lib.split_bytes(b)
    for split in ("train", "validation"):
        on_disk = sum(p.stat().st_size for p in Path(b.data_path).glob(f"*-{split}.array_record*"))
        assert 0.5 * on_disk < estimate[split] <= on_disk, (split, estimate[split], on_disk)


def test_non_finite_loss_before_any_checkpoint_says_there_is_none(trained, tmp_path):
    proc = run_cli("train", "--config", TINY, "--workdir", str(tmp_path / "nan"), "--quiet",
                   "--config.train.steps=30", "--config.checkpoint.every=10", "--config.train.lr=1e30",
                   "--config.train.warmup_frac=0.0", "--config.train.eval_every=30",
                   f"--config.data.data_dir={trained[1]}")
    assert proc.returncode == 1
    lines = _lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(r"flatlm: training stopped: non-finite loss at step \d+; no checkpoint yet; lower .*",
                        lines[0]), lines[0]
