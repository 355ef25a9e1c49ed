"""Figure 2: larger models reach the same (optimal) pre-training loss but transfer better."""

from flatlm.experiment import base_run_config, experiment_config, parse_arg
from flatlm.models.bert import TABLE3


def get_config(arg: str = "tiny"):
    preset, language = parse_arg(arg)
    base = base_run_config(preset, language)
    if preset == "tiny":
        shapes = [("d32-L1", 32, 1), ("d64-L1", 64, 1), ("d128-L2", 128, 2)]
        runs = [(n, [f"--config.model.d_model={d}", f"--config.model.num_layers={L}"]) for n, d, L in shapes]
        base.train.steps = 120
        base.train.eval_every = base.checkpoint.every = 60
    else:
        runs = [(name, [f"--config.model.shape={name}"]) for name in TABLE3]
    return experiment_config("fig2_model_sizes", base, runs, flatness=dict(enabled=False),
                             description="accuracy vs model size at equal exact loss")
