"""`flatlm report DIR...`: finished runs -> a markdown report with PNG and PDF plots (`flatlm.report_plots`).

DIR may be a run workdir (config.json) or an experiment workdir (runs/*/). Plots: exact loss and ln KL vs steps;
downstream accuracy vs steps (mean ± std over pre-training seeds); accuracy vs model size at equal loss; each
flatness estimator vs steps and vs accuracy with Spearman's rank correlation and a bootstrap 95% interval; and the
Table 1/2 layout (mean ± std over seeds). Error bars wherever a std or standard error was measured.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from scipy.stats import spearmanr

from flatlm import paths, report_curvature, report_paired, report_stacking
from flatlm import report_plots as plots
from flatlm import results as results_lib
from flatlm.config import load_workdir_config, run_dirs
from flatlm.errors import UserError
from flatlm.languages import make_language
from flatlm.metrics import read_metrics
from flatlm.models import make_model, model_config
from flatlm.report_curvature import ESTIMATOR_LABELS, estimator_key, estimator_label, plot_name
from flatlm.report_plots import SEED_SUFFIX, subplots  # noqa: F401 - public names of this module too


@dataclass
class RunData:
    """One run as the report sees it: its config, exact-loss evals (metrics.jsonl) and results.json entries."""
    name: str
    path: paths.Path
    config: dict
    evals: list[dict]
    results: list[dict]
    num_params: int | None = None
    extra: dict = field(default_factory=dict)

    def probe(self, task: str | None = None) -> dict[int, dict]:
        """step -> latest probe entry (for `task`, or the first task)."""
        out = {}
        for e in self.results:
            if e["kind"] == "probe" and (task is None or e.get("task") == task):
                out[e["step"]] = e
        return out

    def by_kind(self, kind: str, split: str = "validation") -> dict:
        """step -> latest results entry of `kind` (e.g. "exact_loss") measured on `split` (`flatlm flatness
        --split`; entries without one are validation's). Not for "flatness": see `flatness`."""
        return {e["step"]: e for e in self.results
                if e["kind"] == kind and results_lib.split_of(e) == split}

    def flatness(self, estimator: tuple) -> dict:
        """step -> latest flatness entry of one estimator (`estimator_key`): traces of different estimators
        (the Hessian's, the Fisher's, the empirical Fisher's) are different quantities and are never mixed."""
        return {e["step"]: e for e in self.results if e["kind"] == "flatness" and estimator_key(e) == estimator}


# What each flatness method measures (flatlm.flatness.compare.measure); a report names every value by its estimator
def estimators(runs: list[RunData]) -> list[tuple]:
    """Every flatness estimator measured in `runs`, in a fixed order."""
    keys = {estimator_key(e) for r in runs for e in r.results if e["kind"] == "flatness"}
    order = list(ESTIMATOR_LABELS)
    return sorted(keys, key=lambda k: (order.index(k[0]) if k[0] in order else len(order), k[0], k[1] or ()))


def find_runs(dirs: list[str]) -> list[RunData]:
    """The runs under each dir: the dir itself if it is a run, else its experiment's runs/* in run order."""
    runs = []
    for d in dirs:
        candidates = run_dirs(d)
        if not candidates:
            raise UserError(f"{d} holds no flatlm run (no config.json, no runs/*/config.json)")
        for c in candidates:
            rows = read_metrics(str(c))
            ranks = [m for m in rows if any(k.startswith("rank/") for k in m)]  # train.rank_every
            runs.append(RunData(name=c.name, path=c,
                                config=json.loads((c / "config.json").read_text()),
                                evals=[m for m in rows if "eval/loss" in m],
                                results=results_lib.load(str(c)), extra={"ranks": ranks} if ranks else {}))
    return runs


_PARAM_COUNTS: dict[tuple[str, str], int] = {}  # (language, model) configs as JSON -> count: seeds share a model


def param_count(run: RunData) -> int | None:
    """Number of parameters of the run's model (abstract init; nothing is allocated). Counted once per language
    and model config in a process: a size sweep over seeds repeats each model (C2's reports: 18 runs, 6 models)."""
    cfg = load_workdir_config(str(run.path))
    key = (cfg.language.to_json_best_effort(sort_keys=True), cfg.model.to_json_best_effort(sort_keys=True))
    if key not in _PARAM_COUNTS:
        lang = make_language(cfg.language)
        model = make_model(model_config(cfg.model, lang.vocab_size, lang.max_length + 1))
        shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, lang.max_length), jnp.int32)))
        _PARAM_COUNTS[key] = int(sum(x.size for x in jax.tree.leaves(nn.unbox(shapes))))
    return _PARAM_COUNTS[key]


