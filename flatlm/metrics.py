"""Metric sinks: `metrics.jsonl` (one JSON object per line) and TensorBoard event files in the workdir.

A run resumed from its checkpoint at step S logs the steps after S again, so opening the writer with
`resume_step=S` first drops the rows with step > S (the lost segment; also a half-written last line) from
metrics.jsonl, atomically, and tells TensorBoard to purge the events from step S + 1 on: one row per step and
kind of row, however often the run was interrupted.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np
from tensorboardX import SummaryWriter

from flatlm.errors import DiskFull, disk_full_is_one_line


def _scalar(v):
    v = float(np.asarray(v))
    return v if math.isfinite(v) else str(v)


def _at_or_before(line: str, step: int) -> bool:
    try:
        return int(json.loads(line)["step"]) <= step
    except (ValueError, KeyError, TypeError):  # a line cut short by a kill
        return False


def truncate_metrics(workdir: str, step: int) -> None:
    """Drop the rows of metrics.jsonl with a step after `step` (and unreadable lines), atomically."""
    path = Path(workdir, "metrics.jsonl")
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    keep = [line for line in lines if _at_or_before(line, step)]
    if len(keep) == len(lines):
        return
    tmp = path.with_name(f".metrics.jsonl.{os.getpid()}.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


class MetricWriter:
    """Writes only on process 0; `write(step, {name: scalar})`.

    `resume_step`: the step training starts after (its checkpoint's, 0 for a fresh run): later rows left by an
    interrupted run are dropped, as they will be written again. None appends to whatever is there.
    """

    def __init__(self, workdir: str, enabled: bool = True, resume_step: int | None = None):
        self.enabled = enabled
        if not enabled:
            return
        Path(workdir).mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            truncate_metrics(workdir, resume_step)
        self.workdir = workdir
        # unbuffered: a row that does not fit on the disk is cut off again (`write`), never left half-written
        self._jsonl = open(Path(workdir, "metrics.jsonl"), "ab", buffering=0)  # noqa: SIM115 - closed in close()
        purge = None if resume_step is None else resume_step + 1
        self._tb = SummaryWriter(str(Path(workdir, "tensorboard")), purge_step=purge)

    def write(self, step: int, metrics: dict) -> None:
        """Append one row {step, time, metrics...} to metrics.jsonl and the scalars to TensorBoard."""
        if not self.enabled:
            return
        row = {"step": int(step), "time": time.time(), **{k: _scalar(v) for k, v in metrics.items()}}
        data, size = (json.dumps(row) + "\n").encode(), os.fstat(self._jsonl.fileno()).st_size
        try:
            with disk_full_is_one_line(f"no space left on {self.workdir} while writing the metrics of step "
                                       f"{step}; checkpoints are intact"):
                written = 0
                while written < len(data):
                    written += self._jsonl.write(data[written:])
        except DiskFull:
            os.ftruncate(self._jsonl.fileno(), size)
            raise
        for k, v in row.items():
            if k not in ("step", "time") and isinstance(v, float):
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        """Flush and close both sinks."""
        if self.enabled:
            self._jsonl.close()
            self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
    """Every row of the workdir's metrics.jsonl, in order ([] if none)."""
    path = Path(workdir, "metrics.jsonl")
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
