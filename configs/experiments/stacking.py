"""Beyond the paper (issue 19): gradual stacking as an implicit bias at (almost) the same loss. Plain training vs
gradual stacking (`train.stacking`, flatlm.train.stacking) with the MIDAS rule (duplicate the middle block; Saunshi
et al. 2024 report similar or slightly worse perplexity but better reasoning downstream), the `top` rule (Reddi et
al. 2023's gradual stacking) and flatlm's function-preserving growth (zero-residual blocks), all ending at the
same final shape and step count, each over the reproduction suite's pre-training seeds. Every run's final-depth
checkpoints get the exact loss, probe, fine-tuning and Tr(F) (Fisher); `flatlm report` adds a "Gradual stacking"
section: per arm the "same loss" check against plain (flatlm.claims), paired effects over seeds with 95%
t-intervals, and the training compute used (layer-steps and a FLOPs estimate, flatlm.models.stacking.train_flops).

Stages grow one layer at a time with stage lengths proportional to the depth (1 : 2 : 3 ...), so every growth is a
real choice between the rules (1 -> 2 layers is the same copy for midas and top; 2 -> 3 is not).
Presets: `tiny` (smoke test; the PCFG tiny language, 3 layers, 60 steps), `cpu` (the HMM cpu language with BERT 64 x
4, no dropout, 2000 steps, 8 minutes on 2 cores plus ~2 minutes a run of fine-tuning; measured once,
docs/experiments/stacking-cpu: all 9 stacked runs at the same loss as plain with 0.76 of its FLOPs, probe accuracy
-0.3 to -0.7 pp vs plain, every interval across 0; fine-tuning from the pre-trained weights is no better than from
the initialisation, -0.8 pp [-1.9, +0.3] for plain), `paper` (the PCFG at paper scale, 12 layers grown over 4 stages
of 3 layers; not run).
tiny, measured once (2 seeds, 10 min 49 s wall on 2 shared CPU cores, `flatlm report`): every stacked arm used 0.80
of plain's estimated FLOPs (140 vs 180 layer-steps) and ended 0.04 nats BELOW plain's exact loss (5.117-5.118 vs
5.159 nats; KL 0.47 vs 0.51, far from the 0.02 band, so no pair is at the "same loss" and the accuracy differences,
e.g. probe A -1.4 pp [-3.0, +0.2] for midas, say nothing about the thesis); midas and top agree up to step 30 (the
1 -> 2 growth is the same copy for both), as they must.
"""

from flatlm.experiment import CPU_FINETUNE, PAPER_FLATNESS, base_run_config, experiment_config, parse_arg

RULES = ("midas", "top", "function_preserving")


def stages_for(layers: tuple[int, ...], steps: int) -> tuple[tuple[int, int], ...]:
    """Stages at these depths with lengths proportional to the depth, adding up to `steps`."""
    total = sum(layers)
    lengths = [steps * n // total for n in layers]
    lengths[-1] += steps - sum(lengths)
    return tuple(zip(layers, lengths))


def get_config(arg: str = "tiny"):
    preset, language = parse_arg(arg, languages=("hmm", "pcfg"))
    base = base_run_config(preset, language)
    flatness = dict(enabled=True, method="fisher")
    if preset == "tiny":
        base.model.num_layers = 3
        base.train.update(steps=60, eval_every=10)
        base.checkpoint.every = 30
        flatness.update(num_batches=1, draws=4)
        depths = (1, 2, 3)
    elif preset == "cpu":
        base.model.update(kind="bert", d_model=64, num_layers=4, dropout=0.0, attention_dropout=0.0)
        base.eval.finetune.update(CPU_FINETUNE)  # the rate chosen on validation, and the init control
        flatness.update(num_batches=2, draws=20)
        depths = (1, 2, 3, 4)
    else:
        flatness.update(PAPER_FLATNESS)
        depths = (3, 6, 9, 12)
    stages = stages_for(depths, base.train.steps)
    arms = [("plain", [])] + [(rule.replace("_", "-"), [f"--config.train.stacking.stages={stages}",
                                                         f"--config.train.stacking.rule={rule}"]) for rule in RULES]
    return experiment_config("stacking", base, arms, flatness=flatness,
                             seeds=(0, 1) if preset == "tiny" else (0, 1, 2),
                             description=f"plain vs gradual stacking {stages} (midas, top, function-preserving) "
                                         f"at {depths[-1]} layers")
