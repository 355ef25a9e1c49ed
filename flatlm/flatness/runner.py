"""Flatness of a run's checkpoints, appended to its results.json (used by `flatlm flatness`, experiments, demo).

Each entry: {"kind": "flatness", "step", "method", "trace", "trace_stderr", "detail": TraceEstimate.to_dict()}.
The batches are masked validation sentences (one masked position per sentence, as in the paper), the same for
every checkpoint, so traces along training are comparable.
"""

from __future__ import annotations

import sys

import jax
from tqdm.auto import tqdm

from flatlm import results as results_lib
from flatlm.flatness import report


def flatness_run(workdir: str, steps: list[int] | None = None, method: str = "fisher", num_probes: int = 64,
                 num_batches: int = 4, batch_size: int = 128, draws: int = 50, seed: int = 0,
                 fisher_form: str = "per_sample", grow_to: tuple[int, int] | None = None,
                 progress: bool = True) -> list[dict]:
    """Measure and append Tr for `steps` (default: all). `grow_to=(num_layers, d_model)` first embeds every
    checkpoint into that larger shape without changing its function (paper Figure 5), so sizes compare."""
    from flatlm.checkpoint import load_run
    from flatlm.flatness import grow
    from flatlm.models import Bert

    run = load_run(workdir)
    model = run.model
    if grow_to is not None:
        big_cfg = grow.grown_config(model.cfg, num_layers=grow_to[0], d_model=grow_to[1])
        model = Bert(big_cfg)
    steps = list(run.steps) if steps is None else list(steps)
    batches = run.mlm_batches(num_batches, batch_size, seed=seed)
    entries = []
    for step in tqdm(steps, desc=f"flatness ({method})", disable=not progress, file=sys.stderr):
        params = run.load_params(step)
        if grow_to is not None:
            params = grow.embed(params, run.model.cfg, model.cfg)
        est = report.measure(method, model.apply, params, batches, jax.random.key(seed + step),
                             num_probes=num_probes or 64, num_draws=draws, fisher_form=fisher_form)
        entry = {"kind": "flatness", "step": step, "method": method, "grown_to": grow_to, "trace": est.mean,
                 "trace_stderr": est.stderr, "detail": est.to_dict()}
        results_lib.append(workdir, [entry])
        entries.append(entry)
    return entries
