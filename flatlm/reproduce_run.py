"""Running the reproduction suite: which experiments each claim needs (`SUITE`, `plan`), running them resumably in
one workdir (`run_suite`), and what the workdir records about the run (`suite.json`: preset, seeds, wall time;
`timings.json`: each experiment's time). `flatlm.reproduce` judges the claims from what the runs wrote.

A workdir holds one suite: the preset and the pre-training seeds it was made with are recorded in `suite.json`
before anything trains; a later call without --preset / --seeds keeps them, and one with another preset or other
seeds stops with one line (use a new --workdir) instead of mixing runs, as does `--report-only`. `--seeds`
repeats every experiment's seed-repeated runs over the seeds given (`flatlm.experiment.with_seeds`): more seeds,
narrower t-intervals (with 3 seeds the 95 % interval is mean +- 4.30 standard errors, with 5 seeds +- 2.78).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from flatlm import experiment_jobs, paths
from flatlm.errors import UserError
from flatlm.experiment import holding, load_experiment, pending_children, run_experiment, seeds_flag, with_seeds

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "experiments"
# claim -> (title, the paper's figures, [(experiment file, language)]); languages: the paper's choice per figure
SUITE = {
    "C1": ("continuing after convergence: same loss, accuracy up, Tr(H) down", "Figure 1",
           [("fig1_after_convergence", "hmm")]),
    "C2": ("larger models at the same loss transfer better and are flatter", "Figures 2 and 5",
           [("fig2_model_sizes", "hmm"), ("fig5_grown_sizes", "pcfg")]),
    "C3": ("the adversarial objective at the same loss transfers worse, with larger Tr(H)", "Tables 1 and 2",
           [("table1_hmm", "hmm"), ("table1", "pcfg"), ("table2", "pcfg")]),
    "C4": ("SGD after convergence flattens; Tr(H) and accuracy are anti-correlated", "Figure 3",
           [("fig3_sgd", "hmm")]),
    "C5": ("a trained model's probe beats the lookup table's (the true conditionals)", "Table 1 (Section 3.3)",
           [("table1_hmm", "hmm"), ("table1", "pcfg")]),
}


# At `cpu` scale only the HMM reaches exact KL <= 0.02 on two cores (configs/experiments/README.md): the PCFG
# experiments run on the HMM instead (fig5: BERT on the HMM); Tables 1 and 2 (the PCFG) are left out, and Table 1's
# comparison runs on the HMM (table1_hmm, which the paper does not have).
_NO_PCFG = ("is left out at cpu scale: no affordable PCFG reaches KL <= 0.02 on two cores (measured: 0.155 after 3000 "
            "steps; configs/experiments/README.md)")
CPU_LEFT_OUT = {"table1": f"table1 (the PCFG) {_NO_PCFG}", "table2": f"table2 (PCFG task C) {_NO_PCFG}"}


def plan(preset: str) -> dict[str, list[tuple[str, str]]]:
    """{claim: [(experiment file, language)]} that `preset` runs."""
    if preset != "cpu":
        return {cid: list(spec[2]) for cid, spec in SUITE.items()}
    return {cid: [(name, "hmm") for name, _ in spec[2] if name not in CPU_LEFT_OUT] for cid, spec in SUITE.items()}


def experiment_dir(workdir: str, name: str, language: str) -> paths.Path:
    """Where the suite keeps one experiment."""
    return paths.path(workdir) / f"{name}-{language}"


def load_timings(workdir: str) -> dict:
    """{experiment dir name: seconds from its first run's start to its last one's end} recorded by `run_suite`
    ({} if none). Under `--jobs` the experiments' spans overlap: `load_wall` is the suite's wall time."""
    path = paths.path(workdir) / "timings.json"
    return json.loads(path.read_text()) if path.exists() else {}


def load_wall(workdir: str) -> float:
    """The suite's wall seconds over every `run_suite` call on `workdir` (`suite.json`; for a workdir made before
    flatlm recorded it, the sum of the experiments' times, which did not overlap then)."""
    wall = _meta(workdir).get("wall_s")
    return float(wall) if wall is not None else float(sum(load_timings(workdir).values()))


def _meta(workdir: str) -> dict:
    meta = paths.path(workdir) / "suite.json"
    return json.loads(meta.read_text()) if meta.exists() else {}


def load_preset(workdir: str) -> str:
    """The preset `run_suite` recorded in `<workdir>/suite.json` ("cpu" if none)."""
    return _meta(workdir).get("preset", "cpu")


def load_seeds(workdir: str) -> tuple[int, ...]:
    """The pre-training seeds `run_suite` was given for `workdir` (`--seeds`); () for the presets' own."""
    return tuple(_meta(workdir).get("seeds") or ())


