"""Nothing half-written when a write fails (issue 15), without a trained run: a checkpoint save that runs out of
disk (injected), a failed save's straggling write, metrics and results on a full tmpfs (root only; skipped
otherwise), and a failed restore's sibling reads. The trained-run cases: test_faults_checkpoints.py.
"""

from __future__ import annotations

import errno
import sys
import time
from pathlib import Path

import pytest

from flatlm import checkpoint as ckpt
from flatlm.errors import DiskFull

_FAILING_READS = """
import asyncio


async def read(i):
    raise ValueError(f"OUT_OF_RANGE: read {i}")


def restore():
    loop = asyncio.new_event_loop()
    tasks = [loop.create_task(read(i)) for i in range(3)]
    loop.run_until_complete(asyncio.wait(tasks))
    loop.close()
    tasks[0].result()  # the first error propagates; its siblings' are never retrieved


def restore_gathered():
    async def main():
        groups = [asyncio.gather(read(i)) for i in range(3)]
        await asyncio.wait(groups)
        groups[0].result()  # as above, for gather futures (their repr names no file, only the exception)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
"""


@pytest.mark.parametrize("how", ["tasks", "gathered"])
@pytest.mark.parametrize("package", ["orbax", "other"])
def test_a_failed_read_leaves_no_asyncio_traceback_of_orbax_tasks(package, how, tmp_path, caplog, monkeypatch):
    """A failed restore: the sibling reads' unretrieved task (or gather future) exceptions (asyncio logs them whenever
    they are collected, seen in CI as a second traceback beside the one-line damage report) are dropped for orbax's,
    kept for anyone else's."""
    import gc
    import importlib

    folder = tmp_path / package
    folder.mkdir()
    (folder / "reads.py").write_text(_FAILING_READS)
    monkeypatch.syspath_prepend(str(folder))
    reads = importlib.import_module("reads")
    try:
        with caplog.at_level("ERROR", logger="asyncio"), pytest.raises(ValueError, match="read 0"):
            with ckpt._quiet_if_abandoned():
                reads.restore() if how == "tasks" else reads.restore_gathered()
        gc.collect()
        logged = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
    finally:
        del reads, sys.modules["reads"]
    assert len(logged) == (0 if package == "orbax" else 2), logged



def test_disk_full_injected_while_saving(tmp_path, monkeypatch):
    import jax.numpy as jnp

    mngr = ckpt.manager(str(tmp_path), keep=3)
    ckpt.save(mngr, 1, {"x": jnp.arange(3.0)})
    folder = tmp_path / "checkpoints"

    def full(step, args, force):
        (folder / f"{step}.orbax-checkpoint-tmp").mkdir()
        raise ValueError("RESOURCE_EXHAUSTED: Error writing ...: No space left on device [os_error_code='28']")

    monkeypatch.setattr(mngr, "save", full)
    with pytest.raises(DiskFull, match=r"no space left on .* while writing checkpoint 2; earlier checkpoints are"):
        ckpt.save(mngr, 2, {"x": jnp.arange(3.0)})
    assert sorted(p.name for p in folder.iterdir()) == ["1"]
    assert (folder / "1" / ckpt.MANIFEST).exists()


def test_a_write_that_lands_after_the_cleanup_is_removed_too(tmp_path, monkeypatch):
    """A failed save's straggling write (orbax runs some in asyncio's executor threads, which no join reaches)
    recreates the temporary folder just after it is first removed: it is removed again."""
    import threading

    import jax.numpy as jnp

    mngr = ckpt.manager(str(tmp_path), keep=3)
    ckpt.save(mngr, 1, {"x": jnp.arange(3.0)})
    folder = tmp_path / "checkpoints"
    tmp = folder / "2.orbax-checkpoint-tmp"
    recreated = threading.Event()

    def straggler():
        while tmp.exists():
            time.sleep(0.001)
        (tmp / "state").mkdir(parents=True)
        (tmp / "state" / "late").write_bytes(b"x")
        recreated.set()

    def full(step, args, force):
        (tmp / "state").mkdir(parents=True)
        threading.Thread(target=straggler, daemon=True).start()
        raise ValueError("RESOURCE_EXHAUSTED: Error writing ...: No space left on device [os_error_code='28']")

    monkeypatch.setattr(mngr, "save", full)
    with pytest.raises(DiskFull, match=r"while writing checkpoint 2; earlier checkpoints are intact"):
        ckpt.save(mngr, 2, {"x": jnp.arange(3.0)})
    assert recreated.wait(timeout=10)  # the straggler did write after the first removal
    assert sorted(p.name for p in folder.iterdir()) == ["1"]


def _fill(disk: Path) -> Path:
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def test_disk_full_while_writing_metrics_and_results(small_disk):
    from flatlm import results
    from flatlm.metrics import MetricWriter, read_metrics

    disk = small_disk("1m")
    writer = MetricWriter(str(disk))
    writer.write(1, {"loss": 1.0})
    results.append(str(disk), [{"kind": "probe", "step": 1}])
    filler = _fill(disk)
    with pytest.raises(DiskFull, match=r"no space left on .* while writing the metrics of step 2"):
        writer.write(2, {f"metric_{i}": 0.5 for i in range(1000)})  # bigger than what is left
    with pytest.raises(DiskFull, match=r"no space left on .* while writing results.json"):
        results.append(str(disk), [{"kind": "probe", "step": 2, "padding": "x" * 8192}])
    filler.unlink()
    writer.close()
    assert [r["step"] for r in read_metrics(str(disk))] == [1]  # no half-written row
    assert [e["step"] for e in results.load(str(disk))] == [1]
    assert sorted(p.name for p in disk.iterdir() if not p.name.startswith(".")) == ["metrics.jsonl", "results.json",
                                                                                  "tensorboard"]  # + lock files
