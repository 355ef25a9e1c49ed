"""Flatness of a run's checkpoints (used by `flatlm flatness`, experiments and the demo).

Each entry: {"kind": "flatness", "step", "method", "grown_to", "trace", "trace_stderr", "detail":
TraceEstimate.to_dict()}, appended to the run's results.json. With `spectrum_k` or `density_probes`, each step also
gets {"kind": "spectrum", "step", "grown_to", "settings", **`compare.spectrum_report`} (the Hessian's top
eigenvalues with Ritz bounds, its SLQ density and moments Tr(H^p)); with `preconditioned`, an AdamW run's
{"kind": "preconditioned_sharpness", ...} (`flatlm.flatness.preconditioned.measure`). The batches are masked
validation sentences (one masked position per sentence, as in the paper's B.1), the same for every checkpoint, so
traces along training compare. With `gap=True` each entry is instead the Hessian / Fisher / empirical-Fisher
comparison of `flatlm.flatness.compare.gap_report` ({"kind": "flatness_gap", ...}), returned but not appended.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Collection

import jax
from tqdm.auto import tqdm

from flatlm import locks
from flatlm import results as results_lib
from flatlm.errors import UserError
from flatlm.flatness import compare, grow, grow_lstm
from flatlm.flatness import preconditioned as precond
from flatlm.models import Bert, BiLSTM
from flatlm.run import Run, load_run


def measure_run(run: Run, steps: list[int] | None = None, method: str = "fisher", *, num_probes: int = 64,
                num_batches: int = 4, batch_size: int = 128, draws: int = 50, seed: int = 0,
                fisher_form: str = "per_sample", chunk_size: int = 1, groups: str | None = None,
                grow_to: tuple[int, int] | None = None, gap: bool = False, append: bool = True,
                progress: bool = True, spectrum_k: int = 0, density_probes: int = 0,
                density_iters: int = 30, preconditioned: bool = False, split: str = "validation",
                spectrum_steps: Collection[int] | None = None) -> list[dict]:
    """Tr(H) (or the `gap` report) of `run`'s checkpoints `steps` (default: all), one entry per step.

    `grow_to=(num_layers, d_model)` first embeds every checkpoint into that larger shape without changing its
    function (paper Figure 5, B.4), so sizes compare; for a BiLSTM it is (num_layers, d_hidden), width only.
    Step s uses the key `seed + s` (its spectrum fold_in(that key, 1)); spectrum entries follow their step's
    flatness entry in the returned list. `preconditioned`: also each AdamW checkpoint's preconditioned sharpness
    ({"kind": "preconditioned_sharpness", ...}, `flatlm.flatness.preconditioned`; key fold_in(key, 2)).
    `spectrum_steps`: the steps that get the spectrum and preconditioned entries (None: every measured step; an
    experiment's `flatness.spectrum_at="last"` asks for its final checkpoint only, where every checkpoint's Lanczos
    and SLQ would cost a large share of a paper-scale run).
    `split="train"` measures on the training objective instead (`Run.train_batches`: training sentences, masked as
    training masks them; `seed` unused), recorded in each entry's settings.
    Appending holds the workdir's lock (`flatlm.locks.exclusive`) for the whole measurement: another writer there
    stops with one line.
    """
    if preconditioned and (grow_to is not None or gap):
        raise UserError("the preconditioned sharpness reads the run's own Adam state: not with grow_to or gap")
    if split not in results_lib.SPLITS:
        raise UserError(f"flatness split must be one of {', '.join(results_lib.SPLITS)}, got {split!r}")
    load_adam = precond.adam_loader(run) if preconditioned else None
    with locks.exclusive(run.workdir, "measuring flatness", enabled=append and not gap and jax.process_index() == 0):
        model = run.model
        lstm = isinstance(model, BiLSTM)
        if grow_to is not None:
            model = (BiLSTM(grow_lstm.grown_lstm_config(model.cfg, grow_to[1], grow_to[0])) if lstm else
                     Bert(grow.grown_config(model.cfg, num_layers=grow_to[0], d_model=grow_to[1])))
        steps = list(run.steps) if steps is None else list(steps)
        batches = (run.train_batches(num_batches, batch_size) if split == "train" else
                   run.mlm_batches(num_batches, batch_size, seed=seed))
        if len(batches) < num_batches:
            print(f"warning: the {split} split holds {len(batches)} batch(es) of {batch_size} sentences, not the "
                  f"{num_batches} asked for; measuring on those", file=sys.stderr)
        kw = dict(num_probes=num_probes or 64, num_draws=draws, fisher_form=fisher_form, chunk_size=chunk_size,
                  groups=groups)
        # the batches every entry is measured on (split absent for the default, as in entries written before it)
        where = dict(seed=seed, num_batches=num_batches, batch_size=batch_size,
                     **({"split": split} if split != "validation" else {}))
        settings = dict(kw, **where)  # what identifies a measurement
        entries = []
        for step, params in run.checkpoint_params(tqdm(steps, desc=f"flatness ({'gap' if gap else method})",
                                                       disable=not progress, file=sys.stderr)):
            if grow_to is not None:
                embed = grow_lstm.embed_lstm if lstm else grow.embed
                params = embed(params, run.model.cfg, model.cfg)
            key, t0 = jax.random.key(seed + step), time.perf_counter()
            if gap:
                entries.append({"kind": "flatness_gap", "step": step,
                                **compare.gap_report(model.apply, params, batches, key, **kw)})
            else:
                est = compare.measure(method, model.apply, params, batches, key, **kw)
                entries.append({"kind": "flatness", "step": step, "method": method, "grown_to": grow_to,
                                "settings": settings, "trace": est.mean, "trace_stderr": est.stderr,
                                "detail": est.to_dict(), "seconds": time.perf_counter() - t0})
            extras = spectrum_steps is None or step in spectrum_steps
            if extras and (spectrum_k or density_probes):
                t0 = time.perf_counter()
                spec = dict(spectrum_k=spectrum_k, density_probes=density_probes, density_iters=density_iters,
                            **where)
                entries.append({"kind": "spectrum", "step": step, "grown_to": grow_to, "settings": spec,
                                **compare.spectrum_report(model.apply, params, batches, jax.random.fold_in(key, 1),
                                                          k=spectrum_k, density_probes=density_probes,
                                                          density_iters=density_iters),
                                "seconds": time.perf_counter() - t0})
            if extras and preconditioned:
                t0 = time.perf_counter()
                entries.append({"kind": "preconditioned_sharpness", "step": step, "settings": where,
                                **precond.measure(model.apply, params, batches, load_adam(step), run.config.train, step,
                                                  jax.random.fold_in(key, 2)),
                                "seconds": time.perf_counter() - t0})
            if append and not gap:
                results_lib.append(run.workdir, [e for e in entries if e["step"] == step])
        return entries


def flatness_run(workdir: str, steps: list[int] | None = None, method: str = "fisher", **kw) -> list[dict]:
    """`measure_run` on the run stored in `workdir`, appending to its results.json."""
    return measure_run(load_run(workdir), steps, method, **kw)
