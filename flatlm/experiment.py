"""`flatlm experiment`: run every run of a paper experiment, then evaluate and measure flatness, resumably.

An experiment config (`configs/experiments/*.py`) is a ConfigDict with
  name, base (a full run config), runs (list of {name, overrides: ("--config.a.b=v", ...)}),
  evaluate (bool), flatness ({enabled, method, num_probes, ...}), grow (Figure 5: embed runs into a big shape).
Layout: <workdir>/experiment.json, <workdir>/runs/<name>/ (an ordinary run workdir each). A run is finished
when its `DONE` marker exists; a killed experiment restarts where it stopped: finished runs are skipped, an
interrupted run resumes from its last checkpoint, evaluations already in results.json are not redone.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import time
from pathlib import Path

import jax
import ml_collections

from flatlm import checkpoint as ckpt
from flatlm import config as config_lib
from flatlm import experiment_jobs, locks, paths
from flatlm import results as results_lib
from flatlm import run as run_lib
from flatlm.config import SEED_SUFFIX
from flatlm.errors import UserError
from flatlm.evaluate.runner import evaluate_run, incomplete_steps
from flatlm.flatness.runner import flatness_run
from flatlm.models import stacking
from flatlm.results import flatness_spec, measured_by  # noqa: F401 - public names of this module too
from flatlm.train.loop import train_and_evaluate, validate

# Tr(H) as the paper measures it (B.1, B.2): 10,000 contexts x_-t, 50 draws of x_t each, the std over 5 resamples
# (here 5 batches of 2,000 contexts: the result's data_std / stderr are over those 5). Used by the paper presets.
PAPER_FLATNESS = dict(num_batches=5, batch_size=2_000, draws=50)
# Fine-tuning that moves the cpu presets' small pre-trained models (docs/experiments/flatness_seeking-cpu): the rate
# chosen on validation among the paper's 1e-4 (A.4), the suite's 1e-3 and 1e-2, 20 epochs, and the same
# fine-tuning of each run's initialisation as the control. A departure from A.4's fixed rate: at 1e-4 / 1e-3 a
# pre-trained and a random encoder of this size end at the same accuracy, so the column said nothing.
CPU_FINETUNE = dict(epochs=20, lr_grid=(1e-4, 1e-3, 1e-2), from_init=True)


# an experiment's `flatness` spec: what `flatness_pending` measures at every checkpoint (flatlm.flatness.runner)
FLATNESS_DEFAULTS = dict(
    enabled=False, method="fisher", num_probes=64, num_batches=4, batch_size=128, draws=50,
    grow_to=(),  # (num_layers, d_model): embed every checkpoint into this shape first (Figure 5)
    groups="",  # per-group traces: "" (top-level keys), "leaf", "growth", "block" (flatness.estimates)
    spectrum_k=0, density_probes=0, density_iters=30,  # Hessian spectrum (flatness.compare.spectrum_report)
    preconditioned=False,  # AdamW runs: Adam's preconditioned sharpness (flatness.preconditioned)
    spectrum_at="all")  # the checkpoints that get those two: "all" or "last" (the final one)


def flatness_seeking_config(arg: str, name: str, methods: list[tuple[str, list[str]]], description: str,
                            groups: str = "") -> ml_collections.ConfigDict:
    """The flatness-seeking experiments' shared presets (configs/experiments/flatness_seeking*.py): `methods` over
    the suite's base config of `arg`, the Fisher trace at every checkpoint (per `groups`), the Hessian's top
    eigenvalues, Tr(H^2) and Adam's preconditioned sharpness; tiny: 40 steps, seeds 0, 1; cpu: CPU_FINETUNE, seeds
    0, 1, 2; paper: PAPER_FLATNESS, seeds 0, 1, 2."""
    preset, language = parse_arg(arg, languages=("hmm", "pcfg"))
    base = base_run_config(preset, language)
    flatness = dict(enabled=True, method="fisher", groups=groups)
    if preset == "tiny":
        base.train.update(steps=40, eval_every=20)
        base.checkpoint.every = 20
        flatness.update(num_batches=1, draws=4)
    elif preset == "cpu":
        flatness.update(num_batches=2, draws=20)
        base.eval.finetune.update(CPU_FINETUNE)  # the rate chosen on validation, and the init control
    else:  # the spectrum at the last checkpoint only: at each of 30 (150 HVPs over 10^4 sentences, ~730 steps at
        # batch 4096 by a count of passes) it would add ~70 % to the training's compute
        flatness.update(PAPER_FLATNESS, spectrum_at="last")
    # issue 18 item 4, every curvature figure: top-5 eigenvalues (10 Lanczos steps), SLQ density and Tr(H^p) (probes
    # x iters steps), Adam's preconditioned sharpness (20 steps), on the measurement batches above
    probes, iters = {"tiny": (2, 8), "cpu": (8, 30)}.get(preset, (4, 30))
    flatness.update(spectrum_k=2 if preset == "tiny" else 5, density_probes=probes, density_iters=iters,
                    preconditioned=True)
    return experiment_config(name, base, methods, flatness=flatness, seeds=(0, 1) if preset == "tiny" else (0, 1, 2),
                             description=description)


def _over_seeds(runs, seeds: tuple[int, ...]) -> list[tuple[str, list[str]]]:
    """(name, overrides) -> one (`<name>-seed<k>`, overrides + --config.seed=k) per seed k, seed-minor."""
    return [(f"{n}-seed{s}", [*o, f"--config.seed={s}"]) for n, o in runs for s in seeds]


def experiment_config(name: str, base, runs: list[tuple[str, list[str]]], evaluate: bool = True,
                      flatness: dict | None = None, description: str = "",
                      seeds: tuple[int, ...] = ()) -> ml_collections.ConfigDict:
    """An experiment: `runs` are (name, overrides of `base`). With `seeds`, every run is repeated once per
    pre-training seed (`--config.seed=k`: initialisation, corpus sample, data order and D1/D2 batches) as
    `<name>-seed<k>`; `flatlm report` then also tabulates mean ± std over those seeds."""
    if seeds:
        runs = _over_seeds(runs, seeds)
    c = ml_collections.ConfigDict()
    c.name = name
    c.description = description
    c.base = base
    c.runs = [{"name": n, "overrides": list(o)} for n, o in runs]
    c.evaluate = evaluate
    c.flatness = ml_collections.ConfigDict({**FLATNESS_DEFAULTS, **(flatness or {})})
    return c


def parse_arg(arg: str, default_language: str | None = None,
              languages: tuple[str, ...] = ("hmm", "pcfg", "opt")) -> tuple[str, str]:
    """"tiny" | "cpu" | "paper", optionally ",hmm" / ",pcfg" / ",opt" (e.g. "cpu,pcfg") -> (preset, language).

    Without a language: `default_language`, or if that is None the PCFG, except at `cpu` scale, where it is the
    HMM (the only language whose models reach exact KL <= 0.02 on two CPU cores; configs/experiments/README.md).
    `languages`: those the experiment supports (the adversarial tables and Figure 3 have no OPT version)."""
    preset, _, language = (arg or "tiny").partition(",")
    language = language or default_language or ("hmm" if preset == "cpu" else "pcfg")
    if preset not in ("tiny", "cpu", "paper"):
        optional = " or ".join(f"',{lang}'" for lang in languages)
        raise UserError(f"unknown preset {preset!r}; use tiny, cpu or paper (optionally {optional})")
    if language not in languages:
        raise UserError(f"unknown language {language!r} for this experiment; use {' or '.join(languages)}")
    return preset, language


def base_run_config(preset: str, language: str):
    """The `configs/{language}_mlm.py:{preset}` config that experiments start from."""
    path = Path(__file__).resolve().parents[1] / "configs" / f"{language}_mlm.py"
    if not path.exists():
        raise UserError(f"{path} not found: experiments need the repository's configs/ folder")
    return config_lib.load_config(f"{path}:{preset}")


def run_config(exp, run: dict):
    """The full config of one run of the experiment: its base with the run's overrides."""
    config = copy.deepcopy(exp.base)
    config.config_spec = f"{exp.name}/{run['name']}"
    return config_lib.apply_overrides(config, list(run["overrides"]))


