"""Issue 19's transfer experiment on the sparse contextual bigram (SCB) linear transformer: samples to reach a target
distance to the ground truth, from scratch vs fine-tuned from a correlated SCB, with SGD vs SGD + l1 proximal on A.

For each seed: the target SCB is `random_scb(seed, ...)`; the source is `correlated_scb(target, seed + 1000, keep,
mix)` (keep "patterns": the same attention patterns Q, the transition P mixed with a fresh one; keep "transition": the
same P, Q mixed). "scratch" trains on the target from the uniform start (V = 1/N, A = 1/T); "finetuned" first trains
on the source from the uniform start for `pretrain_samples` sentences (same method), then on the target from there
(prox+sgd: a proximal phase of `prox_samples` at the start of both). Scratch and fine-tuned arms of a seed see the same
target sentences.
Every arm is online (fresh sentences each step, `flatlm.train.linear_attention.train`) and runs its whole budget
`max_samples`; the count is the first logged one within `target` of the distance sqrt(||cV - P||^2 + ||A/c - Q^T||^2)
(None: not reached), and the distance at the end of the budget is reported too: the l1 step's bias can take a run
that passed the target back out of it. `flatlm theory scb` prints the table with every seed.
"""

from __future__ import annotations

import dataclasses

from flatlm.languages.scb import correlated_scb, random_scb
from flatlm.models import linear_attention as la
from flatlm.train import linear_attention as tla


@dataclasses.dataclass(frozen=True)
class TransferConfig:
    """The SCB (num_words N, context_length T, sparsity, concentration), the source (keep, mix), the trainers
    (methods among sgd, prox, prox+sgd = prox for the first prox_samples sentences then SGD; lr, lam, batch_size,
    log_every), the target distance, the budget of every arm (max_samples, run in full), the source's pre-training
    budget (pretrain_samples) and the seeds; stop_at_target ends each arm at the target (quicker; no end distance)."""

    num_words: int = 8
    context_length: int = 6
    sparsity: int = 2
    concentration: float = 0.5
    keep: str = "patterns"
    mix: float = 0.5
    methods: tuple = ("sgd", "prox", "prox+sgd")
    lr: float = 0.1
    lam: float = 1e-2
    prox_samples: int = 100_000
    stop_at_target: bool = False
    batch_size: int = 64
    log_every: int = 10
    target: float = 0.3
    max_samples: int = 400_000
    pretrain_samples: int = 200_000
    seeds: tuple = (0, 1, 2)


PRESETS = {
    # seconds of CPU: N = 8 words, T = 6 (2 of 6 positions: barely sparse; lam 1e-2 biases A too much there), 3 seeds
    "tiny": TransferConfig(lam=1e-3, prox_samples=50_000),
    # ~1.5 minutes on 2 CPU cores: N = 10 words, T = 20 (a sparser pattern: 2 of 20 positions), 5 seeds
    "cpu": TransferConfig(num_words=10, context_length=20, target=0.5, max_samples=1_000_000,
                          pretrain_samples=500_000, log_every=20, seeds=(0, 1, 2, 3, 4)),
}


def check_config(cfg: TransferConfig) -> None:
    """ValueError naming the field of a config that cannot run."""
    if cfg.keep not in ("patterns", "transition") or not 0 <= cfg.mix <= 1:
        raise ValueError(f"keep must be patterns or transition and mix in [0, 1], got {cfg.keep!r}, {cfg.mix}")
    if not 1 <= cfg.sparsity <= cfg.context_length or cfg.target < 0 or cfg.lam < 0 or not cfg.seeds:
        raise ValueError("need 1 <= sparsity <= context_length, target >= 0, lam >= 0 and at least one seed")


def _train_cfg(cfg: TransferConfig, method: str, seed: int, max_samples: int, target: float = 0.0):
    return tla.LinearTrainConfig(method="sgd" if method == "sgd" else "prox", lr=cfg.lr, lam=cfg.lam,
                                 prox_samples=cfg.prox_samples if method == "prox+sgd" else 0,
                                 batch_size=cfg.batch_size, max_samples=max_samples, log_every=cfg.log_every,
                                 target=target, seed=seed)


def run_transfer(cfg: TransferConfig, progress=None) -> list[dict]:
    """One row per (seed, method, start): samples to the target (None if not reached), the start's distance, the
    distance (and its V and A parts) at the end of the budget, and for fine-tuning the source distance its
    pre-training reached. `progress()` after each arm."""
    rows = []
    for seed in cfg.seeds:
        target_scb = random_scb(seed, cfg.num_words, cfg.context_length, cfg.sparsity, cfg.concentration)
        source = correlated_scb(target_scb, seed + 1000, keep=cfg.keep, mix=cfg.mix, concentration=cfg.concentration)
        uniform = la.uniform_params(cfg.num_words, cfg.context_length)
        for method in cfg.methods:
            pre, pre_rows = tla.train(source, uniform, _train_cfg(cfg, method, seed + 2000, cfg.pretrain_samples))
            for start, params, source_distance in (("scratch", uniform, None),
                                                   ("finetuned", pre, pre_rows[-1]["distance"])):
                _, log = tla.train(target_scb, params, _train_cfg(cfg, method, seed, cfg.max_samples,
                                                                         cfg.target if cfg.stop_at_target else 0.0))
                rows.append({"seed": seed, "method": method, "start": start,
                             "samples_to_target": tla.samples_to_target(log, cfg.target),
                             "start_distance": log[0]["distance"], "final_distance": log[-1]["distance"],
                             "min_distance": min(r["distance"] for r in log),
                             "final_dist_V": log[-1]["dist_V"], "final_dist_A": log[-1]["dist_A"],
                             "source_distance": source_distance})
                if progress:
                    progress()
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (method, start): the median samples to target over the seeds that reached it (the upper one of an even
    count), and how many did."""
    out = []
    for key in dict.fromkeys((r["method"], r["start"]) for r in rows):
        group = [r for r in rows if (r["method"], r["start"]) == key]
        reached = sorted(r["samples_to_target"] for r in group if r["samples_to_target"] is not None)
        out.append({"method": key[0], "start": key[1], "reached": f"{len(reached)}/{len(group)}",
                    "median_samples": reached[len(reached) // 2] if reached else None})
    return out
