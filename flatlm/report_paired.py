"""Paired comparisons over pre-training seeds for `flatlm report`: every arm of an experiment against its control.

Runs named `<arm>-seed<k>` form one group per arm; the control is the first arm in the runs' order (an experiment's
first method: `adamw` in flatness_seeking, `plain` in stacking). At each run's last checkpoint:
- `arms_vs_control`: per arm, how many seed pairs are at the "same loss" (`flatlm.claims.same_loss`: both exact KL
  <= 0.02 nats and the loss gap below max(0.005, 2 x subset std)) and the mean per-seed difference arm - control
  with its 95% t-interval (`flatlm.claims.paired_effect`) of the exact loss, probe and fine-tuning accuracy (first
  task) and the flatness trace (the Fisher's where measured), split into the encoder's blocks and the head's where
  per-group traces were measured (flatlm.models.blocks; the follow-up flatness_seeking_encoder asks whether moving
  the encoder's part moves the probe), and where measured (an experiment's `flatness.spectrum_k`,
  `density_probes`, `preconditioned`) the Hessian's top eigenvalue, Tr(H^2) and Adam's preconditioned sharpness
  (issue 18 item 4: every curvature figure, paired). A difference at not-the-same loss is not the paper's kind of
  evidence: the table says how many pairs qualify.
- `pretraining_gain`: per arm, fine-tuning from the pre-trained weights minus fine-tuning the same run's
  initialisation (`eval.finetune.from_init`), paired over seeds: what pre-training adds to fine-tuning at all.
  When it is zero, the fine-tuning column says nothing about the encoder.
- `probe_by_layer` (+ `probe_by_layer_figure`): where runs probed inner layers (`eval.probe.layers`), each arm's
  probe per layer and the paired differences layer k - its own last layer and - the control arm's last layer.
"""

from __future__ import annotations

from flatlm import claims
from flatlm.models.blocks import block_group
from flatlm.report_curvature import estimator_key
from flatlm.report_plots import by_seed, subplots
from flatlm.results import flatness_spec, measured_by, split_of


def split_trace(entry: dict) -> tuple[float | None, float | None]:
    """(encoder, head) parts of a flatness entry's per-group traces: the head's groups are those flatlm.models.blocks
    calls "head" (by their top-level name), the encoder every other; (None, None) without per-group traces or
    without a head group."""
    groups = (entry.get("detail") or {}).get("per_group") or {}
    head = [v for g, v in groups.items() if block_group((g.split("/")[0],)) == "head"]
    if not head or len(head) == len(groups):
        return None, None
    return sum(groups.values()) - sum(head), sum(head)


def _validation(entries: list[dict]) -> list[dict]:
    """The entries measured on the validation split (`flatlm flatness --split`; no split recorded: validation)."""
    return [e for e in entries if split_of(e) == "validation"]


def experiment_flatness_spec(run) -> dict | None:
    """The flatness spec of the experiment a `flatlm.report.RunData` belongs to (None outside one), read once per
    run: what tells the experiment's own trace from one another command (`flatlm flatness`) added at a step."""
    if "flatness_spec" not in run.extra:
        run.extra["flatness_spec"] = flatness_spec(run.path) if run.path is not None else None
    return run.extra["flatness_spec"]


def final(run) -> dict:
    """The last checkpoint's exact loss, probe / fine-tuning accuracy (first task), the fine-tuned initialisation's
    accuracy, its flatness traces ("traces": `estimator_key` -> entry; `with_trace` picks one for a table) and
    spectrum figures of a `flatlm.report.RunData`. A run in an experiment offers only the experiment's own
    trace (`flatlm.results.measured_by` its spec), not one another command (`flatlm flatness`) added at the step."""
    loss = run.by_kind("exact_loss")
    if not loss:
        return {}
    step = max(loss)
    at = lambda kind, s=step: [e for e in run.results if e["kind"] == kind and e["step"] == s]  # noqa: E731
    probes, tunes = at("probe"), at("finetune")
    task = min((e["task"] for e in probes + tunes), default=None)
    pick = lambda es: next((e["accuracy"] for e in reversed(es) if e.get("task") == task), None)  # noqa: E731
    layers = {e["layer"]: e["accuracy"] for e in at("layer_probe") if e.get("task") == task}  # the latest wins
    spec = experiment_flatness_spec(run)
    traces = {estimator_key(e): e for e in _validation(at("flatness")) if spec is None or measured_by(e, spec)}
    return {"loss": loss[step], "probe": pick(probes), "finetune": pick(tunes),
            "finetune_init": pick(at("finetune_init", None)), "traces": traces, "task": task,
            **spectrum_figures(_validation(at("spectrum")), _validation(at("preconditioned_sharpness"))),
            **{f"layer{k}": v for k, v in sorted(layers.items())}}