def validate_experiment(exp) -> None:
    """Unique run names, every run's config valid on this machine's devices, and the flatness spec's choices."""
    names = [r["name"] for r in exp.runs]
    if len(set(names)) != len(names):
        raise UserError(f"experiment {exp.name}: run names must be unique, got {names}")
    for r in exp.runs:
        validate(run_config(exp, r), jax.device_count())
    spectrum_at = (getattr(exp, "flatness", None) or {}).get("spectrum_at", "all")
    if spectrum_at not in ("all", "last"):
        raise UserError(f"experiment {exp.name}: flatness.spectrum_at must be 'all' or 'last', got {spectrum_at!r}")


def _done(run_dir: Path, final_step: int) -> bool:
    """A run is done when its DONE marker exists AND its final step's checkpoint does. A marker without that
    checkpoint (written by an older flatlm after a SIGTERM) is stale: it is moved aside and the run resumes."""
    marker = run_dir / "DONE"
    if not marker.exists():
        return False
    if final_step in ckpt.all_steps(str(run_dir)):
        return True
    marker.replace(run_dir / "DONE.stale")
    print(f"{run_dir}: DONE marker without the step-{final_step} checkpoint; resuming the run", file=sys.stderr)
    return False


def _mark_done(run_dir: Path, final_step: int, info: dict) -> None:
    if final_step not in ckpt.all_steps(str(run_dir)):  # never mark unfinished work finished
        raise RuntimeError(f"{run_dir} has no checkpoint at its final step {final_step}; not marking it done")
    paths.write_text(run_dir / "DONE", json.dumps(info))


