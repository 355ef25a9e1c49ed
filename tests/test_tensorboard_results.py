"""TensorBoard gets the per-checkpoint results too (issue 16, item 10): probe / fine-tuning accuracy per task and
each flatness estimator's trace and the Hessian spectrum's top eigenvalues and moments, at the checkpoint's step, read
back from the event files."""

from __future__ import annotations

import struct

from tensorboardX.proto import event_pb2

from flatlm import results


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} from every TFRecord event file under `folder` (length, crc, data, crc records)."""
    out: dict[str, list] = {}
    for path in sorted(folder.rglob("events.out.tfevents*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_results_are_logged_to_tensorboard(tmp_path):
    results.append(str(tmp_path), [
        {"kind": "probe", "step": 10, "task": "A", "accuracy": 0.625},
        {"kind": "finetune", "step": 10, "task": "A", "accuracy": 0.75},
        {"kind": "flatness", "step": 10, "method": "fisher", "grown_to": None, "trace": 12.5},
        {"kind": "exact_loss", "step": 10, "loss": 1.5}])  # already in metrics.jsonl's eval/ scalars: not again
    results.append(str(tmp_path), [{"kind": "flatness", "step": 20, "method": "hutchinson", "grown_to": (4, 256),
                                    "trace": 3.25}, {"kind": "probe", "step": 20, "task": "A", "accuracy": 0.875},
                                   {"kind": "finetune_init", "step": None, "task": "A", "accuracy": 0.5},  # no step
                                   {"kind": "spectrum", "step": 20, "grown_to": None, "settings": {},
                                    "top": {"values": [9.5, 4.25], "residual": [0.0, 0.1]},
                                    "density": {"moments": [{"p": 1, "value": 12.5, "stderr": 1.0},
                                                            {"p": 2, "value": 70.0, "stderr": 2.0}]}}])
    # one event file per append, named with a random suffix: their order on disk is arbitrary, so sort by step
    got = {tag: sorted(points) for tag, points in read_scalars(tmp_path / "tensorboard" / "results").items()}
    assert got == {"probe/A/accuracy": [(10, 0.625), (20, 0.875)], "finetune/A/accuracy": [(10, 0.75)],
                   "flatness/fisher/trace": [(10, 12.5)], "flatness/hutchinson_grown4x256/trace": [(20, 3.25)],
                   "spectrum/eigenvalue_1": [(20, 9.5)], "spectrum/eigenvalue_2": [(20, 4.25)],
                   "spectrum/trace_H_p1": [(20, 12.5)], "spectrum/trace_H_p2": [(20, 70.0)]}


def test_metric_writer_does_not_import_torch(tmp_path):
    """The TensorBoard writer opens without importing torch (tensorboardX's writer would, where torch is
    installed: ~1 s of every start-up), its scalars still land, and torch stays importable afterwards."""
    import importlib.util
    import subprocess
    import sys

    code = ("import sys; from flatlm.metrics import MetricWriter; w = MetricWriter(sys.argv[1]); "
            "w.write(1, {'train/loss': 0.5}); w.close(); print('torch' in sys.modules); "
            "import importlib.util; print(importlib.util.find_spec('torch') is not None)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", str(importlib.util.find_spec("torch") is not None)]
    assert read_scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 0.5)]
