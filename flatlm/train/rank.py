"""What training adds to each weight matrix: the numerical rank and top singular values of W - W0 (beyond the paper:
incremental rank learning). W0 is recomputed from the run's seed (initialisation is deterministic: `init_state`),
so nothing extra is stored in checkpoints; `train.rank_every` logs it to metrics.jsonl and TensorBoard as
`rank/<path>` and `sv<i>/<path>`.

Each tensor with >= 2 axes is read as a matrix [fan-in, fan-out] by its logical layout: qkv[D, 3, H, Dh] ->
[D, 3 H Dh], out[H, Dh, D] -> [H Dh, D]; anything else -> [first axis, rest]. The numerical rank counts singular
values above `rel_tol` times the largest (and above `abs_tol`, so an unchanged matrix has rank 0).
"""

from __future__ import annotations

import jax
import numpy as np


def as_matrix(name: str, w: np.ndarray) -> np.ndarray:
    """A weight tensor as [fan-in, fan-out] (see the module docstring)."""
    if name.endswith("/out") and w.ndim == 3:
        return w.reshape(-1, w.shape[-1])
    return w.reshape(w.shape[0], -1)


def update_ranks(params, init_params, rel_tol: float = 1e-3, abs_tol: float = 1e-8, top: int = 3
                 ) -> dict[str, float]:
    """{"rank/<path>": numerical rank, "sv<i>/<path>": i-th largest singular value} of W - W0 per matrix."""
    out = {}
    flat0 = dict(jax.tree_util.tree_flatten_with_path(init_params)[0])
    for path, w in jax.tree_util.tree_flatten_with_path(params)[0]:
        if np.ndim(w) < 2:
            continue
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        delta = as_matrix(name, np.asarray(w, np.float64) - np.asarray(flat0[path], np.float64))
        sv = np.linalg.svd(delta, compute_uv=False)
        out[f"rank/{name}"] = float(np.sum(sv > max(rel_tol * (sv[0] if sv.size else 0.0), abs_tol)))
        for i, s in enumerate(sv[:top]):
            out[f"sv{i}/{name}"] = float(s)
    return out
