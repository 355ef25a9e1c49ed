"""Beyond the paper, after fig2_width_depth: what each added BiLSTM layer does to the linear probe at the same loss.

fig2_width_depth found (docs/experiments/fig2_width_depth-cpu) that at width 128 a second layer lowers the probe,
and that the two-layer model's first layer probes better than its last. Here depth is a series at one width, every
inner layer probed (`eval.probe.layers`, results kind "layer_probe"), everything else as fig2_width_depth's cpu
preset, so its lstm128-L1 and lstm128-L2 arms are that experiment's runs setting for setting (a test checks it) and
a study may train only lstm128-L3 (`--run`) and report it beside them (`flatlm report DIR_A DIR_B`).
Presets: `tiny` (smoke test, BERT d_model 32, 1..3 layers), `cpu` (HMM: BiLSTM hidden 128, 1..3 layers;
`cpu,pcfg`: BERT d_model 128, which does not reach the same-loss band at cpu scale), `paper` (HMM: BiLSTM hidden
1024, 4 / 8 / 16 layers, A.3's grid; PCFG: BERT d_model 1024, 6 / 12 / 16 layers).
"""

from pathlib import Path

from flatlm.config import load_module
from flatlm.experiment import experiment_config, parse_arg

_width_depth = load_module(Path(__file__).with_name("fig2_width_depth.py"))

SERIES = {  # preset, language -> (model field for the width, width, depths)
    ("tiny", "hmm"): ("d_model", 32, (1, 2, 3)),
    ("tiny", "pcfg"): ("d_model", 32, (1, 2, 3)),
    ("cpu", "hmm"): ("d_hidden", 128, (1, 2, 3)),
    ("cpu", "pcfg"): ("d_model", 128, (1, 2, 3)),
    ("paper", "hmm"): ("d_hidden", 1024, (4, 8, 16)),
    ("paper", "pcfg"): ("d_model", 1024, (6, 12, 16)),
}


def get_config(arg: str = "tiny"):
    preset, language = parse_arg(arg, languages=("hmm", "pcfg"))
    base = _width_depth.size_base(preset, language)  # fig2_width_depth's runs but for the model and probed layers
    field, width, depths = SERIES[preset, language]
    prefix = "lstm" if field == "d_hidden" else "d"
    runs = [(f"{prefix}{width}-L{d}", [f"--config.model.{field}={width}", f"--config.model.num_layers={d}",
                                        f"--config.eval.probe.layers={tuple(range(1, d))}"]) for d in depths]
    return experiment_config("fig2_depth", base, runs, flatness=dict(enabled=False),
                             seeds=(0, 1, 2) if preset == "cpu" else (),
                             description="BiLSTM depth series at one width, every layer probed, at equal exact loss")
