"""`results.json` in a workdir: every evaluation appends entries, one entry per measurement.

Format: {"results": [entry, ...]}, each entry {"kind", "step", "time", ...}: kind is "exact_loss", "probe",
"finetune", "lookup_table", "flatness", ...

One entry per identity (`identity`): the kind, the step and the settings that tell two measurements apart (task,
the probed layer, method, grown_to; of the `detail`: the estimator's method, num_batches and num_samples, the probe
or fine-tuning config and the frozen layers). `append` replaces an earlier entry with the same identity (a
measurement redone, e.g. by a resumed experiment) by the new one at the end, instead of adding a duplicate;
entries of other identities are never touched. `append` is atomic and safe across processes: the whole
read-modify-write runs under the lock file `<workdir>/.results.lock` and the file is rewritten as a tmp file
renamed over it, so concurrent writers lose nothing and a reader never sees half a file.

In a bucket (gs://) the file is rewritten in one upload (a reader still never sees half a file) but there is no
lock (`flatlm.locks`): two processes appending at the same moment can lose one's entries, so run one writer per
cloud workdir (the workdir lock's rule, which a bucket cannot enforce).
"""

from __future__ import annotations

import json
import math
import time

import jax

from flatlm import locks, metrics, paths
from flatlm.errors import UserError, disk_full_is_one_line

# What a flatness / spectrum / preconditioned-sharpness entry was measured on (its settings' "split"; absent:
# "validation", masked validation sentences; "train": the training objective, see `flatlm flatness --split`)
SPLITS = ("validation", "train")


def split_of(entry: dict) -> str:
    """The split a flatness / spectrum / sharpness entry was measured on (entries written before splits: validation)."""
    return (entry.get("settings") or {}).get("split", "validation")

IDENTITY = ("kind", "step", "task", "layer", "method", "grown_to", "settings")  # settings: how it was measured
DETAIL_IDENTITY = ("method", "num_batches", "num_samples", "config", "frozen")  # estimator / probe settings


def _clean(x):
    """`x` as JSON-able values; a non-finite float as its string ("nan", "inf", "-inf": JSON has no NaN)."""
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


_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _restore(x):
    """`_clean`'s strings for non-finite floats back as floats, so every reader sees numbers (a one-probe trace's
    NaN stderr formats as "nan" instead of failing a report)."""
    if isinstance(x, str):
        return _NON_FINITE.get(x, x)
    if isinstance(x, dict):
        return {k: _restore(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_restore(v) for v in x]
    return x


def load(workdir: str) -> list[dict]:
    """Every entry of the workdir's results.json ([] if there is none); one line if the file is damaged."""
    path = paths.path(workdir, "results.json")
    if not path.exists():
        return []
    try:
        return _restore(json.loads(path.read_text())["results"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path} is damaged ({type(e).__name__}: {e}); restore it from a copy, or move it aside "
                        "to start a fresh one (its results are then lost)") from None


def identity(entry: dict) -> str:
    """What makes an entry a distinct measurement (see the module docstring), as a canonical JSON string."""
    e = _clean(entry)
    key = {k: e[k] for k in IDENTITY if k in e}
    if isinstance(e.get("detail"), dict):
        key["detail"] = {k: e["detail"][k] for k in DETAIL_IDENTITY if k in e["detail"]}
    return json.dumps(key, sort_keys=True)


def append(workdir: str, entries: list[dict]) -> None:
    """Add entries (stamped with the time) to the workdir's results.json, atomically and under its lock; an
    earlier entry with the same `identity` as a new one is replaced (dropped, the new one goes at the end).
    In a multi-host run only process 0 writes (every process measured the same entries)."""
    if jax.process_index() != 0:
        return
    path = paths.path(workdir, "results.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    new = {identity(e): e for e in (_clean({"time": now, **e}) for e in entries)}  # the last of equal ones
    with locks.waiting(paths.path(workdir, ".results.lock"), f"writing {path}"):
        kept = [_clean(e) for e in load(workdir) if identity(e) not in new]
        with disk_full_is_one_line(f"no space left on {path.parent} while writing results.json; "
                                   "its earlier results are intact"):
            paths.write_text(path, json.dumps({"results": kept + list(new.values())}, indent=1))
    with disk_full_is_one_line(f"no space left on {path.parent} while writing TensorBoard events; results.json "
                               "is written"):
        metrics.log_results(workdir, list(new.values()))


def latest(entries: list[dict], **match) -> dict | None:
    """The most recent entry whose fields equal `match`."""
    hits = [e for e in entries if all(e.get(k) == v for k, v in match.items())]
    return hits[-1] if hits else None


def measured_by(entry: dict, fcfg) -> bool:
    """Whether flatness `entry` is the measurement the experiment's flatness spec `fcfg` makes (`flatness_pending`):
    the same estimator (method, grown_to, fisher form) on the same validation batches with the same probes and
    draws. A trace another command added at the step (`flatlm flatness --method hutchinson`, other batches, the
    training split) is another measurement. Settings an entry does not record (written before they were) match."""
    if entry.get("kind") != "flatness" or entry.get("method") != fcfg.get("method", "fisher"):
        return False
    if tuple(entry.get("grown_to") or ()) != tuple(fcfg.get("grow_to") or ()):
        return False
    want = dict(split="validation", seed=0, fisher_form="per_sample", chunk_size=1,
                num_batches=fcfg.get("num_batches", 4), batch_size=fcfg.get("batch_size", 128),
                num_draws=fcfg.get("draws", 50), num_probes=fcfg.get("num_probes") or 64)
    settings = {"split": "validation", **(entry.get("settings") or {})}
    return all(settings[k] == v for k, v in want.items() if k in settings)


def flatness_spec(run_dir) -> dict | None:
    """The flatness spec of the experiment `run_dir` belongs to (`<experiment>/runs/<name>/`; its
    experiment.json), or None for a run outside an experiment."""
    spec = paths.path(run_dir).parent.parent / "experiment.json"
    return json.loads(spec.read_text()).get("flatness") if spec.exists() else None
