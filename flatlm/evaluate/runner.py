"""`flatlm evaluate`: every (or the chosen) checkpoint of a run -> exact loss, probe and fine-tune accuracy.

Results are appended to the run's `results.json` (never overwriting earlier ones); features are cached in
`<workdir>/features/` so re-probing a checkpoint skips the encoder pass.
"""

from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm

from flatlm import results as results_lib
from flatlm.data import tasks as tasks_lib
from flatlm.errors import UserError
from flatlm.evaluate.finetune import FinetuneConfig, finetune
from flatlm.evaluate.lookup import run_lookup_probe
from flatlm.evaluate.probe import ProbeConfig, model_feature_fn, probe_checkpoint

DEFAULT_TASKS = {"hmm": ("k6", "k10"), "pcfg": ("A", "B", "C")}


def task_names(config, language) -> tuple[str, ...]:
    tasks = tuple(config.eval.tasks) or DEFAULT_TASKS.get(config.language.name, ())
    for t in tasks:
        tasks_lib.check_task(language, config.language.name, t)
    return tasks


def probe_config(config) -> ProbeConfig:
    p = config.eval.probe
    return ProbeConfig(learning_rate=p.lr, weight_decay=p.weight_decay, epochs=p.epochs, batch_size=p.batch_size,
                       warmup_steps=p.warmup_steps, num_seeds=p.num_seeds, standardize=p.standardize,
                       projection_dim=p.projection_dim or None, seed=config.seed)


def finetune_config(config) -> FinetuneConfig:
    f = config.eval.finetune
    return FinetuneConfig(learning_rate=f.lr, weight_decay=f.weight_decay, epochs=f.epochs, batch_size=f.batch_size,
                          warmup_steps=f.warmup_steps, num_seeds=f.num_seeds, seed=config.seed)


def load_task(run, task: str, quiet: bool = False) -> dict:
    from flatlm.train.loop import data_dir

    c = run.config
    sizes = (c.eval.task_train_size, c.eval.task_eval_size, c.eval.task_eval_size)
    return tasks_lib.build_task(c.language.to_dict(), task, data_dir(c, run.workdir), sizes, seed=c.seed,
                                definition=c.eval.task_definition, quiet=quiet)


def parse_steps(spec: str, available: list[int]) -> list[int]:
    if not available:
        raise UserError("the run has no checkpoints yet; train it first (flatlm train ...)")
    if spec in ("all", ""):
        return available
    if spec in ("last", "latest"):
        return available[-1:]
    try:
        wanted = [int(s) for s in spec.split(",")]
    except ValueError:
        raise UserError(f"--steps {spec!r} is not all, last or a comma-separated list of steps") from None
    missing = [s for s in wanted if s not in available]
    if missing:
        raise UserError(f"no checkpoint at step(s) {missing}; available: {available}")
    return wanted


