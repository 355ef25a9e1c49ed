"""On-disk cache of probe features, so re-probing a checkpoint (or the lookup table) skips the encoder pass.

One .npz per (checkpoint step, split, projection) in a cache folder, holding the features and a fingerprint of
the inputs they were computed from; files are written atomically, and a stale or foreign file is recomputed.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable

import numpy as np

from flatlm.evaluate import features as features_lib
from flatlm.evaluate.features import ApplyFn


def fingerprint(*arrays) -> str:
    """sha1 of the arrays' shapes, dtypes and bytes: detects a cache file made from different inputs."""
    h = hashlib.sha1()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def feature_cache_path(cache_dir: str, step: int | str, split: str, projection_dim: int = 0,
                       projection_seed: int = 0, layer: int | None = None) -> str:
    """File of the cached features for (checkpoint step, split, projection; 0 = none, layer; None = the last) in
    `cache_dir`."""
    proj = f"proj{projection_dim}-seed{projection_seed}" if projection_dim else "full"
    where = "" if layer is None else f"-layer{layer}"
    return os.path.join(cache_dir, f"features-step{step}{where}-{split}-{proj}.npz")


def save_npz_atomic(path: str, **arrays) -> None:
    """np.savez to a temporary file in the same folder, then os.replace: readers never see a partial file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_or_compute(path: str, key: str, compute: Callable[[], np.ndarray]) -> np.ndarray:
    """The array cached at `path` if its stored fingerprint equals `key`, else `compute()` (then cached)."""
    if os.path.exists(path):
        try:
            with np.load(path) as f:
                if str(f["fingerprint"]) == key:
                    return f["features"]
        except (OSError, KeyError, ValueError):
            pass  # unreadable or foreign file: recompute and overwrite
    x = compute()
    save_npz_atomic(path, features=x, fingerprint=np.array(key))
    return x


def cached_features(
    cache_dir: str | None,
    apply_fn: ApplyFn,
    params,
    tokens_NT,
    *,
    step: int | str,
    split: str,
    batch_size: int = 1024,
    projection_dim: int = 0,
    projection_seed: int = 0,
    progress: bool = True,
    layer: int | None = None,
) -> np.ndarray:
    """`features.extract_features` float32[N, F] (of `layer`; None = the last), cached in `cache_dir` under
    (step, layer, split, projection); None = no cache.

    The file also stores a fingerprint of the tokens, so different inputs under the same key are recomputed.
    The key does not identify the model: keep one cache folder per training run (e.g. its workdir).
    """
    compute = lambda: features_lib.extract_features(
        apply_fn, params, tokens_NT, batch_size=batch_size, projection_dim=projection_dim,
        projection_seed=projection_seed, progress=progress, desc=f"features {split}", layer=layer)
    if cache_dir is None:
        return compute()
    path = feature_cache_path(cache_dir, step, split, projection_dim, projection_seed, layer)
    return load_or_compute(path, fingerprint(np.asarray(tokens_NT, np.int32)), compute)
