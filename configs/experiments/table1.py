"""Table 1: AdamW vs the adversarial meta-objective vs the lookup table, at (nearly) the same exact loss (PCFG
tasks A and B; paper: AdamW 3.204 / 89.9 % / 49.2 %, adversarial 3.206 / 83.1 % / 42.3 %, lookup 3.196 / 71.2 % /
39.7 %, 235M transformers).

`table1.py:tiny` (PCFG) and `table1.py:tiny,hmm`; `table1_hmm.py` is the same experiment on the HMM (not in the
paper); `table2.py` is the paper's Table 2 (task C, with Tr(H)). The lookup-table row comes from `flatlm evaluate`
(a probe on the exact conditionals, i.e. the optimal pre-training loss).
"""

from flatlm.experiment import PAPER_FLATNESS, base_run_config, experiment_config, parse_arg


def get_config(arg: str = "tiny", default_language: str = "pcfg", strengths: dict | None = None,
               name: str = "table"):
    """`strengths`: {preset: adversarial strengths} replacing the preset's own (adversarial_strength.py); `name`: the
    experiment's name prefix."""
    preset, language = parse_arg(arg, default_language, languages=("hmm", "pcfg"))
    base = base_run_config(preset, language)
    if preset == "tiny":
        # Every run trains 300 plain steps (identical across runs), then 600 more: plain AdamW, or the adversarial
        # objective (start_step=300). Measured (seed 0, probe of task k4 / A): HMM lam 3: loss +0.015 nats,
        # probe 38% -> 18%; PCFG (not converged at this scale, KL 0.39) lam 1: loss +0.024 nats, probe 33% -> 23%.
        base.train.update(steps=900, eval_every=300)
        base.checkpoint.every = 300
        base.train.adversarial.update(d1_size=64, d2_size=64, ridge=3.0, start_step=300)
        lams = (1.0,) if language == "pcfg" else (3.0,)
    elif preset == "cpu":
        # Every run trains 1000 plain steps, then 1000 more (linear decay to 0) plainly or adversarially
        # (start_step=1000, D1/D2 of 128, ridge 3). Measured on the HMM (seed 0, exact KL at step 2000; accuracies
        # not looked at): plain 0.0122; lam 1: 0.0136 (+0.0014 nats); lam 2: 0.0163 (+0.0041 nats), both in the
        # band; lam 3: 0.0218 (+0.0096 nats, KL above 0.02: out). So lam 2, the largest measured value that stays
        # in the band (2000 steps with 1000 adversarial ones: ~95 CPU-s vs 44 plain). The PCFG does not reach the
        # band at cpu scale (README); it uses the same lam and the HMM's 2000 steps: measured afterwards on seed 0,
        # KL 0.179 plain vs 0.199 at lam 2 (+0.021 nats), so table1.py:cpu cannot test the claim.
        base.train.update(steps=2000, eval_every=200)
        base.checkpoint.every = 2000
        # Also measured at 1600 and 1800: C3 compares each run's last checkpoint inside the "same loss" band
        # (flatlm.reproduce_points.last_in_band), as C1 and C4 do, since seed 5 of C3's seeds 3-14 ended its adversarial
        # run at KL 0.0210 (one iterate's KL moves by ~0.004 nats between checkpoints). Training is unchanged.
        base.checkpoint.steps = (1600, 1800)
        base.train.adversarial.update(d1_size=128, d2_size=128, ridge=3.0, start_step=1000)
        lams = (2.0,)
    else:
        if language == "pcfg":  # "235M transformers": L16-H1024 (~203M in flatlm) is Table 3's nearest shape
            base.model.shape = "L16-H1024"
        base.train.adversarial.update(d1_size=256, d2_size=256, ridge=1.0)
        lams = (0.1, 1.0)
    lams = (strengths or {}).get(preset, lams)
    runs = [("adamw", [])] + [(f"adversarial-lam{lam:g}", [f"--config.train.adversarial.lam={lam}"]) for lam in lams]
    flatness = dict(enabled=preset != "tiny")  # the paper's Table 2 reports Tr(H)
    if preset == "cpu":
        flatness.update(num_batches=2, draws=20)
    if preset == "paper":
        flatness.update(PAPER_FLATNESS)
    return experiment_config(f"{name}_{language}", base, runs, flatness=flatness,
                             seeds=(0, 1) if preset == "tiny" else (0, 1, 2),
                             description="same loss, different downstream: the training algorithm")
