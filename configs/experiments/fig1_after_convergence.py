"""Figure 1: continue pre-training after convergence; the loss stays flat while downstream accuracy moves."""

from flatlm import claims
from flatlm.experiment import PAPER_FLATNESS, base_run_config, experiment_config, parse_arg


def get_config(arg: str = "tiny"):
    preset, language = parse_arg(arg)
    base = base_run_config(preset, language)
    base.checkpoint.update(after_convergence=True, convergence_patience=2 if preset == "tiny" else 3,
                           convergence_tol=0.05 if preset == "tiny" else 0.02, log_factor=2.0, keep=2)
    if preset == "tiny":
        base.train.update(steps=240, eval_every=20, schedule="constant", warmup_frac=0.05)
        base.checkpoint.every = 240
    elif preset == "cpu":
        # Measured (HMM cpu scale, BiLSTM 64, seed 0): constant lr 1e-3 after 6% warmup gives exact KL 0.022 at step
        # 1200, 0.020 at 2400, 0.015 at 3000: it creeps down, so "converged" is a 10% gain tolerance (patience 2
        # evals of 200 steps), which fires around step 1500-2000; log_factor 1.4 then puts >= 4 checkpoints
        # after it (s0 x 1.4^k for k = 1..4 <= 3.84 s0) within 8000 steps as long as s0 <= 2080.
        base.train.update(steps=8000, eval_every=200, schedule="constant", warmup_frac=0.06, lr=1e-3)
        base.checkpoint.update(every=8000, convergence_patience=2, convergence_tol=0.1, log_factor=1.4)
        # Two complete runs (docs/reproduction/cpu, cpu-rerun) declared convergence at a plateau whose exact KL
        # was 0.022-0.028 on every seed, outside the "same loss" band, so C1 was inconclusive by construction.
        # Since then convergence also needs the exact KL inside the band (changed after seeing those runs, their
        # effects included: docs/reproduction/cpu-band); 2-3 checkpoints then follow it within 8000 steps.
        base.checkpoint.convergence_max_kl = claims.MAX_KL
    else:
        base.train.update(steps=200_000, eval_every=2_000, schedule="constant")
        base.checkpoint.every = 10_000
    flatness = dict(enabled=True, method="fisher")
    if preset == "cpu":  # ~7 CPU-s per checkpoint (HMM BiLSTM 64) instead of ~15 with the defaults (4 x 128, 50 draws)
        flatness.update(num_batches=2, draws=20)
    if preset == "paper":
        flatness.update(PAPER_FLATNESS)
    return experiment_config("fig1_after_convergence", base, [("adamw", [])], flatness=flatness,
                             seeds=(0, 1, 2) if preset == "cpu" else (),
                             description="exact loss, probe accuracy and Tr(H) at log-spaced steps after convergence")
