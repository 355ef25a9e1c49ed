"""Evaluate a run's checkpoints: exact loss, linear probe, fine-tuning and the lookup-table baseline.

Results are appended to the run's `results.json` (a re-measurement replaces the entry it repeats, see
`flatlm.results.identity`); features are cached in
`<workdir>/features/` so re-probing a checkpoint skips the encoder pass. `flatlm evaluate` is the command.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import sys
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from flatlm import config as config_lib
from flatlm import locks, paths, sharding
from flatlm import results as results_lib
from flatlm.errors import UserError
from flatlm.evaluate.exact_loss import exact_loss
from flatlm.evaluate.finetune import FinetuneConfig, finetune, recorded_config
from flatlm.evaluate.lookup import run_lookup_probe
from flatlm.evaluate.probe import ProbeConfig, probe_checkpoint
from flatlm.run import Run, load_run
from flatlm.run import task_names as run_task_names


def run_exact_loss(run: Run, params, limit: int | None = None) -> dict:
    """Exact pre-training loss (entropy + KL, nats per masked position) on the run's validation split."""
    bs = run.config.eval.batch_size
    with sharding.activated(run.mesh, run.rules):
        return exact_loss(run.apply_fn, params, run.eval_batches(bs, limit), run.config.eval.num_subsets,
                          pad_to=bs, average=run.config.eval.get("loss_average", "token"))


def headline(out: dict, labels: dict | None = None) -> dict:
    """The headline accuracy of a probe / fine-tuning result: test split if present, else validation, else train;
    with `labels` ({split: int labels}) also that split's majority-class rate, the accuracy of predicting one
    class (a head at or below it has learned nothing: `flatlm report` marks it)."""
    acc = out["accuracy"]
    split = next(s for s in ("test", "validation", "val", "train") if s in acc)
    head = {"split": split, "accuracy": acc[split]["mean"], "accuracy_std": acc[split]["std"]}
    if labels is not None and split in labels and len(labels[split]):
        head["majority"] = float(np.bincount(np.asarray(labels[split])).max() / len(labels[split]))
    return head


def feature_cache_dir(workdir: str) -> str:
    """Where probe features are cached (np.savez, local files): `<workdir>/features`; for a workdir in a bucket, a
    local folder named by a hash of the workdir under ~/.cache/flatlm/features (a cache: losing it costs time)."""
    if not paths.is_cloud(workdir):
        return os.path.join(workdir, "features")
    digest = hashlib.sha256(os.fspath(workdir).encode()).hexdigest()[:16]
    return os.path.join(os.path.expanduser("~"), ".cache", "flatlm", "features", digest)


def with_eval_overrides(config, overrides) -> object:
    """A copy of a run's config with `--config.eval.a.b=value` overrides applied: how a run is evaluated may change
    after training (e.g. the fine-tuning protocol), what was trained may not, so other sections are refused."""
    bad = [o for o in overrides if not o.removeprefix("--").removeprefix("config.").startswith("eval.")]
    if bad:
        raise UserError(f"{bad[0]!r}: evaluating a trained run takes overrides of its eval section only "
                        "(--config.eval.X=Y); train a new run to change anything else")
    return config_lib.apply_overrides(copy.deepcopy(config), list(overrides))


def incomplete_steps(config, entries: list[dict], steps: list[int]) -> list[int]:
    """The steps of `steps` lacking part of what `evaluate_run` writes there with the config's own settings (the
    exact loss; per task the last layer's probe, each `eval.probe.layers` probe and, with fine-tuning on, the
    fine-tuned accuracy): an evaluation interrupted midway is redone, never counted as finished."""
    layers = tuple(config.eval.probe.get("layers") or ())
    want = [("exact_loss", None, None)]
    for t in run_task_names(config):
        want += [("probe", t, None)] + [("layer_probe", t, k) for k in layers]
        want += [("finetune", t, None)] if config.eval.finetune.enabled else []
    have = {(e["kind"], e["step"], e.get("task"), e.get("layer")) for e in entries}
    return [s for s in steps if any((kind, s, t, k) not in have for kind, t, k in want)]


def evaluate_run(workdir: str, steps: list[int] | None = None, tasks: tuple[str, ...] = (), probe: bool = True,
                 finetune_: bool | None = None, lookup: bool | None = None, exact: bool = True,
                 progress: bool = True, overrides: tuple[str, ...] = (),
                 lookup_words: bool | None = None) -> list[dict]:
    """Evaluate checkpoints `steps` (default: all) of the run in `workdir`; returns the new entries, which are
    also appended to its results.json. `finetune_` / `lookup` / `lookup_words` (the lookup table, and the table with
    the words, each probed once per run, not per step) default to the config's `eval` section, after
    `overrides` of that section (`with_eval_overrides`; each entry's `detail` records the settings it used).
    With `eval.finetune.from_init`, the run's initialisation is also fine-tuned ("finetune_init", step None), once
    per task and fine-tuning protocol (a later call finds it in results.json).
    Holds the workdir's lock (`flatlm.locks.exclusive`): another writer there stops with one line."""
    # no dir: load_run says why; in a multi-host run process 0 holds the lock for all (only it writes)
    with locks.exclusive(workdir, "evaluating", enabled=os.path.isdir(workdir) and jax.process_index() == 0):
        return _evaluate_run(workdir, steps, tasks, probe, finetune_, lookup, lookup_words, exact, progress,
                             overrides)


