"""Tables 1/2: AdamW vs the adversarial meta-objective vs the lookup table, at (nearly) the same exact loss.

`table1.py:tiny` (PCFG) and `table1.py:tiny,hmm`; `table2.py` is the same experiment on the HMM. The lookup-table
row comes from `flatlm evaluate` (a probe on the exact conditionals, i.e. the optimal pre-training loss).
"""

from flatlm.experiment import base_run_config, experiment_config, parse_arg


def get_config(arg: str = "tiny", default_language: str = "pcfg"):
    preset, language = parse_arg(arg, default_language)
    base = base_run_config(preset, language)
    if preset == "tiny":
        base.train.update(steps=150, eval_every=75)
        base.checkpoint.every = 75
        d1 = d2 = 64
        lams = (1.0,)
    else:
        d1 = d2 = 256
        lams = (0.1, 1.0)
    base.train.adversarial.update(d1_size=d1, d2_size=d2, ridge=1.0)
    runs = [("adamw", [])] + [(f"adversarial-lam{lam:g}", [f"--config.train.adversarial.lam={lam}"]) for lam in lams]
    return experiment_config(f"table_{language}", base, runs, flatness=dict(enabled=preset == "paper"),
                             description="same loss, different downstream: the training algorithm")
