"""Figure 3: SGD with mini-batch noise (warmup 12% of steps, then constant lr) keeps flattening after convergence."""

from flatlm.experiment import PAPER_FLATNESS, base_run_config, experiment_config, parse_arg


def get_config(arg: str = "tiny"):
    preset, language = parse_arg(arg, languages=("hmm", "pcfg"))  # no OPT version in the paper
    base = base_run_config(preset, language)
    base.train.update(optimizer="sgd", schedule="constant", warmup_frac=0.12, momentum=0.0, weight_decay=0.0)
    if preset == "tiny":
        base.train.update(steps=200, lr=0.3, eval_every=40)
        base.checkpoint.update(every=40, keep=10)
        lrs = (0.3, 0.1)
    elif preset == "cpu":
        # Measured (HMM cpu scale, BiLSTM 64, seed 0, batch 64, warmup 12% then constant): SGD has a noise floor
        # near the band's edge. lr 0.5 for 8000 steps: exact KL 0.033 (2000), 0.025 (3000), 0.020 (4000), then
        # 0.018-0.028 from eval to eval, 0.018 at 7000 and 8000; lr 1: the same floor, slightly higher (0.020 at
        # 8000); lr 1.5: 0.022-0.028 after 4000 steps (6000 run); lr 3: 0.026-0.05 (3000 steps). So lr 0.5 and
        # 10000 steps: in or at the edge of the band from step ~4000 on, with checkpoints every 2000 after it.
        # Two complete runs at 10000 steps (docs/reproduction/cpu, cpu-rerun) left 0-1 in-band checkpoints per
        # seed (KL still creeping down: 0.017-0.021 at 10000), so C4's SGD comparison was not measured. A pilot on
        # seed 100 (not a reported seed) at 20000 steps: exact KL 0.017 at 8000, 0.0145-0.023 at 10000-20000
        # (0.016 at 20000). So 20000 steps (changed after seeing those runs: docs/reproduction/cpu-band).
        base.train.update(steps=20_000, lr=0.5, eval_every=500)
        base.checkpoint.update(every=2000, keep=10)
        lrs = (0.5,)
    else:  # B.2: "fix the learning rate to 1e-3 after the warmup" (flatlm's earlier 1.0 / 0.5 / 0.2 remain a sweep:
        # --config.train.lr on a run, or edit lrs here)
        base.train.update(steps=100_000, eval_every=2_000)
        base.checkpoint.update(every=10_000, keep=20)
        lrs = (1e-3,)
    runs = [(f"sgd-lr{lr:g}", [f"--config.train.lr={lr}"]) for lr in lrs]
    flatness = dict(enabled=True, method="fisher")
    if preset == "cpu":  # ~7 CPU-s per checkpoint (HMM BiLSTM 64) instead of ~15 with the defaults
        flatness.update(num_batches=2, draws=20)
    if preset == "paper":
        flatness.update(PAPER_FLATNESS)
    return experiment_config("fig3_sgd", base, runs, flatness=flatness, seeds=(0, 1, 2) if preset == "cpu" else (),
                             description="Tr(H) and accuracy along SGD training")