def table_estimator(points) -> tuple | None:
    """The one trace estimator a table compares (`final` points; traces of different estimators are different
    quantities and never enter one paired difference): the one most of `points` have, the Fisher's and the model's
    own shape before others."""
    keys = [k for p in points for k in p.get("traces", {})]
    return max(dict.fromkeys(keys), key=lambda k: (keys.count(k), k[0] == "fisher", k[1] is None), default=None)


def with_trace(point: dict, key: tuple | None) -> dict:
    """`point` with "trace", "method", "trace_encoder" and "trace_head" of estimator `key` (None where the run lacks
    it: the seed then drops out of that column's pairs)."""
    entry = point.get("traces", {}).get(key) if point else None
    encoder, head = split_trace(entry) if entry else (None, None)
    return {**point, "trace": entry["trace"] if entry else None, "method": key[0] if key else None,
            "trace_encoder": encoder, "trace_head": head} if point else point


def spectrum_figures(spectra: list[dict], preconditioned: list[dict]) -> dict[str, float]:
    """A checkpoint's curvature figures beyond the trace (validation-split `flatlm.flatness.runner` entries; the
    latest of each kind, the model's own shape before a grown view): "top1", the Hessian's largest Ritz value
    (Lanczos); "trace_h2", Tr(H^2) from the SLQ probes; "precond", the top eigenvalue of Adam's P^-1 H. Absent
    where not measured."""
    out = {}
    own = [e for e in spectra if not e.get("grown_to")] or spectra  # the own shape's, else a grown view's
    if own:
        if own[-1].get("top", {}).get("values"):
            out["top1"] = own[-1]["top"]["values"][0]
        moments = {m["p"]: m["value"] for m in own[-1].get("density", {}).get("moments", [])}
        if 2 in moments:
            out["trace_h2"] = moments[2]
    if preconditioned:
        out["precond"] = preconditioned[-1]["value"]
    return out


# the paired table's columns after the trace, each shown where a control seed has it: (key, header)
EXTRA_COLUMNS = (("trace_encoder", "encoder blocks"), ("trace_head", "head"), ("top1", "top eigenvalue"),
                 ("trace_h2", "Tr(H^2)"), ("precond", "P^-1 H top (Adam)"))


def effect(control: dict, treated: dict, key: str, scale: float, key_control: str | None = None) -> str:
    """`mean [low, high]` of treated[s][key] - control[s][key_control or key] over the seeds s both have (>= 2)."""
    pairs = {s: (control[s].get(key_control or key), treated[s].get(key)) for s in set(control) & set(treated)}
    pairs = {s: p for s, p in pairs.items() if None not in p}
    if len(pairs) < 2:
        return "-"
    e = claims.paired_effect({s: a for s, (a, _) in pairs.items()}, {s: b for s, (_, b) in pairs.items()})
    return f"{scale * e.mean:+.3g} [{scale * e.low:+.3g}, {scale * e.high:+.3g}]"


def groups(runs) -> dict[str, dict[int, dict]]:
    """{arm: {seed: `final(run)`}} in the runs' order (a run without a seed suffix is seed 0 of its own arm)."""
    return {arm: {seed: final(r) for seed, r in members.items()} for arm, members in by_seed(runs).items()}


