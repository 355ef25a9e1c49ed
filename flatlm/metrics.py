"""Metric sinks: `metrics.jsonl` (one JSON object per line) and TensorBoard event files in the workdir."""

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


class MetricWriter:
    """Writes only on process 0; `write(step, {name: scalar})`."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        Path(workdir).mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        # unbuffered: a row that does not fit on the disk is cut off again (`write`), never left half-written
        self._jsonl = open(Path(workdir, "metrics.jsonl"), "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._tb = SummaryWriter(str(Path(workdir, "tensorboard")))

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
