"""Beyond the paper: does *seeking* flatness move downstream accuracy when the loss is held fixed? AdamW vs SAM vs
label-noise training vs an explicit Tr(H) penalty (`train.flat`, flatlm.train.flat_objectives), each over the
reproduction suite's pre-training seeds, then the exact loss, probes and Tr(H) of every checkpoint. Compare runs
only inside the "same loss" band (flatlm.claims; `flatlm report` prints the exact loss and KL of every run).

Presets: `tiny` (smoke test), `cpu` (the HMM cpu language and BiLSTM of the suite, ~16 minutes on 2 cores, 10 of
them fine-tuning; the method settings below are the literature's defaults. Measured once,
docs/experiments/flatness_seeking-cpu: every run in the same-loss band; SAM lowers Tr(F) by 42 % and the penalty by
81 %, and the probe accuracy does not move (-0.7 [-1.9, +0.5] and -0.9 [-5.4, +3.6] pp vs AdamW); fine-tuning at the
rate chosen on validation adds only +1.0 to +1.7 pp over fine-tuning each run's initialisation, every interval
across 0; with seeds 3-5 added (`--seeds 3,4,5`) no accuracy difference between methods excludes 0 either),
`paper` (the PCFG transformer of Figure 3). Every preset measures, beside the Fisher trace, the Hessian's top
eigenvalues, its SLQ density and Tr(H^2), and Adam's preconditioned sharpness (`flatness_seeking_config`; paper:
at the last checkpoint only); the report pairs each against AdamW. Rerun with them over 6 seeds
(docs/experiments/flatness_seeking-cpu, "Every curvature figure"): SAM and the penalty lower every one of them at
the same loss, and no accuracy moves.
"""

from flatlm.experiment import flatness_seeking_config

METHODS = [("adamw", []),
           ("sam-rho0.05", ["--config.train.flat.method=sam", "--config.train.flat.rho=0.05"]),
           ("label-noise-p0.1", ["--config.train.flat.method=label_noise", "--config.train.flat.noise_p=0.1"]),
           ("trace-penalty-g0.01", ["--config.train.flat.method=trace_penalty", "--config.train.flat.gamma=0.01"])]


def get_config(arg: str = "tiny"):
    return flatness_seeking_config(arg, "flatness_seeking", METHODS,
                                   "AdamW vs SAM vs label noise vs a Tr(H) penalty at equal exact loss")
