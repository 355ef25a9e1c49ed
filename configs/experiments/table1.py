"""Tables 1/2: AdamW vs the adversarial meta-objective vs the lookup table, at (nearly) the same exact loss.

`table1.py:tiny` (PCFG) and `table1.py:tiny,hmm`; `table2.py` is the same experiment on the HMM. The lookup-table
row comes from `flatlm evaluate` (a probe on the exact conditionals, i.e. the optimal pre-training loss).
"""

from flatlm.experiment import base_run_config, experiment_config, parse_arg


def get_config(arg: str = "tiny", default_language: str = "pcfg"):
    preset, language = parse_arg(arg, default_language)
    base = base_run_config(preset, language)
    if preset == "tiny":
        # Every run trains 300 plain steps (identical across runs), then 600 more: plain AdamW, or the adversarial
        # objective (start_step=300). Measured (seed 0, probe of task k4 / A): HMM lam 3: loss +0.015 nats,
        # probe 38% -> 18%; PCFG (not converged at this scale, KL 0.39) lam 1: loss +0.024 nats, probe 33% -> 23%.
        base.train.update(steps=900, eval_every=300)
        base.checkpoint.every = 300
        base.train.adversarial.update(d1_size=64, d2_size=64, ridge=3.0, start_step=300)
        lams = (1.0,) if language == "pcfg" else (3.0,)
    else:
        base.train.adversarial.update(d1_size=256, d2_size=256, ridge=1.0)
        lams = (0.1, 1.0)
    runs = [("adamw", [])] + [(f"adversarial-lam{lam:g}", [f"--config.train.adversarial.lam={lam}"]) for lam in lams]
    return experiment_config(f"table_{language}", base, runs, flatness=dict(enabled=preset == "paper"),
                             seeds=(0, 1) if preset == "tiny" else (0, 1, 2),
                             description="same loss, different downstream: the training algorithm")
