"""Beyond the paper, the follow-up to Figure 2 (C2): is it width or depth? fig2_model_sizes's cpu preset compares
BiLSTMs that differ in both at once (lstm32-L1, lstm64-L1, lstm128-L2), and on 12 seeds its largest, the only
two-layer one, probed *worse* than the smallest at the same loss while the wider one-layer lstm64-L1 probed best
(docs/reproduction/cpu-band, C2 on seeds 3-14). Here width and depth are crossed, 2 x 2, everything else as
fig2's preset (same language, optimiser, steps, evaluators), so that each factor's effect on the probe at the same
loss is measured with the other held fixed (`flatlm report DIR --control ARM` pairs any two arms over seeds).

The paper's claim (Section 3.2, Figure 2) is about size as the paper scales it (width and depth together: A.3's
grids), so neither factor alone is the paper's comparison; lstm128-L2 vs lstm32-L1 repeats fig2's.
Presets: `tiny` (smoke test, BERT), `cpu` (HMM: the BiLSTM, hidden 32 / 128 x 1 / 2 layers; `cpu,pcfg`: BERT
d_model 32 / 128 x 1 / 2 layers, which does not reach the same-loss band at cpu scale), `paper` (HMM: the corners
of A.3's BiLSTM grid, hidden 128 / 1024 x 4 / 16 layers; PCFG: L6-H256 and L16-H1024 of Table 3 and their two
crossings, heads d_model / 64).
"""

from flatlm.experiment import base_run_config, experiment_config, parse_arg

GRIDS = {  # preset, language -> (model field for the width, widths, depths)
    ("tiny", "hmm"): ("d_model", (16, 32), (1, 2)),
    ("tiny", "pcfg"): ("d_model", (16, 32), (1, 2)),
    ("cpu", "hmm"): ("d_hidden", (32, 128), (1, 2)),
    ("cpu", "pcfg"): ("d_model", (32, 128), (1, 2)),
    ("paper", "hmm"): ("d_hidden", (128, 1024), (4, 16)),
    ("paper", "pcfg"): ("d_model", (256, 1024), (6, 16)),
}


def size_base(preset: str, language: str):
    """fig2's run config for `preset` (tiny: 120 steps, evaluated at 60 and 120); fig2_depth.py starts from it too."""
    base = base_run_config(preset, language)
    if preset == "tiny":
        base.train.steps = 120
        base.train.eval_every = base.checkpoint.every = 60
    return base


def get_config(arg: str = "tiny"):
    preset, language = parse_arg(arg, languages=("hmm", "pcfg"))
    base = size_base(preset, language)
    field, widths, depths = GRIDS[preset, language]
    prefix = "lstm" if field == "d_hidden" else "d"
    # the smallest first: `flatlm report` pairs every arm against the first one unless told --control
    runs = [(f"{prefix}{w}-L{d}", [f"--config.model.{field}={w}", f"--config.model.num_layers={d}"])
            for d in depths for w in widths]
    return experiment_config("fig2_width_depth", base, runs, flatness=dict(enabled=False),
                             seeds=(0, 1, 2) if preset == "cpu" else (),
                             description="model width x depth at equal exact loss (Figure 2's two factors apart)")
