"""The "Gradual stacking" section of `flatlm report` (runs with `train.stacking`, configs/experiments/stacking.py).

Two tables, written only when some run grows its depth in stages:
- compute used per run: its stages ((num_layers, steps); a plain run is one stage), layer-steps (sum of
  num_layers x steps) and a FLOPs estimate (`flatlm.models.stacking.train_flops`: 6 x matmul parameters x tokens
  plus attention), with the ratio to the plain arm's;
- each stacking arm against `plain`, paired over pre-training seeds (runs `<arm>-seed<k>`), at each run's last
  checkpoint: how many seed pairs are at the "same loss" (`flatlm.claims.same_loss`: both exact KL <= 0.02 nats and
  the loss gap below max(0.005, 2 x subset std)), and the mean per-seed difference arm - plain with its 95%
  t-interval (`flatlm.claims.paired_effect`) of the exact loss, probe and fine-tuning accuracy (first task) and the
  trace of the Fisher (or whatever flatness estimator was measured).
A difference at not-the-same loss is not the paper's kind of evidence; the table says how many pairs qualify.
"""

from __future__ import annotations

from flatlm import claims
from flatlm.config import load_workdir_config
from flatlm.languages import make_language
from flatlm.models import model_config
from flatlm.models import stacking as stacking_lib
from flatlm.report_plots import SEED_SUFFIX

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


def _final(run) -> dict:
    """The last checkpoint's exact loss, probe / fine-tuning accuracy (first task) and flatness trace."""
    loss = run.by_kind("exact_loss")
    if not loss:
        return {}
    step = max(loss)
    at = lambda kind: [e for e in run.results if e["kind"] == kind and e["step"] == step]
    probes, tunes = at("probe"), at("finetune")
    task = min((e["task"] for e in probes), default=None)
    pick = lambda es: next((e["accuracy"] for e in reversed(es) if e.get("task") == task), None)
    traces = sorted(at("flatness"), key=lambda e: (e.get("method") != "fisher", bool(e.get("grown_to"))))
    return {"loss": loss[step], "probe": pick(probes), "finetune": pick(tunes),
            "trace": traces[0]["trace"] if traces else None, "method": traces[0].get("method") if traces else None,
            "task": task}


def _effect(control: dict, treated: dict, key: str, scale: float) -> str:
    pairs = {s: (control[s].get(key), treated[s].get(key)) for s in set(control) & set(treated)}
    pairs = {s: p for s, p in pairs.items() if None not in p}
    if len(pairs) < 2:
        return "-"
    effect = claims.paired_effect({s: a for s, (a, _) in pairs.items()}, {s: b for s, (_, b) in pairs.items()})
    return f"{scale * effect.mean:+.3g} [{scale * effect.low:+.3g}, {scale * effect.high:+.3g}]"


def sections(runs) -> list[str]:
    """Markdown lines of the section (none when no run uses `train.stacking`)."""
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
    groups: dict[str, dict[int, dict]] = {}
    for r in runs:
        m = SEED_SUFFIX.match(r.name)
        name, seed = (m.group(1), int(m.group(2))) if m else (r.name, 0)
        groups.setdefault(name, {})[seed] = _final(r)
    control = groups.get(CONTROL)
    if not control:
        return md
    task = next((p["task"] for p in control.values() if p.get("task")), None)
    method = next((p["method"] for p in control.values() if p.get("method")), None)
    md += ["\n## Gradual stacking vs plain (last checkpoint; arm - plain, mean [95% t-interval] over seeds)\n",
           f"Same loss: pairs with both exact KL <= {claims.MAX_KL} nats and |loss gap| < max({claims.MIN_LOSS_GAP}, "
           "2 x subset std) (flatlm.claims).\n",
           f"| arm | seeds | same loss | exact loss (nats) | probe {task} (pp) | fine-tune {task} (pp) | trace "
           f"({method or '-'}) |",
           "|---|---|---|---|---|---|---|"]
    for name, treated in groups.items():
        if name == CONTROL:
            continue
        seeds = sorted(s for s in set(control) & set(treated) if control[s] and treated[s])
        same = [claims.same_loss(control[s]["loss"], treated[s]["loss"]).ok for s in seeds]
        c, t = ({s: {**d[s], "loss": d[s]["loss"]["loss"]} for s in seeds} for d in (control, treated))
        md.append(f"| {name} | {len(seeds)} | {sum(same)} of {len(seeds)} | {_effect(c, t, 'loss', 1.0)} | "
                  f"{_effect(c, t, 'probe', 100.0)} | {_effect(c, t, 'finetune', 100.0)} | "
                  f"{_effect(c, t, 'trace', 1.0)} |")
    return md