def _evaluate_run(workdir: str, steps, tasks, probe: bool, finetune_, lookup, lookup_words, exact: bool,
                  progress: bool, overrides) -> list[dict]:
    run = load_run(workdir, quiet=not progress)
    if overrides:
        run = dataclasses.replace(run, config=with_eval_overrides(run.config, overrides))
    c = run.config
    chosen = run.steps if steps is None else list(steps)
    names = tuple(tasks) or run.task_names()
    classes = {t: run.num_classes(t) for t in names}
    do_ft = c.eval.finetune.enabled if finetune_ is None else finetune_
    do_lookup = c.eval.lookup if lookup is None else lookup
    do_words = c.eval.lookup_words if lookup_words is None else lookup_words  # C5's control (flatlm.evaluate.lookup)
    probe_cfg = ProbeConfig(**c.eval.probe, seed=c.seed)
    data = {t: run.load_task(t, quiet=not progress) for t in names} if probe or do_ft or probe_cfg.layers else {}
    split = lambda t, key: {s: v[key] for s, v in data[t].items()}  # noqa: E731 - split -> array
    ft_cfg = FinetuneConfig(**c.eval.finetune, seed=c.seed)
    cache = feature_cache_dir(workdir)
    entries: list[dict] = []

    clock = [time.perf_counter()]

    def add(entry):  # stamped with the seconds its measurement took (benchmarks/reproduce_suite.py adds them up)
        now = time.perf_counter()
        entries.append({**entry, "seconds": now - clock[0]})
        results_lib.append(workdir, [entries[-1]])
        clock[0] = time.perf_counter()

    for with_words in [w for w, on in ((False, do_lookup), (True, do_words)) if on and probe]:
        for t in names:
            out = run_lookup_probe(run.language, split(t, "tokens"), split(t, "length"), split(t, "label"), probe_cfg,
                                   cache_dir=cache, num_classes=classes[t], progress=progress, with_words=with_words)
            add({"kind": out["kind"], "step": None, "task": t, **headline(out, split(t, "label")), "detail": out})

    def tune(params, t):
        return finetune(run.apply_fn, params, split(t, "tokens"), split(t, "label"), ft_cfg, num_classes=classes[t],
                        num_words=run.num_words, max_len=run.language.max_length + 1, progress=progress)

    if do_ft and ft_cfg.from_init:  # the control: the same fine-tuning from the weights training started at
        same = recorded_config(ft_cfg)  # measured once per protocol: a later `evaluate` of other steps reuses it
        done = {e.get("task") for e in results_lib.load(workdir)
                if e["kind"] == "finetune_init" and e.get("detail", {}).get("config") == same}
        params0 = run.init_params() if set(names) - done else None
        for t in (t for t in names if t not in done):
            out = tune(params0, t)
            add({"kind": "finetune_init", "step": None, "task": t, **headline(out, split(t, "label")), "detail": out})
    for step, params in run.checkpoint_params(tqdm(chosen, desc="checkpoints", disable=not progress,
                                                   file=sys.stderr)):
        clock[0] = time.perf_counter()  # restoring the checkpoint is not the first measurement's time
        if exact:
            add({"kind": "exact_loss", "step": step, **run_exact_loss(run, params)})
        for t in names:
            for layer in ([None] if probe else []) + list(probe_cfg.layers):  # None: the last layer (the paper's)
                out = probe_checkpoint(run.apply_fn, params, split(t, "tokens"), split(t, "label"), probe_cfg,
                                       step=step, cache_dir=cache, num_classes=classes[t], progress=progress,
                                       layer=layer)
                kind = {"kind": "probe"} if layer is None else {"kind": "layer_probe", "layer": layer}
                add({**kind, "step": step, "task": t, **headline(out, split(t, "label")), "detail": out})
            if do_ft:
                out = tune(params, t)
                add({"kind": "finetune", "step": step, "task": t, **headline(out, split(t, "label")), "detail": out})
    return entries


def table_rows(entries: list[dict]) -> list[dict]:
    """One row per step (the lookup table and the fine-tuned initialisation as rows of their own): exact loss and
    KL, then `<kind>:<task>` accuracies."""
    rows: dict = {}
    for e in entries:
        key = {"lookup_table": "lookup", "finetune_init": "init"}.get(e["kind"], e["step"])
        row = rows.setdefault(key, {"step": key})
        if e["kind"] == "exact_loss":
            row.update(loss=e["loss"], entropy=e["entropy"], kl=e["kl"], log_kl=e["log_kl"])
        elif "accuracy" in e:
            kind = {"lookup_table": "probe", "finetune_init": "finetune"}.get(e["kind"], e["kind"])
            kind = f"probe-layer{e['layer']}" if kind == "layer_probe" else kind
            row[f"{kind}:{e['task']}"] = f"{100 * e['accuracy']:.1f}±{100 * e['accuracy_std']:.1f}"
    return list(rows.values())
