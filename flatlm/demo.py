"""`flatlm demo`: the paper's story on a small language, end to end on a laptop CPU in a few minutes.

It builds a small corpus with exact conditionals, pre-trains a small BERT, and reports the exact
pre-training loss split into entropy + KL at each evaluation, with everything written to the workdir.
"""

from __future__ import annotations

import sys

from flatlm.config import base_config
from flatlm.metrics import read_metrics


def demo_config(steps: int = 0):
    """The demo's embedded default: an HMM with 32 states and 50 words, a 2-layer d=128 pre-LN BERT."""
    c = base_config()
    c.language.update(name="hmm", seed=0, num_states=32, vocab_size=50, length=12, num_blocks=4)
    c.data.update(train_size=20_000, eval_size=500, batch_size=128)
    c.model.update(kind="bert", d_model=128, num_layers=2, dropout=0.0, attention_dropout=0.0)
    c.train.update(steps=steps or 1200, lr=2e-3, warmup_frac=0.06, schedule="linear", log_every=50)
    c.train.eval_every = max(1, c.train.steps // 6)
    c.checkpoint.update(every=c.train.eval_every, keep=10)
    c.config_spec = "flatlm.demo:demo_config"
    return c


def run(workdir: str, steps: int = 0, progress: bool = True) -> dict:
    from flatlm.train.loop import train_and_evaluate

    config = demo_config(steps)
    if progress:
        print(f"flatlm demo: writing to {workdir}", file=sys.stderr)
    train_and_evaluate(config, workdir, progress=progress)
    rows = [
        {"step": m["step"], **{k.removeprefix("eval/"): v for k, v in m.items() if k.startswith("eval/")}}
        for m in read_metrics(workdir) if "eval/loss" in m
    ]
    return {"workdir": workdir, "language": config.language.to_dict(), "evals": rows}


def print_report(result: dict) -> None:
    from flatlm.cli import print_table

    lang = result["language"]
    print(f"\nexact pre-training loss on {lang['name'].upper()} ({lang['num_states']} states, "
          f"{lang['vocab_size']} words, length {lang['length']}), nats per masked position:")
    print_table(result["evals"], [("step", "step", "d"), ("loss", "loss", ".4f"), ("entropy", "entropy", ".4f"),
                                  ("kl", "KL", ".4f"), ("log_kl", "log KL", ".2f"), ("loss_std", "±std", ".4f")])
    print(f"\nworkdir: {result['workdir']} (config.json, checkpoints/, metrics.jsonl, tensorboard/)")
