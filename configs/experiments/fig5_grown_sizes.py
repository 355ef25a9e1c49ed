"""Figure 5 / Table 4: compare the flatness of different sizes after embedding each into one larger model.

Every checkpoint of every run is embedded (function-preserving growth, `flatlm.flatness.grow`) into the least
common multiple width and the largest depth of the group (Table 4) before Tr(H) is measured, so traces of models
of different sizes are taken in the same parameter space. Pre-LN models: exact in width and depth.
"""

from flatlm.experiment import base_run_config, experiment_config, parse_arg
from flatlm.flatness.grow import TABLE4, TABLE4_MEMBERS


def get_config(arg: str = "tiny"):
    preset, language = parse_arg(arg)
    base = base_run_config(preset, language)
    base.model.ln_mode = "pre"
    if preset == "tiny":
        shapes = [("d64-L1", 64, 1), ("d128-L1", 128, 1), ("d192-L2", 192, 2)]  # lcm width 384, depth 2
        runs = [(n, [f"--config.model.d_model={d}", f"--config.model.num_layers={L}"]) for n, d, L in shapes]
        base.train.steps = 120
        base.train.eval_every = base.checkpoint.every = 60
        target = (2, 384)
    else:
        group = "L8-H512"
        runs = [(name, [f"--config.model.shape={name}"]) for name in TABLE4_MEMBERS[group]]
        target = TABLE4[group]
    return experiment_config("fig5_grown_sizes", base, runs,
                             flatness=dict(enabled=True, method="fisher", grow_to=target),
                             description=f"Tr(H) after embedding every model into {target[1]} wide, {target[0]} deep")