def arms_vs_control(runs, control: str | None = None, title: str | None = None) -> list[str]:
    """Markdown lines of the arms-against-control table; none without a control arm of >= 2 seeds and another arm.
    `control`: the arm to compare against (default: the first arm)."""
    arms = groups(runs)
    control = control or next(iter(arms), None)
    key = table_estimator(arms.get(control, {}).values())
    arms = {name: {s: with_trace(p, key) for s, p in arm.items()} for name, arm in arms.items()}
    base = arms.get(control, {})
    if len(base) < 2 or len(arms) < 2:
        return []
    task = next((p["task"] for p in base.values() if p.get("task")), None)
    method = key[0] if key else None
    extra = [(k, h) for k, h in EXTRA_COLUMNS if any(p.get(k) is not None for p in base.values())]
    title = title or f"Paired against {control} (last checkpoint; arm - {control}, mean [95% t-interval] over seeds)"
    md = [f"\n## {title}\n",
          f"Same loss: pairs with both exact KL <= {claims.MAX_KL} nats and |loss gap| < max({claims.MIN_LOSS_GAP}, "
          "2 x subset std) (flatlm.claims).\n",
          f"| arm | seeds | same loss | exact loss (nats) | probe {task} (pp) | fine-tune {task} (pp) | trace "
          f"({method or '-'}) |" + "".join(f" {h} |" for _, h in extra),
          "|---|---|---|---|---|---|---|" + "---|" * len(extra)]
    for name, treated in arms.items():
        if name == control:
            continue
        seeds = sorted(s for s in set(base) & set(treated) if base[s] and treated[s])
        same = [claims.same_loss(base[s]["loss"], treated[s]["loss"]).ok for s in seeds]
        c, t = ({s: {**d[s], "loss": d[s]["loss"]["loss"]} for s in seeds} for d in (base, treated))
        md.append(f"| {name} | {len(seeds)} | {sum(same)} of {len(seeds)} | {effect(c, t, 'loss', 1.0)} | "
                  f"{effect(c, t, 'probe', 100.0)} | {effect(c, t, 'finetune', 100.0)} | "
                  f"{effect(c, t, 'trace', 1.0)} |" + "".join(f" {effect(c, t, k, 1.0)} |" for k, _ in extra))
    scale = [(h, [p[k] for p in base.values() if p.get(k) is not None]) for k, h in (("trace", "trace"), *extra)]
    if any(v for _, v in scale):
        md.append(f"\nFor scale, {control}'s own values (mean over its seeds): "
                  + "; ".join(f"{h} {sum(v) / len(v):.4g}" for h, v in scale if v) + ".")
    return md


def pretraining_gain(runs) -> list[str]:
    """Markdown lines of the per-arm table fine-tune - fine-tune from init (none without `finetune_init` results)."""
    rows = []
    for name, arm in groups(runs).items():
        have = {s: p for s, p in arm.items() if p and p.get("finetune") is not None and p.get("finetune_init")
                is not None}
        if not have:
            continue
        task = next(p["task"] for p in have.values())
        tuned, init = (100 * sum(p[key] for p in have.values()) / len(have) for key in ("finetune", "finetune_init"))
        rows.append(f"| {name} | {task} | {len(have)} | {tuned:.1f} | {init:.1f} | "
                    f"{effect(have, have, 'finetune', 100.0, key_control='finetune_init')} |")
    if not rows:
        return []
    return ["\n## What pre-training adds to fine-tuning (fine-tune - fine-tune from the run's initialisation; "
            "mean [95% t-interval] over seeds)\n",
            "The same fine-tuning (eval.finetune) from the pre-trained weights and from the weights training "
            "started at (eval.finetune.from_init). An interval around 0 means fine-tuning accuracy carries no "
            "information about the pre-trained encoder.\n",
            "| arm | task | seeds | fine-tune (%) | from init (%) | gain (pp) |", "|---|---|---|---|---|---|", *rows]


def _layers(points) -> list[int]:
    """The inner layers probed (`final`'s "layer<k>" keys) in any of `points`, ascending."""
    return sorted({int(k[5:]) for p in points for k in p if k.startswith("layer")})


def _mean_half(values) -> tuple[float, float]:
    """Mean of `values` and the half-width of its 95 % t-interval (0 for a single value)."""
    return sum(values) / len(values), claims.t_half_width(values) if len(values) > 1 else 0.0


