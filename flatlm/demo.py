"""`flatlm demo`: the paper's story on a small language, end to end on a laptop CPU in a few minutes.

It builds a small corpus with exact conditionals, pre-trains a small BERT, and reports for each checkpoint the
exact pre-training loss split into entropy + KL, the linear-probe accuracy on a downstream task (with the
lookup-table baseline: a probe on the exact conditionals, i.e. a model with the optimal loss) and the trace of
the Hessian (flatness). Everything is written to the workdir.
"""

from __future__ import annotations

import sys

import ml_collections

from flatlm import paths
from flatlm import results as results_lib
from flatlm.config import base_config
from flatlm.evaluate.runner import evaluate_run
from flatlm.experiment import evaluate_pending, flatness_pending
from flatlm.train.loop import train_and_evaluate

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
    """Train the demo (resuming), evaluate what is missing, measure Tr(H) by the paper's Fisher estimator (B.1);
    returns `summary`."""
    config = demo_config(steps)
    if progress:
        print(f"flatlm demo: writing to {workdir}", file=sys.stderr)
    train_and_evaluate(config, workdir, progress=progress)
    have = results_lib.load(workdir)
    if not any(e["kind"] == "probe" for e in have):
        evaluate_run(workdir, progress=progress)
    else:  # a rerun: only what is missing
        evaluate_pending(paths.path(workdir), progress)
    if flatness:
        flatness_pending(paths.path(workdir), ml_collections.ConfigDict(dict(
            method="fisher", num_probes=0, num_batches=2, batch_size=64, draws=8, grow_to=())), progress)
    return summary(workdir, config)


def summary(workdir: str, config) -> dict:
    """The demo's results per checkpoint (exact loss, probe accuracy, Tr(H)) and the lookup table, as a dict."""
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
