"""Figure 5 / Table 4: compare the flatness of different sizes after embedding each into one larger model.

Every checkpoint of every run is embedded (function-preserving growth, `flatlm.flatness.grow`) into the least
common multiple width and the largest depth of the group before Tr(H) is measured (paper preset: the seven Table 4
shapes grown into its largest, L20-H1920, as in B.3), so traces of models
of different sizes are taken in the same parameter space. Pre-LN models: exact in width and depth.
"""

from flatlm.experiment import PAPER_FLATNESS, base_run_config, experiment_config, parse_arg
from flatlm.models.bert import TABLE4, TABLE4_TARGET


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
    elif preset == "cpu":
        # Growth (flatlm.flatness.grow) is for BERT only, so this experiment trains BERT on the HMM too (pre-LN, no
        # dropout). Measured on the HMM cpu language (seed 0, 2000 AdamW steps at 3e-3, linear decay): exact KL
        # 0.013 (d32 x 1), 0.014 (d64 x 1), 0.013 (d64 x 2), all <= 0.02 from step 1800; wider ones did not
        # converge at this lr (d128 x 1: 0.055, d96 x 2: 0.052), so the sizes vary depth more than width.
        # The PCFG does not reach the band at cpu scale (README).
        base.model.update(kind="bert", dropout=0.0, attention_dropout=0.0)
        shapes = [("d32-L1", 32, 1), ("d64-L1", 64, 1), ("d64-L2", 64, 2)]  # lcm width 64, depth 2
        runs = [(n, [f"--config.model.d_model={d}", f"--config.model.num_layers={L}"]) for n, d, L in shapes]
        target = (2, 64)
    else:
        runs = [(name, [f"--config.model.shape={name}"]) for name in TABLE4]  # Table 4, grown into its largest
        target = TABLE4[TABLE4_TARGET]
    # per-group traces split into the part growth leaves unchanged and the part it rescales (flatness.estimates)
    flatness = dict(enabled=True, method="fisher", grow_to=target, groups="growth")
    if preset == "cpu":  # ~10 CPU-s per checkpoint (d32 x 1 grown to 64 x 2) instead of ~2x that with the defaults
        flatness.update(num_batches=2, draws=20)
    if preset == "paper":
        flatness.update(PAPER_FLATNESS)
    return experiment_config("fig5_grown_sizes", base, runs, flatness=flatness,
                             seeds=(0, 1, 2) if preset == "cpu" else (),
                             description=f"Tr(H) after embedding every model into {target[1]} wide, {target[0]} deep")
