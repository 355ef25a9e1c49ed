"""Which checkpoint of a run a claim compares, and what was measured there (`flatlm.reproduce`'s claims).

A run's measured checkpoints are those with an exact loss and a probe result. C1 and C4 pair the first one after
convergence with the last one inside the "same loss" band (`after_convergence`), C3 compares each run's last one
inside the band (`last_in_band`), C2 the final ones (`final`); `point` is what a claim reads at a checkpoint: the
exact loss entry, the probe accuracy (first task) and the experiment's own Tr(H) (with its growth-invariant and
encoder / head parts where recorded).
"""

from __future__ import annotations

import json
from pathlib import Path

from flatlm import claims
from flatlm.report import RunData, find_runs
from flatlm.report_paired import experiment_flatness_spec, split_trace
from flatlm.report_plots import by_seed
from flatlm.results import measured_by


def at(run: RunData, kind: str, step: int, keep=lambda e: True, **match) -> dict | None:
    """The latest result entry of `kind` at `step` that `keep` accepts and whose fields equal `match`; None if none."""
    hits = [e for e in run.results if e["kind"] == kind and e.get("step") == step and keep(e)
            and all(e.get(k) == v for k, v in match.items())]
    return hits[-1] if hits else None


def task_of(run: RunData) -> str | None:
    """The run's first probed task (alphabetically); None without a probe."""
    tasks = sorted({e["task"] for e in run.results if e["kind"] == "probe"})
    return tasks[0] if tasks else None


def measured_steps(run: RunData) -> list[int]:
    """Checkpoint steps with an exact loss and a probe result, ascending."""
    probe = {e["step"] for e in run.results if e["kind"] == "probe"}
    return sorted(s for s in (e["step"] for e in run.results if e["kind"] == "exact_loss") if s in probe)


def point(run: RunData, step: int) -> dict:
    """Exact loss, probe accuracy (first task) and Tr(H) (if measured) of one checkpoint."""
    loss = at(run, "exact_loss", step)
    probe = at(run, "probe", step, task=task_of(run))
    spec = experiment_flatness_spec(run)
    trace = at(run, "flatness", step, keep=lambda e: spec is None or measured_by(e, spec))
    invariant = ((trace or {}).get("detail") or {}).get("per_group", {}).get("growth_invariant")
    return {"loss": loss, "accuracy": probe["accuracy"] if probe else None,
            "trace": trace["trace"] if trace else None, "trace_invariant": invariant,
            "trace_parts": split_trace(trace) if trace else (None, None)}  # (encoder, head)


def in_band(run: RunData, step: int) -> bool:
    """Whether measured checkpoint `step` is inside the "same loss" band (exact KL <= claims.MAX_KL)."""
    return at(run, "exact_loss", step)["kl"] <= claims.MAX_KL


def converged_at(run: RunData) -> int | None:
    """The step the run converged at: the convergence watch's (convergence.json, Figure 1's runs), else the first
    measured checkpoint whose exact KL is in the "same loss" band (runs without the watch, e.g. Figure 3's SGD)."""
    conv = run.path / "convergence.json"
    step = json.loads(conv.read_text()).get("converged_at") if conv.exists() else None
    if step is not None:
        return step
    return next((s for s in measured_steps(run) if in_band(run, s)), None)


def after_convergence(exp: Path) -> tuple[dict, dict, list[str]]:
    """Each seed's first measured checkpoint at or after convergence (`converged_at`) and the last one after it
    inside the band: a single iterate's KL moves by ~0.004 nats between checkpoints, so a final one outside the
    band is left out (with a note); with none inside, the final one is compared (and fails the same-loss check)."""
    first, last, notes = {}, {}, []
    methods = by_seed(find_runs([str(exp)]))  # pairs are per seed: one method's runs (the experiment's first)
    if len(methods) > 1:
        notes.append(f"{exp.name}: compared {next(iter(methods))} only; not {', '.join(list(methods)[1:])}")
    for seed, run in next(iter(methods.values()), {}).items():
        start = converged_at(run)
        steps = [s for s in measured_steps(run) if start is not None and s >= start]
        if len(steps) < 2:
            notes.append(f"seed {seed}: {len(steps)} measured checkpoint(s) after convergence (step {start})")
            continue
        inside = [s for s in steps[1:] if in_band(run, s)]
        end = inside[-1] if inside else steps[-1]
        if end != steps[-1]:
            notes.append(f"seed {seed}: the last checkpoint (step {steps[-1]}, KL "
                         f"{at(run, 'exact_loss', steps[-1])['kl']:.4f}) is outside the band; compared the last "
                         f"one inside it (step {end})")
        first[seed], last[seed] = point(run, steps[0]), point(run, end)
    return first, last, notes


def final(run: RunData) -> dict:
    """`point` of the run's last measured checkpoint (every value None without one)."""
    steps = measured_steps(run)
    return point(run, steps[-1]) if steps else {"loss": None, "accuracy": None, "trace": None,
                                                 "trace_invariant": None}


def last_in_band(run: RunData, notes: list[str]) -> dict:
    """C3's checkpoint of a run: its last measured one inside the "same loss" band, else its final one (which then
    fails the same-loss check). As in `after_convergence`, a single iterate's KL moves by ~0.004 nats between
    checkpoints, so one final checkpoint just outside the band no longer voids the claim when an earlier one (the
    cpu preset measures steps 1600, 1800, 2000) is inside it. A run measured at its final step only: the final."""
    steps = measured_steps(run)
    inside = [s for s in steps if in_band(run, s)]
    if not steps or not inside or inside[-1] == steps[-1]:
        return final(run)
    notes.append(f"{run.name}: the last checkpoint (step {steps[-1]}, KL {at(run, 'exact_loss', steps[-1])['kl']:.4f}"
                 f") is outside the band; compared the last one inside it (step {inside[-1]})")
    return point(run, inside[-1])
