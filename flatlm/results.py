"""`results.json` in a workdir: every evaluation appends entries; earlier results are never overwritten.

Format: {"results": [entry, ...]}, each entry {"kind", "step", "time", ...}: kind is "exact_loss", "probe",
"finetune", "lookup_table", "flatness", ... The file is rewritten atomically (tmp + rename).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from flatlm.errors import disk_full_is_one_line


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        return _clean(x.item())
    if hasattr(x, "tolist"):
        return _clean(x.tolist())
    return x


def load(workdir: str) -> list[dict]:
    """Every entry of the workdir's results.json ([] if there is none)."""
    path = Path(workdir, "results.json")
    return json.loads(path.read_text())["results"] if path.exists() else []


def append(workdir: str, entries: list[dict]) -> None:
    """Add entries (stamped with the time) to the workdir's results.json, atomically."""
    path = Path(workdir, "results.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    old = load(workdir)
    now = time.time()
    new = old + [_clean({"time": now, **e}) for e in entries]
    tmp = path.with_name(f".results.json.{os.getpid()}.tmp")
    try:
        with disk_full_is_one_line(f"no space left on {path.parent} while writing results.json; "
                                   "its earlier results are intact"):
            tmp.write_text(json.dumps({"results": new}, indent=1))
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def latest(entries: list[dict], **match) -> dict | None:
    """The most recent entry whose fields equal `match`."""
    hits = [e for e in entries if all(e.get(k) == v for k, v in match.items())]
    return hits[-1] if hits else None
