"""Weaker still: table1_hmm's runs with the adversarial meta-objective at lam 0.1 and 0.3 (cpu), the low end of a dose
curve whose upper points are adversarial_strength.py's lam 1 and 1.5 (and table1_hmm's lam 2).

Why: at cpu scale lam 1 and lam 1.5 lower the probe by the same 7.6-7.7 pp (per seed within 0.4 pp) while the
encoder's Fisher trace still rises with lam (docs/reproduction/cpu-band/c3-strength-seeds-40-51): where does the
probe deficit start, and does the encoder's curvature rise with it below lam 1? Runs only need its adversarial arms
when adversarial_strength's AdamW runs exist for the same seeds (same base, same seed: the same AdamW run);
`flatlm report STRENGTH_DIR DOSE_DIR --control adamw` pairs them by seed. Tiny: lam 0.5, 1.5; paper: lam 0.01, 0.03.
"""

from pathlib import Path

from flatlm.config import load_module

_table1 = load_module(Path(__file__).with_name("table1.py"))

STRENGTHS = {"tiny": (0.5, 1.5), "cpu": (0.1, 0.3), "paper": (0.01, 0.03)}


def get_config(arg: str = "tiny"):
    return _table1.get_config(arg, default_language="hmm", strengths=STRENGTHS, name="adversarial_dose")
