"""The "Gradual stacking" section of `flatlm report` (runs with `train.stacking`, configs/experiments/stacking.py).

Two tables, written only when some run grows its depth in stages:
- compute used per run: its stages ((num_layers, steps); a plain run is one stage), layer-steps (sum of
  num_layers x steps) and a FLOPs estimate (`flatlm.models.stacking.train_flops`: 6 x matmul parameters x tokens
  plus attention), with the ratio to the plain arm's;
- each stacking arm against `plain`, paired over pre-training seeds (runs `<arm>-seed<k>`), at each run's last
  checkpoint (`flatlm.report_paired.arms_vs_control`: the "same loss" count, then arm - plain with its 95%
  t-interval of the exact loss, probe and fine-tuning accuracy and the flatness trace).
"""

from __future__ import annotations

from flatlm import report_paired
from flatlm.config import load_workdir_config
from flatlm.languages import make_language
from flatlm.models import model_config
from flatlm.models import stacking as stacking_lib

CONTROL = "plain"


def compute_used(run) -> dict | None:
    """{"stages", "layer_steps", "flops"} of a BERT run (a `flatlm.report.RunData`); None for other models."""
    cfg = load_workdir_config(str(run.path))
    if cfg.model.kind != "bert":
        return None
    lang = make_language(cfg.language)
    bert = model_config(cfg.model, lang.vocab_size, lang.max_length + 1)
    stages = stacking_lib.stages_of(cfg) or ((bert.num_layers, cfg.train.steps),)
    return {"stages": stages, "layer_steps": sum(n * s for n, s in stages),
            "flops": stacking_lib.train_flops(bert, stages, cfg.data.batch_size, lang.max_length)}


def sections(runs, control: str | None = None) -> list[str]:
    """Markdown lines of the section (none when no run uses `train.stacking`). `control`: the arm the paired table
    compares against (`flatlm report --control`; default `plain`); compute stays relative to `plain`."""
    configs = {r.name: load_workdir_config(str(r.path)) for r in runs}
    if not any(stacking_lib.stages_of(c) for c in configs.values()):
        return []
    md = ["## Gradual stacking: compute used\n",
          "Layer-steps = sum of num_layers x steps over stages; FLOPs estimated as 6 x matmul parameters x tokens "
          "plus attention (flatlm.models.stacking.train_flops).\n",
          "| run | stages (layers, steps) | layer-steps | train FLOPs (est.) | vs plain |", "|---|---|---|---|---|"]
    used = {r.name: compute_used(r) for r in runs}
    plain = [u["flops"] for name, u in used.items() if u and name.startswith(CONTROL)]
    for name, u in used.items():
        if u:
            ratio = f"{u['flops'] / plain[0]:.2f}" if plain else "-"
            md.append(f"| {name} | {u['stages']} | {u['layer_steps']:,} | {u['flops']:.3g} | {ratio} |")
    control = control or CONTROL
    return md + report_paired.arms_vs_control(
        runs, control=control, title=f"Gradual stacking vs {control} (last checkpoint; arm - {control}, mean [95% "
        "t-interval] over seeds)")