def probe_by_layer(runs, control: str | None = None) -> list[str]:
    """Markdown lines of the per-layer probe tables (`eval.probe.layers`, results kind "layer_probe"; none without
    them): each arm's accuracy per probed layer and at the last layer (mean [95% t-interval] over seeds), then per
    arm and inner layer k the paired differences layer k - the arm's own last layer (does the stack above k lose
    what layer k holds?) and layer k - the control arm's last layer (`control`, default the first arm)."""
    arms = groups(runs)
    inner = _layers(p for arm in arms.values() for p in arm.values())
    if not inner:
        return []
    control = control or next(iter(arms))
    base = arms.get(control, {})
    task = next((p["task"] for arm in arms.values() for p in arm.values() if p.get("task")), None)

    def mean_ci(values) -> str:
        if len(values) < 2:
            return f"{100 * values[0]:.1f}" if values else "-"
        m, h = _mean_half([100 * v for v in values])
        return f"{m:.1f} [{m - h:.1f}, {m + h:.1f}]"

    md = [f"\n## Linear probe by layer (last checkpoint, {task}; mean [95% t-interval] over seeds, %)\n",
          "Layer k: the hidden states after the model's k-th layer (eval.probe.layers), probed like the last layer's "
          "(same probe, same seeds).\n",
          "| arm | seeds | " + " | ".join(f"layer {k}" for k in inner) + " | last |",
          "|---|---|" + "---|" * (len(inner) + 1)]
    for name, arm in arms.items():
        have = [p for p in arm.values() if p]
        if not any(f"layer{k}" in p for p in have for k in inner):
            continue
        cells = [mean_ci([p[f"layer{k}"] for p in have if p.get(f"layer{k}") is not None]) for k in inner]
        md.append(f"| {name} | {len(have)} | " + " | ".join(cells)
                  + f" | {mean_ci([p['probe'] for p in have if p.get('probe') is not None])} |")
    md += ["", f"| arm | layer | layer - own last (pp) | layer - {control} last (pp) |", "|---|---|---|---|"]
    for name, arm in arms.items():
        for k in (k for k in inner if any(p.get(f"layer{k}") is not None for p in arm.values())):
            md.append(f"| {name} | {k} | {effect(arm, arm, f'layer{k}', 100.0, key_control='probe')} | "
                      f"{effect(base, arm, f'layer{k}', 100.0, key_control='probe')} |")
    return md


def _depth(run) -> int | None:
    """num_layers of a run's stored config (None without one, e.g. a Table 3 `shape`, whose depth it names)."""
    model = (run.config or {}).get("model") or {}
    return None if model.get("shape") else model.get("num_layers")


def probe_by_layer_figure(runs):
    """Probe accuracy (%) against the layer it reads, one line per arm with layer probes: each layer's mean over
    seeds with its 95 % t-interval, the last layer's (the paper's probe) at the arm's depth (from its config, else
    one past its deepest probed layer). None without layer probes. For deep models, where the table is too wide."""
    arms = groups(runs)
    probed = [arm for arm, seeds in arms.items() if _layers(seeds.values())]
    if not probed:
        return None
    depth = {arm: _depth(r) for arm, members in by_seed(runs).items() for r in list(members.values())[:1]}
    fig, ax = subplots()
    for i, arm in enumerate(probed):
        have = [p for p in arms[arm].values() if p]
        layers = _layers(have)
        dodge = 0.05 * (i - (len(probed) - 1) / 2)  # arms side by side at each layer, not on top of each other
        last = depth.get(arm) or layers[-1] + 1
        xs, means, halves = [], [], []
        for x, key in [(k, f"layer{k}") for k in layers if k != last] + [(last, "probe")]:
            values = [100 * p[key] for p in have if p.get(key) is not None]
            if values:
                mean, half = _mean_half(values)
                xs.append(x + dodge)
                means.append(mean)
                halves.append(half)
        ax.errorbar(xs, means, halves, fmt="o-", capsize=3, label=f"{arm} ({len(have)} seeds)")
    ax.set(xlabel="layer probed (an arm's deepest point: its last layer, the paper's probe)",
           ylabel="probe accuracy (%)",
           title="linear probe by layer (mean, 95% t-interval over seeds)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=7)
    return fig
