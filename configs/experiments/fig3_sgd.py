"""Figure 3: SGD with mini-batch noise (warmup 12% of steps, then constant lr) keeps flattening after convergence."""

from flatlm.experiment import base_run_config, experiment_config, parse_arg


def get_config(arg: str = "tiny"):
    preset, language = parse_arg(arg)
    base = base_run_config(preset, language)
    base.train.update(optimizer="sgd", schedule="constant", warmup_frac=0.12, momentum=0.0, weight_decay=0.0)
    if preset == "tiny":
        base.train.update(steps=200, lr=0.3, eval_every=40)
        base.checkpoint.update(every=40, keep=10)
        lrs = (0.3, 0.1)
    else:
        base.train.update(steps=100_000, lr=0.5, eval_every=2_000)
        base.checkpoint.update(every=10_000, keep=20)
        lrs = (1.0, 0.5, 0.2)
    runs = [(f"sgd-lr{lr:g}", [f"--config.train.lr={lr}"]) for lr in lrs]
    return experiment_config("fig3_sgd", base, runs, flatness=dict(enabled=True, method="fisher"),
                             description="Tr(H) and accuracy along SGD training")