def evaluate_run(workdir: str, steps: str = "all", tasks: tuple[str, ...] = (), probe: bool = True,
                 finetune_: bool | None = None, lookup: bool | None = None, exact: bool = True,
                 progress: bool = True) -> list[dict]:
    """Evaluate checkpoints of the run in `workdir`; returns (and appends to results.json) the new entries."""
    from flatlm.train.loop import evaluate_exact_loss, load_run

    run = load_run(workdir, quiet=not progress)
    c = run.config
    chosen = parse_steps(steps, run.steps)
    names = tuple(tasks) or task_names(c, run.language)
    for t in names:
        tasks_lib.check_task(run.language, c.language.name, t)
    data = {t: load_task(run, t, quiet=not progress) for t in names} if names and (probe or finetune_) else {}
    do_ft = c.eval.finetune.enabled if finetune_ is None else finetune_
    do_lookup = c.eval.lookup if lookup is None else lookup
    pcfg = probe_config(c)
    feature_fn = model_feature_fn(run.model)
    cache = os.path.join(workdir, "features")
    entries: list[dict] = []

    def add(entry):
        entries.append(entry)
        results_lib.append(workdir, [entry])

    if do_lookup and probe:
        for t in names:
            d = data[t]
            out = run_lookup_probe(run.language, {s: v["tokens"] for s, v in d.items()},
                                   {s: v["length"] for s, v in d.items()}, {s: v["label"] for s, v in d.items()},
                                   pcfg, cache_dir=cache, num_classes=tasks_lib.num_classes(run.language,
                                                                                            c.language.name, t),
                                   progress=progress)
            add({"kind": "lookup_table", "step": None, "task": t, **_acc(out), "detail": out})
    for step in tqdm(chosen, desc="checkpoints", disable=not progress, file=sys.stderr):
        params = run.load_params(step)
        if exact:
            add({"kind": "exact_loss", "step": step, **evaluate_exact_loss(run, params)})
        for t in names:
            d = data[t]
            k = tasks_lib.num_classes(run.language, c.language.name, t)
            toks = {s: v["tokens"] for s, v in d.items()}
            labels = {s: v["label"] for s, v in d.items()}
            if probe:
                out = probe_checkpoint(feature_fn, params, toks, labels, pcfg, step=step, cache_dir=cache,
                                       num_classes=k, progress=progress)
                add({"kind": "probe", "step": step, "task": t, **_acc(out), "detail": out})
            if do_ft:
                out = finetune(run.model, params, toks, labels, finetune_config(c), num_classes=k,
                               progress=progress)
                add({"kind": "finetune", "step": step, "task": t, **_acc(out), "detail": out})
    return entries


def _acc(out: dict) -> dict:
    """Headline accuracy: test split if present, else validation, else train."""
    acc = out["accuracy"]
    split = next(s for s in ("test", "validation", "val", "train") if s in acc)
    return {"split": split, "accuracy": acc[split]["mean"], "accuracy_std": acc[split]["std"]}


def table_rows(entries: list[dict]) -> list[dict]:
    """One row per (step): exact loss and KL, then `<kind>:<task>` accuracy columns."""
    rows: dict = {}
    for e in entries:
        key = "lookup" if e["kind"] == "lookup_table" else e["step"]
        row = rows.setdefault(key, {"step": key})
        if e["kind"] == "exact_loss":
            row.update(loss=e["loss"], entropy=e["entropy"], kl=e["kl"], log_kl=e["log_kl"])
        elif "accuracy" in e:
            kind = "probe" if e["kind"] in ("probe", "lookup_table") else e["kind"]
            row[f"{kind}:{e['task']}"] = f"{100 * e['accuracy']:.1f}±{100 * e['accuracy_std']:.1f}"
    return list(rows.values())


def add_parser(sub) -> None:
    p = sub.add_parser("evaluate", help="exact loss, linear probe and fine-tuning of a run's checkpoints")
    p.add_argument("--workdir", required=True)
    p.add_argument("--steps", default="all", help="all | last | comma-separated steps")
    p.add_argument("--task", action="append", default=[], help="a downstream task (repeatable); default: config's")
    p.add_argument("--no-probe", action="store_true")
    p.add_argument("--no-finetune", action="store_true")
    p.add_argument("--no-lookup", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    import json

    from flatlm.cli import print_table

    entries = evaluate_run(args.workdir, args.steps, tuple(args.task), probe=not args.no_probe,
                           finetune_=False if args.no_finetune else None, lookup=False if args.no_lookup else None,
                           progress=not args.quiet)
    rows = table_rows(entries)
    if args.json:
        print(json.dumps({"workdir": args.workdir, "rows": rows,
                          "entries": [{k: v for k, v in e.items() if k != "detail"} for e in entries]}))
        return 0
    cols = [("step", "step", "")] + [(k, k, ".4f") for k in ("loss", "entropy", "kl")]
    extra = sorted({k for r in rows for k in r if ":" in k})
    print_table(rows, cols + [(k, k + " %", "s") for k in extra])
    print(f"appended {len(entries)} results to {os.path.join(args.workdir, 'results.json')}")
    return 0