def with_seeds(exp, seeds: tuple[int, ...]):
    """A copy of `exp` whose seed-repeated runs (`<name>-seed<k>`, `experiment_config(seeds=...)`) are repeated over
    `seeds` instead: e.g. more pre-training seeds for a lead, in a new workdir (`flatlm report` takes both dirs and
    pairs the runs by seed). UserError for an experiment without such runs or a negative / repeated seed."""
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise UserError(f"--seeds must list distinct non-negative seeds, e.g. 3,4,5; got {seeds}")
    methods: dict[str, list[str]] = {}
    for r in exp.runs:
        m = SEED_SUFFIX.match(r["name"])
        if not m:
            raise UserError(f"experiment {exp.name} has run {r['name']!r} without a -seed<k> suffix; --seeds "
                            "repeats the seed-repeated runs of an experiment whose preset lists seeds")
        methods.setdefault(m.group(1), [o for o in r["overrides"] if not o.startswith("--config.seed=")])
    out = copy.deepcopy(exp)
    out.runs = [{"name": n, "overrides": o} for n, o in _over_seeds(methods.items(), seeds)]
    return out


def seeds_flag(seeds: tuple[int, ...]) -> tuple[str, ...]:
    """`--seeds K,K,...` as command-line arguments, () for none: what `--jobs`' child processes and the reproduction
    report's command line carry (`flatlm experiment` and `flatlm reproduce` read it back)."""
    return ("--seeds", ",".join(map(str, seeds))) if seeds else ()


def select_runs(exp, names: tuple[str, ...]) -> list[dict]:
    """The runs of `exp` named in `names` (all if empty), in the experiment's order; UserError for an unknown name."""
    known = [r["name"] for r in exp.runs]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserError(f"experiment {exp.name} has no run {unknown[0]!r}; its runs: {', '.join(known)} "
                        "(flatlm experiment --list)")
    return [r for r in exp.runs if not names or r["name"] in names]


def run_experiment(exp, workdir: str, progress: bool = True, only: tuple[str, ...] = (), jobs: int = 1,
                   child_args: tuple[str, ...] = ()) -> dict:
    """Train, evaluate and measure every run (or the runs named in `only`); returns {run name: status}.

    The whole experiment holds the experiment dir's lock (`flatlm.locks.exclusive`): a second `flatlm experiment`
    on it stops with one line. With `only` (one job per run, e.g. `launch/tpu.sh experiment`) jobs of other runs
    may run beside it: each run's own workdir lock keeps two jobs off one run. `jobs` > 1 runs up to that many
    runs at once, each in a child process (`flatlm.experiment_jobs`) built from `child_args`, the command-line
    arguments that give this experiment (--config, --seeds, overrides); the statuses are the same."""
    experiment_jobs.check_jobs(jobs)
    if jobs > 1 and not child_args:
        raise ValueError("jobs > 1 needs child_args: the arguments of `flatlm experiment` that rebuild exp")
    selected = select_runs(exp, tuple(only))
    if only and jobs == 1:
        validate_experiment(exp)
        root = paths.path(workdir)
        root.mkdir(parents=True, exist_ok=True)
        with locks.waiting(root / ".experiment.lock", f"writing {exp.name}'s experiment.json"):
            _write_spec(exp, root, workdir)
        return _run_experiment(exp, root, selected, progress)
    with holding(exp, workdir) as root:
        todo = pending_children(exp, root, selected, child_args) if jobs > 1 else []
        if len(todo) < 2:  # one at a time (`_run_experiment` checks which runs are done itself)
            return _run_experiment(exp, root, selected, progress)
        ran = experiment_jobs.run_children(todo, jobs, progress, exp.name)
        return {r["name"]: ran.get(r["name"], "done earlier") for r in selected}


@contextlib.contextmanager
def holding(exp, workdir: str):
    """Validate `exp`, then hold its workdir's lock (`locks.exclusive`: a second `flatlm experiment` on it stops
    with one line) with its experiment.json written; yields the workdir."""
    validate_experiment(exp)
    root = paths.path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    with locks.exclusive(root, f"running experiment {exp.name}"):
        _write_spec(exp, root, workdir)
        yield root


def pending_children(exp, root, selected: list[dict], child_args, prefix: str = "") -> list:
    """A `flatlm.experiment_jobs.Child` for each selected run of `exp` in `root` not done yet."""
    steps = {r["name"]: run_config(exp, r).train.steps for r in selected}
    return experiment_jobs.children([(n, s) for n, s in steps.items() if not _done(root / "runs" / n, s)],
                                    child_args, root, prefix)


