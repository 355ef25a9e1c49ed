"""Figure 1: continue pre-training after convergence; the loss stays flat while downstream accuracy moves."""

from flatlm.experiment import base_run_config, experiment_config, parse_arg


def get_config(arg: str = "tiny"):
    preset, language = parse_arg(arg)
    base = base_run_config(preset, language)
    base.checkpoint.update(after_convergence=True, convergence_patience=2 if preset == "tiny" else 3,
                           convergence_tol=0.05 if preset == "tiny" else 0.02, log_factor=2.0, keep=2)
    if preset == "tiny":
        base.train.update(steps=240, eval_every=20, schedule="constant", warmup_frac=0.05)
        base.checkpoint.every = 240
    else:
        base.train.update(steps=200_000, eval_every=2_000, schedule="constant")
        base.checkpoint.every = 10_000
    return experiment_config("fig1_after_convergence", base, [("adamw", [])],
                             flatness=dict(enabled=True, method="fisher"),
                             description="exact loss, probe accuracy and Tr(H) at log-spaced steps after convergence")