def check_suite(workdir: str, preset: str | None, seeds: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """(preset, seeds) of `workdir`: those given, or for an empty one (None, ()) those recorded there ("cpu" and the
    preset's seeds for a new workdir). UserError when the workdir was made with another preset or other seeds (its
    runs would be mixed with the new ones, or judged as another preset's)."""
    meta = _meta(workdir)
    recorded = tuple(meta.get("seeds") or ())
    made = meta.get("preset", preset or "cpu")
    if preset and made != preset:
        raise UserError(f"{workdir} holds the suite of --preset {made}, not {preset}; rerun with --preset {made} "
                        "or use a new --workdir")
    if meta and seeds and seeds != recorded:
        was = " ".join(seeds_flag(recorded)) or "the preset's seeds"
        raise UserError(f"{workdir} was made with {was}, not {' '.join(seeds_flag(seeds))}; use a new --workdir for "
                        "other seeds")
    return made, recorded if meta else tuple(seeds)


def missing(workdir: str, claim: str, preset: str | None = None) -> list[str]:
    """The experiment folders `claim` needs that `workdir` lacks (for `preset`, default the one it recorded)."""
    return [experiment_dir(workdir, n, lang).name for n, lang in plan(preset or load_preset(workdir))[claim]
            if not experiment_dir(workdir, n, lang).exists()]


def check_report(workdir: str, preset: str | None, seeds: tuple[int, ...], claim_ids: tuple[str, ...]) -> str:
    """The preset to judge `workdir` under, for `--report-only`: it must hold the suite, made with `preset` and
    `seeds` where they are given, and every claim asked for by name; else a UserError naming the command that runs
    what is missing. (A workdir made before `suite.json` existed is judged under `preset`, default cpu.)"""
    rerun = f"flatlm reproduce --workdir {workdir}"
    if not paths.path(workdir).is_dir():
        raise UserError(f"{workdir} does not exist: run `{rerun}` first (without --report-only)")
    preset, _ = check_suite(workdir, preset, seeds)
    for cid in claim_ids:
        if lacking := missing(workdir, cid, preset):
            raise UserError(f"{cid} has not run in {workdir} (no {', '.join(lacking)}): run `{rerun} --claims {cid}` "
                            "first")
    if all(missing(workdir, cid, preset) for cid in SUITE):
        raise UserError(f"{workdir} holds no claim's experiments: run `{rerun}` first (without --report-only)")
    return preset


def check_claims(claim_ids: tuple[str, ...]) -> None:
    """UserError for a claim id that is not one of `SUITE`'s."""
    for cid in claim_ids:
        if cid not in SUITE:
            raise UserError(f"unknown claim {cid!r}; choose from {', '.join(SUITE)}")


def _experiments(preset: str, claim_ids: tuple[str, ...]) -> list[tuple[str, str]]:
    """(experiment file, language) of the chosen claims, each once, in the claims' order."""
    check_claims(claim_ids)
    out = []
    for cid in claim_ids or tuple(SUITE):
        out += [e for e in plan(preset)[cid] if e not in out]
    return out


def run_suite(preset: str | None, workdir: str, claim_ids: tuple[str, ...] = (), progress: bool = True,
              jobs: int = 1, seeds: tuple[int, ...] = ()) -> dict:
    """Run (or resume) every experiment the chosen claims need; returns `load_timings`. `jobs` > 1: the pending runs
    of all of them in one queue, `jobs` at a time (`flatlm.experiment_jobs`), the longest first; else one
    experiment after the other, one run at a time. `seeds`: every experiment's seed-repeated runs over these
    pre-training seeds instead of the preset's (empty: the preset's, or those the workdir was made with); `preset`
    None: the workdir's (`check_suite`). The preset, seeds and wall time go to `suite.json` (`load_preset`,
    `load_seeds`, `load_wall`)."""
    experiment_jobs.check_jobs(jobs)  # before anything is written (0 would leave the queue waiting forever)
    preset, seeds = check_suite(workdir, preset, tuple(seeds))
    exps = []
    for n, lang in _experiments(preset, claim_ids):  # every config loads (and takes the seeds) before a write
        spec = f"{CONFIGS / n}.py:{preset},{lang}"
        exp = load_experiment(spec)
        exps.append((experiment_dir(workdir, n, lang), spec, with_seeds(exp, seeds) if seeds else exp))
    root = paths.path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    wall = load_wall(workdir)
    timings = load_timings(workdir)
    t0 = time.time()

    def save() -> None:  # after every experiment (or run), so an interrupted suite keeps what it measured
        paths.write_text(root / "timings.json", json.dumps(timings, indent=1))
        paths.write_text(root / "suite.json", json.dumps({"preset": preset, "seeds": list(seeds) or None,
                                                          "wall_s": wall + time.time() - t0}))

    save()
    if jobs == 1:
        for target, _, exp in exps:
            t1 = time.time()
            status = run_experiment(exp, str(target), progress=progress)
            if any(v == "finished" for v in status.values()) or target.name not in timings:
                timings[target.name] = timings.get(target.name, 0.0) + time.time() - t1
            save()
        return timings
    with contextlib.ExitStack() as stack:
        todo = []
        for target, spec, exp in exps:
            stack.enter_context(holding(exp, str(target)))
            todo += pending_children(exp, target, exp.runs, ("--config", spec, *seeds_flag(seeds)),
                                     prefix=f"{target.name}/")
            timings.setdefault(target.name, 0.0)  # every experiment listed, its runs done earlier or not
        save()
        earlier = dict(timings)
        spans: dict[str, tuple[float, float]] = {}  # experiment: (first start, last end) of its runs in this queue

        def on_finished(child, started: float, ended: float) -> None:
            name = paths.path(child.workdir).name
            lo, hi = spans.get(name, (started, ended))
            spans[name] = (min(lo, started), max(hi, ended))
            timings[name] = earlier[name] + spans[name][1] - spans[name][0]
            save()

        experiment_jobs.run_children(todo, jobs, progress, "reproduce", on_finished)
        save()
    return timings
