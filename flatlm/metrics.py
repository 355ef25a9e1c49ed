"""Metric sinks: `metrics.jsonl` (one JSON object per line) and TensorBoard event files in the workdir.

A run resumed from its checkpoint at step S logs the steps after S again, so opening the writer with
`resume_step=S` first drops the rows with step > S (the lost segment; also a half-written last line) from
metrics.jsonl, atomically, and tells TensorBoard to purge the events from step S + 1 on: one row per step and
kind of row, however often the run was interrupted.

In a bucket (gs://) nothing can be appended to an object: each row rewrites metrics.jsonl whole (the rows are kept
in memory; a run logs a few thousand rows at most), and TensorBoard's event files are written to a local temporary
folder and uploaded to `<workdir>/tensorboard` at most once a minute and on `close`.

`log_results` puts the per-checkpoint measurements of results.json (probe, fine-tuning and lookup-table accuracy
per task, each flatness estimator's trace) into TensorBoard too, under `<workdir>/tensorboard/results`, at the
checkpoint's step; `flatlm.results.append` calls it for every entry it writes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
import uuid

import numpy as np

from flatlm import paths
from flatlm.errors import DiskFull, disk_full_is_one_line

UPLOAD_EVERY_S = 60.0  # a cloud workdir's TensorBoard events are uploaded at most this often (and on close)


def _summary_writer(*args, **kwargs):
    """tensorboardX's SummaryWriter, imported on first use and without torch: where torch is installed,
    tensorboardX's writer imports it (~1 s of every CLI start-up) only to recognise torch tensors, and flatlm
    writes Python floats. torch stays importable afterwards (only this import is kept from seeing it)."""
    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX is imported
        try:
            import tensorboardX  # noqa: F401 - reason: see the docstring (imported for its side effect)
        finally:
            del sys.modules["torch"]
    from tensorboardX import SummaryWriter as writer_class  # reason: see the docstring

    return writer_class(*args, **kwargs)


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
    path = paths.path(workdir, "metrics.jsonl")
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    keep = [line for line in lines if _at_or_before(line, step)]
    if len(keep) == len(lines):
        return
    paths.write_text(path, "".join(line + "\n" for line in keep))


class MetricWriter:
    """Writes only on process 0; `write(step, {name: scalar})`.

    `resume_step`: the step training starts after (its checkpoint's, 0 for a fresh run): later rows left by an
    interrupted run are dropped, as they will be written again. None appends to whatever is there.
    """

    def __init__(self, workdir: str, enabled: bool = True, resume_step: int | None = None):
        self.enabled = enabled
        if not enabled:
            return
        paths.path(workdir).mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            truncate_metrics(workdir, resume_step)
        self.workdir = workdir
        self._cloud = paths.is_cloud(workdir)
        purge = None if resume_step is None else resume_step + 1
        if self._cloud:  # no appends, no local event files: see the module docstring
            self._rows = paths.read_text(paths.path(workdir, "metrics.jsonl")) or ""
            self._tb_local = tempfile.TemporaryDirectory(prefix="flatlm-tensorboard-")
            self._uploaded = time.monotonic()
            tb_dir = self._tb_local.name
        else:
            # unbuffered: a row that does not fit on the disk is cut off again (`write`), never left half-written
            self._jsonl = open(paths.path(workdir, "metrics.jsonl"), "ab", buffering=0)  # noqa: SIM115 - close()
            tb_dir = os.fspath(paths.path(workdir, "tensorboard"))
        self._tb = _summary_writer(tb_dir, purge_step=purge)

    def write(self, step: int, metrics: dict) -> None:
        """Append one row {step, time, metrics...} to metrics.jsonl and the scalars to TensorBoard."""
        if not self.enabled:
            return
        row = {"step": int(step), "time": time.time(), **{k: _scalar(v) for k, v in metrics.items()}}
        if self._cloud:
            self._rows += json.dumps(row) + "\n"
            paths.write_text(paths.path(self.workdir, "metrics.jsonl"), self._rows)
            self._scalars(row, step)
            if time.monotonic() - self._uploaded > UPLOAD_EVERY_S:
                self._upload()
            return
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
        self._scalars(row, step)

    def _scalars(self, row: dict, step: int) -> None:
        for k, v in row.items():
            if k not in ("step", "time") and isinstance(v, float):
                self._tb.add_scalar(k, v, step)

    def _upload(self) -> None:
        self._tb.flush()
        paths.upload(self._tb_local.name, paths.path(self.workdir, "tensorboard"))
        self._uploaded = time.monotonic()

    def close(self) -> None:
        """Flush and close both sinks (a cloud workdir's TensorBoard events are uploaded a last time)."""
        if not self.enabled:
            return
        self._tb.close()
        if self._cloud:
            self._upload()
            self._tb_local.cleanup()
        else:
            self._jsonl.close()


def read_metrics(workdir: str) -> list[dict]:
    """Every row of the workdir's metrics.jsonl, in order ([] if none)."""
    path = paths.path(workdir, "metrics.jsonl")
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def result_scalars(entry: dict) -> dict[str, float]:
    """TensorBoard tags and values of one results.json entry: `probe/<task>/accuracy` (and `finetune/`,
    `lookup_table/`), `flatness/<method>[_grown<L>x<d>]/trace`, `spectrum[_grown..]/eigenvalue_<i>` and
    `spectrum[_grown..]/trace_H_p<p>` (Tr(H^p)); {} for other kinds or entries without a step."""
    kind, task = entry.get("kind"), entry.get("task")
    if not isinstance(entry.get("step"), int):
        return {}
    if kind in ("probe", "finetune", "lookup_table") and task and isinstance(entry.get("accuracy"), float):
        return {f"{kind}/{task}/accuracy": entry["accuracy"]}
    grown = entry.get("grown_to")
    suffix = f"_grown{grown[0]}x{grown[1]}" if grown else ""
    if kind == "flatness" and isinstance(entry.get("trace"), float):
        return {f"flatness/{entry.get('method', 'unknown')}{suffix}/trace": entry["trace"]}
    if kind == "spectrum":  # the Hessian's top eigenvalues (Lanczos) and the density's moments Tr(H^p) (SLQ)
        top = (entry.get("top") or {}).get("values") or []
        out = {f"spectrum{suffix}/eigenvalue_{i + 1}": float(v) for i, v in enumerate(top)}
        for m in (entry.get("density") or {}).get("moments") or []:
            out[f"spectrum{suffix}/trace_H_p{m['p']}"] = float(m["value"])
        return out
    return {}


def log_results(workdir: str, entries: list[dict]) -> None:
    """Write the entries' `result_scalars` as TensorBoard scalars at their steps, into
    `<workdir>/tensorboard/results` (a new event file per call; TensorBoard reads them all)."""
    rows = [(e["step"], tag, v) for e in entries for tag, v in result_scalars(e).items()]
    if not rows:
        return
    with paths.local_copy_dir(paths.path(workdir, "tensorboard", "results")) as folder:
        writer = _summary_writer(folder, filename_suffix=f".{os.getpid()}.{uuid.uuid4().hex[:8]}")  # event files
        # are named by the second and host: two calls in one second would write the same file
        for step, tag, v in rows:
            writer.add_scalar(tag, v, step)
        writer.close()