def _write_spec(exp, root, workdir: str) -> None:
    spec = root / "experiment.json"
    text = exp.to_json_best_effort(indent=1, sort_keys=True)
    defaults = {"base": json.loads(config_lib.base_config().to_json_best_effort()),  # fields added since at their
                "flatness": json.loads(json.dumps(FLATNESS_DEFAULTS))}  # defaults: no change
    diff = config_lib.changed_fields(json.loads(spec.read_text()), json.loads(text), defaults) if spec.exists() else []
    if diff:  # e.g. a preset changed since that workdir was made
        raise UserError(f"{workdir} holds a different experiment (fields {', '.join(diff[:5])}"
                        f"{', ...' if len(diff) > 5 else ''}); use a new --workdir")
    paths.write_text(spec, text)


def _run_experiment(exp, root, selected: list[dict], progress: bool) -> dict:
    status = {}
    for i, run in enumerate(selected):
        run_dir = root / "runs" / run["name"]
        config = run_config(exp, run)
        if _done(run_dir, config.train.steps):
            status[run["name"]] = "done earlier"
            continue
        if progress:
            print(f"[{i + 1}/{len(selected)}] {exp.name}/{run['name']}", file=sys.stderr)
        if not config.data.data_dir:  # one copy of each corpus / task split for all runs (keyed by content hash)
            config.data.data_dir = run_lib.data_dir(config, os.path.abspath(root) if not paths.is_cloud(root)
                                                    else os.fspath(root))
        t0 = time.time()
        train_and_evaluate(config, str(run_dir), progress=progress)
        if exp.evaluate:
            evaluate_pending(run_dir, progress)
        if exp.flatness.enabled:
            flatness_pending(run_dir, exp.flatness, progress)
        _mark_done(run_dir, config.train.steps, {"seconds": time.time() - t0})
        status[run["name"]] = "finished"
        run_lib.release_compiled()  # else every run's programs stay mapped until the process hits the kernel's limit
    return status


def _final_shape_steps(run_dir: Path) -> list[int]:
    """Checkpoint steps of the run's final depth (all of them, except earlier `train.stacking` stages')."""
    first = stacking.final_shape_from(stacking.stages_of(config_lib.load_workdir_config(str(run_dir))))
    return [s for s in ckpt.all_steps(str(run_dir)) if s >= first]


def evaluate_pending(run_dir: Path, progress: bool) -> None:
    """Evaluate the checkpoints of a run whose evaluation is missing or was cut short (`incomplete_steps`: a
    checkpoint with its probe but without its fine-tuning or layer probes is redone), and the lookup tables once."""
    entries = results_lib.load(str(run_dir))
    config = config_lib.load_workdir_config(str(run_dir))
    steps = incomplete_steps(config, entries, _final_shape_steps(run_dir))
    have = {e["kind"] for e in entries}
    if steps:
        evaluate_run(str(run_dir), steps, lookup=False if "lookup_table" in have else None, progress=progress,
                     lookup_words=False if "lookup_words" in have else None)


def flatness_pending(run_dir: Path, fcfg, progress: bool) -> None:
    """Measure flatness (`fcfg`: method, probes, batches, draws, grow_to; the spectrum and the preconditioned
    sharpness of the same checkpoints where it asks for them) of checkpoints that lack it (`measured_by`:
    a trace measured otherwise at a step, e.g. by `flatlm flatness`, does not count)."""
    have = {e["step"] for e in results_lib.load(str(run_dir)) if measured_by(e, fcfg)}
    final_shape = _final_shape_steps(run_dir)
    steps = [s for s in final_shape if s not in have]
    if steps:
        flatness_run(str(run_dir), steps=steps, method=fcfg.method, num_probes=fcfg.num_probes,
                     num_batches=fcfg.num_batches, batch_size=fcfg.batch_size, draws=fcfg.draws,
                     grow_to=tuple(fcfg.grow_to) or None, groups=fcfg.get("groups") or None, progress=progress,
                     spectrum_k=fcfg.get("spectrum_k", 0), density_probes=fcfg.get("density_probes", 0),
                     density_iters=fcfg.get("density_iters", 30), preconditioned=fcfg.get("preconditioned", False)
                     and config_lib.load_workdir_config(str(run_dir)).train.optimizer == "adamw",  # Adam's only
                     spectrum_steps=final_shape[-1:] if fcfg.get("spectrum_at", "all") == "last" else None)


def load_experiment(spec: str):
    """`configs/experiments/NAME.py[:ARG]` -> experiment ConfigDict."""
    exp = config_lib.load_config(spec)
    if "runs" not in exp or "base" not in exp:
        raise UserError(f"{spec} is not an experiment config (needs `base` and `runs`); see configs/experiments/")
    return exp
