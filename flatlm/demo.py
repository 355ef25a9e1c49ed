"""`flatlm demo`: the paper's story on a small language, end to end on a laptop CPU in a few minutes.

It builds a small corpus with exact conditionals, pre-trains a small BERT, and reports for each checkpoint the
exact pre-training loss split into entropy + KL, the linear-probe accuracy on a downstream task (with the
lookup-table baseline: a probe on the exact conditionals, i.e. a model with the optimal loss) and the trace of
the Hessian (flatness). Everything is written to the workdir.
"""

from __future__ import annotations

import sys

from flatlm import results as results_lib
from flatlm.config import base_config

TASK = "A"


def demo_config(steps: int = 0):
    """The demo's embedded default: a PCFG of the paper's shape (random_grammar(0): 49 nonterminals below the
    root, 200 words, sentences of 2..16 words) and a 2-layer d=128 pre-LN BERT; downstream task A."""
    c = base_config()
    c.language.update(name="pcfg", seed=0)
    c.data.update(train_size=20_000, eval_size=256, batch_size=128)
    c.model.update(kind="bert", d_model=128, num_layers=2, dropout=0.0, attention_dropout=0.0)
    c.train.update(steps=steps or 800, lr=2e-3, warmup_frac=0.06, schedule="linear", log_every=50)
    c.train.eval_every = max(1, c.train.steps // 4)
    c.checkpoint.update(every=c.train.eval_every, keep=10)
    c.eval.update(tasks=(TASK,), task_train_size=4_000, task_eval_size=1_000, batch_size=64)
    c.eval.probe.update(epochs=15, num_seeds=3)
    c.eval.finetune.enabled = False
    c.config_spec = "flatlm.demo:demo_config"
    return c


def run(workdir: str, steps: int = 0, progress: bool = True, flatness: bool = True) -> dict:
    from flatlm.evaluate.runner import evaluate_run
    from flatlm.experiment import evaluate_pending, flatness_pending
    from flatlm.train.loop import train_and_evaluate

    config = demo_config(steps)
    if progress:
        print(f"flatlm demo: writing to {workdir}", file=sys.stderr)
    train_and_evaluate(config, workdir, progress=progress)
    have = results_lib.load(workdir)
    if not any(e["kind"] == "probe" for e in have):
        evaluate_run(workdir, "all", progress=progress)
    else:  # a rerun: only what is missing
        from pathlib import Path

        evaluate_pending(Path(workdir), progress)
    if flatness:
        from pathlib import Path

        import ml_collections

        flatness_pending(Path(workdir), ml_collections.ConfigDict(dict(
            method="fisher", num_probes=0, num_batches=2, batch_size=64, draws=8, grow_to=())), progress)
    return summary(workdir, config)


def summary(workdir: str, config) -> dict:
    entries = results_lib.load(workdir)
    rows: dict[int, dict] = {}
    for e in entries:
        if e["step"] is None:
            continue
        row = rows.setdefault(e["step"], {"step": e["step"]})
        if e["kind"] == "exact_loss":
            row.update({k: e[k] for k in ("loss", "entropy", "kl", "log_kl", "loss_std")})
        elif e["kind"] == "probe" and e.get("task") == TASK:
            row.update(probe=e["accuracy"], probe_std=e["accuracy_std"])
        elif e["kind"] == "flatness":
            row.update(trace=e["trace"], trace_stderr=e["trace_stderr"])
    lookup = results_lib.latest(entries, kind="lookup_table", task=TASK)
    return {"workdir": workdir, "language": config.language.to_dict(), "task": TASK,
            "rows": [rows[s] for s in sorted(rows)],
            "lookup_table": None if lookup is None else {"accuracy": lookup["accuracy"],
                                                         "accuracy_std": lookup["accuracy_std"]}}


def print_report(result: dict) -> None:
    from flatlm.cli import print_table

    print(f"\nPCFG language (random grammar of the paper's shape, seed {result['language']['seed']}); loss in nats per "
          f"masked position; probe = linear probe accuracy on task {result['task']} (the most likely root child of "
          "the sentence, released definition), mean ± std over seeds:")
    rows = []
    for r in result["rows"]:
        rows.append({**r, "probe_s": f"{100 * r['probe']:.1f} ± {100 * r['probe_std']:.1f}" if "probe" in r else None,
                     "trace_s": f"{r['trace']:.4g} ± {r['trace_stderr']:.2g}" if "trace" in r else None})
    lk = result["lookup_table"]
    if lk:
        rows.append({"step": "lookup", "loss": rows[-1].get("entropy") if rows else None, "entropy": None,
                     "kl": 0.0, "probe_s": f"{100 * lk['accuracy']:.1f} ± {100 * lk['accuracy_std']:.1f}"})
    print_table(rows, [("step", "step", ""), ("loss", "exact loss", ".4f"), ("entropy", "entropy", ".4f"),
                       ("kl", "KL", ".4f"), ("probe_s", "probe acc %", "s"), ("trace_s", "Tr(H)", "s")])
    print("\nlookup = a probe on the exact conditionals (a model with the optimal loss, KL = 0)")
    print(f"workdir: {result['workdir']} (config.json, checkpoints/, metrics.jsonl, tensorboard/, results.json)")