def spearman_with_ci(x, y, n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Spearman's rho and a percentile bootstrap 95% interval (pairs resampled).

    Our own loop, not `scipy.stats.bootstrap(paired=True, method="percentile")`: a resample whose x or y is
    constant has no rank correlation (NaN), and scipy then returns a NaN interval (checked: scipy 1.17, 5 points);
    this loop drops such resamples, so small sets of checkpoints still get an interval."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    rho = float(spearmanr(x, y).statistic)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        idx = rng.integers(0, len(x), len(x))
        if np.ptp(x[idx]) > 0 and np.ptp(y[idx]) > 0:
            boots.append(spearmanr(x[idx], y[idx]).statistic)
    lo, hi = (np.percentile(boots, [2.5, 97.5]) if boots else (math.nan, math.nan))
    return rho, float(lo), float(hi)


def _tasks(runs: list[RunData]) -> list[str]:
    return sorted({e["task"] for r in runs for e in r.results if e.get("task")})


def _pm(mean, std, scale=100.0, digits=1) -> str:
    return "-" if mean is None else f"{scale * mean:.{digits}f} ± {scale * (std or 0):.{digits}f}"


MAJORITY_MARK = " †"  # accuracy at or below the majority-class rate (+ 0.5 pp): the head predicts ~one class


def _acc_cell(e: dict) -> str:
    """A probe / fine-tuning entry's `mean ± std` (%), marked when it is no better than predicting one class."""
    low = "majority" in e and e["accuracy"] <= e["majority"] + 0.005
    lr = f" (lr {e['detail']['lr']:g})" if "lr_selection" in e.get("detail", {}) else ""  # chosen on validation
    return _pm(e["accuracy"], e["accuracy_std"]) + lr + (MAJORITY_MARK if low else "")


def grid_edge_note(runs: list[RunData]) -> list[str]:
    """A note when fine-tuning chose its rate at an end of `eval.finetune.lr_grid`: the validation optimum may lie
    beyond the grid, so those accuracies may understate what a wider grid gives."""
    chosen = [(e["detail"]["lr"], e["detail"]["lr_selection"]["grid"]) for r in runs for e in r.results
              if e["kind"] in ("finetune", "finetune_init") and "lr_selection" in e.get("detail", {})]
    ends = {"largest": [lr for lr, grid in chosen if len(grid) > 1 and lr == max(grid)],
            "smallest": [lr for lr, grid in chosen if len(grid) > 1 and lr == min(grid)]}
    count = sum(map(len, ends.values()))
    if not count:
        return []
    said = " and ".join(f"{len(v)} at its {end} rate ({', '.join(f'{x:g}' for x in sorted(set(v)))})"
                        for end, v in ends.items() if v)
    return [f"\nFine-tuning chose its rate at an end of the grid in {count} of {len(chosen)} fine-tunings "
            f"({said}): the best rate on validation may lie outside the grid, so these accuracies may understate "
            "what a wider `eval.finetune.lr_grid` gives."]


def _tuned(run: RunData, task: str, kind: str = "finetune") -> dict:
    """{step: entry} of a run's fine-tuning results on `task` (the last of each step); kind "finetune_init" (the
    fine-tuned initialisation, `eval.finetune.from_init`) has one step, None."""
    return {e["step"]: e for e in run.results if e["kind"] == kind and e.get("task") == task}


def _last(entries: dict) -> dict | None:
    """The entry of the largest step (None counts as the only step)."""
    return entries[max(entries, key=lambda s: -1 if s is None else s)] if entries else None


def make_report(dirs: list[str], out: str | None = None, control: str | None = None) -> Path:
    """Write `report.md` and its PNG plots for the runs under `dirs` into `out` (default <dirs[0]>/report).
    `control`: the arm (run name without `-seed<k>`) the paired table compares every other arm against (default:
    the first arm in the runs' order)."""
    runs = find_runs(dirs)
    arms = list(plots.by_seed(runs))
    if control is not None and control not in arms:
        raise UserError(f"--control {control!r} is not an arm of these runs; use one of {', '.join(arms)}")
    for r in runs:
        try:
            r.num_params = param_count(r)
        except Exception:  # noqa: BLE001 - a run whose config no longer builds still gets its curves
            r.num_params = None
    target = paths.path(out or paths.path(dirs[0], "report"))
    with paths.local_copy_dir(target) as local:  # matplotlib writes local files; a bucket gets them uploaded
        _write_report(runs, dirs, Path(local), control)
    return target / "report.md"


def _write_report(runs: list[RunData], dirs: list[str], out_dir: Path, control: str | None = None) -> None:
    tasks = _tasks(runs)
    md = [f"# flatlm report\n\nRuns: {', '.join(r.name for r in runs)} (from {', '.join(dirs)}).\n"]

    # 1. exact loss and ln KL vs steps
    plots.save(plots.loss_vs_steps(runs), out_dir / "loss_vs_steps.png")
    md.append("## Pre-training loss\n\n![loss](loss_vs_steps.png) ([pdf](loss_vs_steps.pdf))\n")

    # 2. downstream accuracy vs steps: mean ± std over the pre-training seeds of each method
    if tasks:
        plots.save(plots.accuracy_vs_steps(runs, tasks), out_dir / "accuracy_vs_steps.png")
        md.append("## Downstream accuracy (linear probe; mean ± std over pre-training seeds)\n\n"
                  "![accuracy](accuracy_vs_steps.png) ([pdf](accuracy_vs_steps.pdf))\n")

    # 3. accuracy vs model size at equal loss
    sized = [r for r in runs if r.num_params and r.probe()]
    if len({r.num_params for r in sized}) > 1:
        plots.save(plots.accuracy_vs_size(sized, tasks), out_dir / "accuracy_vs_size.png")
        md.append("## Accuracy vs model size (final checkpoints; exact loss annotated)\n\n"
                  "![size](accuracy_vs_size.png) ([pdf](accuracy_vs_size.pdf))\n")

    # 4a. flatness vs steps (Figure 3's panel): one plot per estimator, never two estimators on one axis
    ests = estimators(runs)
    for i, key in enumerate(ests):
        fig, ax = subplots()
        for r in runs:
            fl = r.flatness(key)
            s = sorted(fl)
            if s:
                ax.errorbar(s, [fl[k]["trace"] for k in s], [fl[k]["trace_stderr"] for k in s], fmt="o-", ms=3,
                            capsize=2, label=r.name)
        ax.set(xlabel="step", ylabel=estimator_label(key), title="flatness along training")
        ax.legend(fontsize=7)
        name = plot_name("trace_vs_steps", i)
        plots.save(fig, out_dir / f"{name}.png")
        md.append(f"## {estimator_label(key)} along training\n\n![trace]({name}.png)\n")

    # 4. flatness vs accuracy with rank correlation, per estimator
    for i, key in enumerate(ests):
        pairs = []
        for r in runs:
            fl = r.flatness(key)
            for step, e in r.probe(tasks[0] if tasks else None).items():
                if step in fl:
                    pairs.append((fl[step]["trace"], e["accuracy"], r.name, fl[step]["trace_stderr"],
                                  e.get("accuracy_std", 0.0)))
        if len(pairs) < 3:
            continue
        rho, lo, hi = spearman_with_ci([p[0] for p in pairs], [p[1] for p in pairs])
        fig, ax = subplots()
        for run_name in sorted({p[2] for p in pairs}):
            pts = [p for p in pairs if p[2] == run_name]
            ax.errorbar([p[0] for p in pts], [100 * p[1] for p in pts], [100 * p[4] for p in pts],
                        [p[3] for p in pts], fmt="o", ms=4, capsize=2, label=run_name)
        ax.set(xlabel=estimator_label(key), ylabel=f"probe accuracy (%), task {tasks[0] if tasks else ''}",
               title=f"Spearman ρ = {rho:.2f} [{lo:.2f}, {hi:.2f}]")
        ax.legend(fontsize=7)
        name = plot_name("flatness_vs_accuracy", i)
        plots.save(fig, out_dir / f"{name}.png")
        md.append(f"## {estimator_label(key)} vs accuracy\n\nSpearman's ρ = {rho:.3f}, bootstrap 95% interval "
                  f"[{lo:.3f}, {hi:.3f}] over {len(pairs)} checkpoints.\n\n![flatness]({name}.png)\n")

    md += report_curvature.sections(runs, ests, out_dir)  # 4a'-4a''': per block, spectrum, sharpness

    # 4b. what training adds: rank of W - W0 per weight matrix (train.rank_every), one panel per run
    ranked = [r for r in runs if r.extra.get("ranks")]
    if ranked:
        plots.save(plots.rank_vs_steps(ranked[:6]), out_dir / "rank_vs_steps.png")
        md.append("## Rank of W - W0 along training (numerical rank, singular values > 1e-3 of the largest)\n\n"
                  "![rank](rank_vs_steps.png) ([pdf](rank_vs_steps.pdf))\n")

    # 5. Table 1/2 layout: last checkpoint of every run, plus the lookup table
    init_tasks = [t for t in tasks if any(_tuned(r, t, "finetune_init") for r in runs)]
    header = ["run", "params", "exact loss", "KL"] + [f"probe {t} (%)" for t in tasks] + \
             [f"fine-tune {t} (%)" for t in tasks] + [f"fine-tune {t} from init (%)" for t in init_tasks] + \
             [estimator_label(k) for k in ests]
    rows = []
    for r in runs:
        ex = r.by_kind("exact_loss")
        last = max(ex) if ex else None
        probe_cells = []
        for t in tasks:
            p = r.probe(t)
            probe_cells.append(_acc_cell(p[max(p)]) if p else "-")
        tuned = [_last(_tuned(r, t)) for t in tasks] + [_last(_tuned(r, t, "finetune_init")) for t in init_tasks]
        ft_cells = [_acc_cell(e) if e else "-" for e in tuned]
        tr = [f"{fl[max(fl)]['trace']:.4g} ± {fl[max(fl)]['trace_stderr']:.2g}" if fl else "-"
              for fl in (r.flatness(k) for k in ests)]
        loss = f"{ex[last]['loss']:.4f} ± {ex[last]['loss_std']:.4f}" if last is not None else "-"
        kl = f"{ex[last]['kl']:.2e}" if last is not None else "-"
        rows.append([r.name, f"{r.num_params:,}" if r.num_params else "-", loss, kl, *probe_cells, *ft_cells, *tr])
    for (kind, label, _), t in itertools.product(plots.LOOKUPS, tasks):  # the lookup table(s), per task
        look = [e for r in runs for e in r.results if e["kind"] == kind and e.get("task") == t]
        if look:
            cells = ["-"] * len(tasks)
            accs = plots.lookup_accuracies(runs, t, kind)  # one per run: several runs give their mean ± std
            cells[tasks.index(t)] = (_pm(look[-1]["accuracy"], look[-1]["accuracy_std"]) if len(accs) == 1 else
                                     _pm(np.mean(accs), np.std(accs, ddof=1)))
            name = f"{label} ({t})" if len(accs) == 1 else f"{label} ({t}, mean over {len(accs)} runs)"
            ent = runs[0].evals[-1]["eval/entropy"] if runs[0].evals and kind == "lookup_table" else None
            rows.append([name, "-", f"{ent:.4f} (= entropy)" if ent else "-", "0" if kind == "lookup_table" else "-",
                         *cells, *(["-"] * (len(tasks) + len(init_tasks))), *(["-"] * len(ests))])
    md.append("## Table (last checkpoint of each run; mean ± std over probe / fine-tuning seeds)\n")
    md.append("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    md += ["| " + " | ".join(row) + " |" for row in rows]
    if any(MAJORITY_MARK in c for row in rows for c in row):
        md.append(f"\n{MAJORITY_MARK.strip()} at or below the majority-class rate of its split (within 0.5 pp): the "
                  "head predicts (almost) one class, so this accuracy carries no signal about the encoder.")
    md += grid_edge_note(runs)
    seed_rows = seed_table(runs, tasks, init_tasks)
    if seed_rows:
        head = ["run", "seeds", "exact loss", "KL"] + [f"probe {t} (%)" for t in tasks] + \
               [f"fine-tune {t} (%)" for t in tasks] + [f"fine-tune {t} from init (%)" for t in init_tasks] + \
               [estimator_label(k) for k in ests]
        md.append("\n## Table over pre-training seeds (last checkpoint; mean ± std over the runs `<name>-seed<k>`)\n")
        md.append("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        md += ["| " + " | ".join(row) + " |" for row in seed_rows]
    stacked = report_stacking.sections(runs, control)  # runs with train.stacking: compute used, arms vs plain
    if stacked:
        md += ["", *stacked]
    else:  # an experiment's arms over seeds against its first arm (flatlm.report_paired)
        md += report_paired.arms_vs_control(runs, control)
    md += report_paired.probe_by_layer(runs, control)
    layer_fig = report_paired.probe_by_layer_figure(runs)
    if layer_fig is not None:
        plots.save(layer_fig, out_dir / "probe_by_layer.png")
        md.append("\n![probe by layer](probe_by_layer.png) ([pdf](probe_by_layer.pdf))")
    md += report_paired.pretraining_gain(runs)
    paths.write_text(out_dir / "report.md", "\n".join(md) + "\n")




def _last_value(entries: dict, key: str) -> float | None:
    return float(_last(entries)[key]) if entries else None


def seed_table(runs: list[RunData], tasks: list[str], init_tasks: list[str] = ()) -> list[list[str]]:
    """Rows of mean ± std over pre-training seeds for runs named `<name>-seed<k>` (groups of >= 2 runs): the
    last checkpoint's exact loss, KL, probe / fine-tuning accuracy (each run's mean over its own seeds), the
    fine-tuned initialisation's on `init_tasks`, and one flatness column per estimator (`estimators`)."""
    groups: dict[str, list[RunData]] = {}
    for r in runs:
        name, seed = plots.split_seed(r.name)
        if seed is not None:  # only runs repeated over seeds
            groups.setdefault(name, []).append(r)

    def cell(values, fmt) -> str:
        v = np.asarray([x for x in values if x is not None], np.float64)
        return "-" if v.size == 0 else f"{fmt(v.mean())} ± {fmt(v.std(ddof=1) if v.size > 1 else 0.0)}"

    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    rows = []
    for name, members in groups.items():
        if len(members) < 2:
            continue
        ex = [r.by_kind("exact_loss") for r in members]
        row = [name, str(len(members)), cell([_last_value(e, "loss") for e in ex], lambda x: f"{x:.4f}"),
               cell([_last_value(e, "kl") for e in ex], lambda x: f"{x:.2e}")]
        row += [cell([_last_value(r.probe(t), "accuracy") for r in members], pct) for t in tasks]
        row += [cell([_last_value(_tuned(r, t), "accuracy") for r in members], pct) for t in tasks]
        row += [cell([_last_value(_tuned(r, t, "finetune_init"), "accuracy") for r in members], pct)
                for t in init_tasks]
        row += [cell([_last_value(r.flatness(k), "trace") for r in members], lambda x: f"{x:.4g}")
                for k in estimators(runs)]
        rows.append(row)
    return rows
