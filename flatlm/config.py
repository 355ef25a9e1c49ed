"""Configs as code: the base schema, loading `FILE[:ARG]`, `--config.a.b=v` overrides and validation.

Every `configs/*.py` starts from `base_config()` and changes what its experiment needs, so every run carries
the same fields. A workdir stores the resolved config as `config.json`, which `load_workdir_config` reads back.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import os
import re
from pathlib import Path

import ml_collections

from flatlm import paths
from flatlm.errors import UserError


def base_config() -> ml_collections.ConfigDict:
    """All fields a run has, with the paper's defaults where the paper gives one."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.language = ml_collections.ConfigDict(
        dict(
            name="hmm",
            seed=0,
            # HMM
            num_states=100, vocab_size=200, length=16, num_blocks=10,
            # PCFG: rules_file ("" -> random_grammar(seed, **grammar), by default of the released file's shape);
            # max_length caps sentences (0 -> the grammar's longest; longer samples are rejected).
            rules_file="", max_length=0,
            grammar=ml_collections.ConfigDict(dict(
                num_roots=9, levels=4, symbols_per_level=10, num_words=200, rules_per_symbol=20, leaf_rules=100)),
        )
    )
    c.data = ml_collections.ConfigDict(
        dict(
            source="tfds",  # "tfds": materialise splits once; "stream": sample on the fly (deterministic)
            data_dir="",  # "" -> <workdir>/data
            train_size=100_000,
            eval_size=2_000,  # validation sentences, stored with exact conditionals
            masking="single",  # "single": one masked position per sentence (paper); "bert": 15% / 80-10-10
            mask_prob=0.15,
            max_predictions=5,
            batch_size=256,  # global batch (all processes)
            num_workers=0,  # grain threads (0 = 1) building batches: tfds 1.4-1.7x at 2, stream 0.6x (GIL-bound)
            # stream source: rows per sampler call (one seed each). Larger is faster (PCFG tiny on one core: 8 ->
            # 0.56M, 512 -> 6.1M tokens/s); each process samples whole blocks, so keep batch_size / processes a
            # multiple of it. Part of the data: a run resumes only with the block it started with.
            stream_block=512,
            # tfds source: True keys each sentence's mask by its corpus row, so it keeps one mask for the whole run
            # (default: by stream position, a fresh mask every epoch). With batch_size = train_size every step then
            # sees the same masked corpus: a deterministic full-batch objective (edge-of-stability checks).
            fixed_masks=False,
        )
    )
    c.model = ml_collections.ConfigDict(
        dict(
            kind="bert",
            shape="",  # a Table 3 name (flatlm.models.TABLE3) overrides num_layers/d_model
            d_model=128, num_layers=2, num_heads=0, d_ff=0,
            ln_mode="pre", dropout=0.1, attention_dropout=0.1, gelu_approximate=True,
            d_hidden=128,  # LSTM
            dtype="float32", param_dtype="float32",
        )
    )
    c.train = ml_collections.ConfigDict(
        dict(
            steps=1000,
            optimizer="adamw",
            lr=5e-4,
            b1=0.9, b2=0.98, eps=1e-6, weight_decay=0.01,
            momentum=0.0,  # SGD
            schedule="linear",  # warmup then linear decay to 0 ("constant": constant after warmup)
            warmup_frac=0.06,
            grad_clip=0.0, microbatches=1,  # clip 0: off; microbatches k: gradient accumulation (accumulated_grad)
            log_every=50,
            eval_every=250,
            rank_every=0,  # > 0: log rank and top singular values of W - W0 per matrix at evals on these steps
            # The adversarial meta-objective (paper A.4): L_mlm - lam * loss of a ridge head fitted on D1,
            # evaluated on D2 (flatlm.train.adversarial.AdversarialConfig documents every field). lam = 0: plain
            # MLM (monitor=True still logs the head's D2 loss/accuracy). task "" -> the language's first task.
            # start_step: plain MLM up to this step, the adversarial objective after it (warm start).
            adversarial=ml_collections.ConfigDict(dict(
                lam=0.0, ridge=1.0, d1_size=256, d2_size=256, loss="squared", ce_scale=1.0, cap_at_chance=True,
                projection_dim=0, projection_seed=0, normalize="global", task="", pool_size=0, monitor=False,
                start_step=0)),
            # Flatness-seeking objectives (beyond the paper; flatlm.train.flat_objectives.FlatConfig documents
            # every field): method "none" | "sam" | "label_noise" | "trace_penalty"; blocks "all" | "encoder" |
            # comma-separated block names (flatlm.models.blocks) for sam and trace_penalty.
            flat=ml_collections.ConfigDict(dict(method="none", rho=0.05, ascent_groups=1, noise_p=0.1,
                                                noise_source="model", gamma=0.01, probes=1, penalty="fisher",
                                                score_forward="clean", blocks="all")),
            # Gradual stacking (flatlm.train.stacking documents every field): stages ((num_layers, steps), ...)
            # summing to train.steps, the last at model.num_layers; () -> off. rule "midas" | "top" |
            # "function_preserving"; opt_state "carry" (moments grown by the same rule) | "reset".
            stacking=ml_collections.ConfigDict(dict(stages=(), rule="midas", opt_state="carry")),
        )
    )
    c.eval = ml_collections.ConfigDict(
        dict(
            num_subsets=5,  # exact loss: std over this many disjoint subsets of the validation sentences
            loss_average="token",  # exact loss over (x, t): "token" (flatlm) or "sentence" (paper's E_{x,t})
            batch_size=128,
            tasks=(),  # downstream tasks; () -> the language's default (HMM: task-6, task-10; PCFG: A, B, C)
            task_definition="",  # "" -> language default (HMM "sampled", PCFG "released")
            task_train_size=100_000,
            task_eval_size=10_000,  # validation and test, each
            lookup=True,  # also probe the lookup table (exact conditionals) once per run
            lookup_words=False,  # also probe [conditionals; one-hot words] once per run (C5's control)
            probe=ml_collections.ConfigDict(dict(
                enabled=True, epochs=100, batch_size=512, lr=1e-3, weight_decay=0.01, warmup_steps=50,
                num_seeds=5, projection_dim=0, standardize=True,  # paper: 100 epochs; released: 50
                layers=())),  # inner layers (1-based) probed besides the last, results kind "layer_probe"
            # paper: 200 warmup steps (released: 50), lr 1e-4. lr_grid: () -> that fixed lr; else the rate of
            # the grid with the best validation accuracy (flatlm.evaluate.finetune). from_init: also fine-tune
            # the run's initialisation once (a control: what pre-training adds), results kind "finetune_init".
            finetune=ml_collections.ConfigDict(dict(
                enabled=True, epochs=50, batch_size=128, lr=1e-4, weight_decay=0.01, warmup_steps=200,
                num_seeds=5, lr_grid=(), from_init=False)),
        )
    )
    c.mesh = ml_collections.ConfigDict(
        dict(data=-1, model=1, parallelism="dp", multihost=False,  # -1: all remaining devices
             # a multi-host run outside a TPU pod / cluster JAX detects (flatlm.run.initialize_distributed);
             # per launch, so never stored in config.json (LAUNCH_FIELDS)
             coordinator_address="", num_processes=0, process_id=-1)
    )
    c.checkpoint = ml_collections.ConfigDict(
        dict(
            every=500, keep=3,
            steps=(),  # also saved and kept forever
            # "Continue after convergence" (paper Figure 1): once the exact KL stops improving (relative gain
            # below `convergence_tol` for `convergence_patience` evals in a row) at step s0, save and keep
            # checkpoints at s0 * log_factor^i. convergence_max_kl > 0 also asks that the exact KL at s0 be at
            # most that many nats (the "same loss" band, flatlm.claims.MAX_KL): a plateau above the band is not
            # the regime Figure 1 is about. 0: the plateau alone (the paper's wording, B.1).
            after_convergence=False, convergence_patience=3, convergence_tol=0.02, log_factor=2.0,
            convergence_max_kl=0.0,
        )
    )
    return c


# ---------------------------------------------------------------- loading


def load_config(spec: str) -> ml_collections.ConfigDict:
    """`path/to/file.py[:arg]` -> `get_config(arg)`. User mistakes raise UserError."""
    path, _, arg = spec.partition(":")
    if not path.endswith(".py") or not os.path.isfile(path):
        raise UserError(f"config file {path!r} not found; pass --config configs/NAME.py[:PRESET]")
    try:
        module = load_module(path)
    except SyntaxError as e:
        raise UserError(f"{path}:{e.lineno}: {e.msg}; fix the config file") from None
    if not hasattr(module, "get_config"):
        raise UserError(f"{path} has no get_config(arg) function")
    try:
        config = module.get_config(arg) if arg else module.get_config()
    except KeyError as e:  # presets are looked up in a dict
        raise UserError(f"{path}: unknown preset {arg!r}; {e.args[0] if e.args else ''}".rstrip("; ")) from None
    config.config_spec = spec
    return config


def load_module(path) -> object:
    """The module in Python file `path`, executed afresh (experiment configs load a sibling config file with it)."""
    module_spec = importlib.util.spec_from_file_location(f"flatlm_config_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def presets(table: dict, arg: str, path: str):
    """Look up a preset by name with an error that lists the choices."""
    name = arg or "tiny"
    if name not in table:
        raise UserError(f"{path}: unknown preset {name!r}; choose one of: {', '.join(table)}")
    return table[name]


def _parse_value(text: str, current):
    if isinstance(current, str):
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    if isinstance(current, bool) and isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(current, tuple) and isinstance(value, list | int):
        value = tuple(value) if isinstance(value, list) else (value,)
    return value


def apply_overrides(config: ml_collections.ConfigDict, overrides: list[str]) -> ml_collections.ConfigDict:
    """Apply `--config.a.b=value` (or `a.b=value`) overrides in the absl style, type-checked.

    Our own parser rather than `ml_collections.config_flags`: that one parses only through absl's flag registry
    (a `DEFINE_config_file` flag that loads the file itself, then `FLAGS(argv)`), so it cannot be fed the overrides
    argparse leaves over per verb nor the overrides stored in an experiment's runs, and its errors are absl's
    multi-line usage dumps instead of one line naming the field with a suggestion. Values are read the way
    config_flags reads them (a Python literal, else the string; the field's current type decides), and
    ConfigDict's own type check stays the last word (`node[leaf] = value`)."""
    for item in overrides:
        key, eq, text = item.removeprefix("--").removeprefix("config.").partition("=")
        if not eq:
            raise UserError(f"override {item!r} has no value; write --config.{key}=VALUE")
        *parents, leaf = key.split(".")
        node = config
        for i, part in enumerate(parents):
            if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
                raise UserError(f"unknown config section {'.'.join(parents[: i + 1])!r}{_suggest(part, node)}")
            node = node[part]
        if leaf not in node:
            raise UserError(f"unknown config field {key!r}{_suggest(leaf, node)}")
        value = _parse_value(text, node[leaf])
        current = node[leaf]
        if current is not None and (type(value) is not type(current) and not (
                isinstance(current, float) and type(value) is int)):
            raise UserError(f"config field {key!r} expects {type(current).__name__}, got {text!r}")
        try:
            node[leaf] = value
        except TypeError:
            raise UserError(f"config field {key!r} expects {type(node[leaf]).__name__}, got {text!r}") from None
    return config


def _suggest(name: str, node) -> str:
    close = difflib.get_close_matches(name, list(node.keys()), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; fields: {', '.join(node.keys())}"


# ---------------------------------------------------------------- validation helpers
# Each section is validated by the layer that owns it (`flatlm.languages.validate_config`, `flatlm.data...`,
# `flatlm.models...`, `flatlm.train...`, `flatlm.checkpoint...`, `flatlm.sharding...`); `flatlm.run.validate`
# calls them all once, plus the checks that span sections.


def check_choice(value, choices, field: str) -> None:
    """UserError naming `config.<field>` unless `value` is one of `choices`."""
    if value not in choices:
        raise UserError(f"config.{field}={value!r} is not one of {', '.join(map(str, choices))}; "
                        f"set --config.{field}=...")


def check_positive(section, prefix: str, *names: str) -> None:
    """UserError naming `config.<prefix>.<name>` for the first of `names` that is not > 0."""
    for name in names:
        if not section[name] > 0:
            raise UserError(f"config.{prefix}.{name} must be positive, got {section[name]}")


# ---------------------------------------------------------------- workdir


EXTENDABLE = ("train.steps",)  # fields a run may change on resume, and only upwards: see save_workdir_config

LEGACY_STREAM_BLOCK = 8  # the stream source's block before `data.stream_block` existed


def _legacy(flat_stored: dict) -> dict:
    """Fields added after runs existed, whose absence from a stored config meant another value than today's
    default: {field: the value such a run used}. A stream run from before `data.stream_block` sampled blocks of 8."""
    return {"data.stream_block": LEGACY_STREAM_BLOCK} if flat_stored.get("data.source") == "stream" else {}


def save_workdir_config(config: ml_collections.ConfigDict, workdir: str, write: bool = True,
                        check_extension=None) -> None:
    """Write `config.json` atomically; refuse to mix a different config into an existing run.

    `write=False` only checks, so a run can refuse before it builds anything and write once all checks passed.
    Raising `train.steps` (`EXTENDABLE`) extends a run: allowed when `check_extension(old, new)` (ConfigDicts of
    the stored and the new config) accepts it, i.e. raises no UserError; the trainer's check asks that the steps
    already trained would have been trained the same way (the learning-rate schedule over them is unchanged).
    config.json then records the new total.
    """
    path = paths.path(workdir, "config.json")
    config = without_launch_fields(config)
    text = config.to_json_best_effort(indent=2, sort_keys=True)
    if path.exists():
        old = _read_json(path)
        new = json.loads(text)
        for d in (old, new):
            d.pop("config_spec", None)
        if old == new:
            return
        flat_old, flat_new = _flat(old), _flat(new)
        # a field the stored config lacks (written by a flatlm before the field existed) at the value such a run
        # used (`_legacy`, else today's default) is no change
        flat_old = {**_legacy(flat_old), **flat_old}
        diff = changed_fields(flat_old, flat_new, json.loads(base_config().to_json_best_effort()))
        if not diff:
            return
        extending = set(diff) <= set(EXTENDABLE) and flat_new["train.steps"] > flat_old["train.steps"]
        if not extending or check_extension is None:
            raise UserError(
                f"{workdir} already holds a run with a different config (fields {', '.join(diff[:5])}); "
                "use a new --workdir or the same config"
                + ("; only a larger train.steps extends a run" if set(diff) <= set(EXTENDABLE) else "")
            )
        check_extension(load_workdir_config(workdir), config)
        if write:
            paths.write_text(path, text)
        return
    if not write:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    paths.write_text(path, text)


LAUNCH_FIELDS = {"coordinator_address": "", "num_processes": 0, "process_id": -1}  # of `mesh`: how, not what


def without_launch_fields(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of `config` with the per-launch `mesh` fields (coordinator, process count and id) at their
    defaults: they differ between the processes of one run and between its restarts, so no run records them."""
    config = ml_collections.ConfigDict(config.to_dict())
    if "mesh" in config:
        for k, v in LAUNCH_FIELDS.items():
            if k in config.mesh:
                config.mesh[k] = v
    return config


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def changed_fields(old: dict, new: dict, defaults: dict | None = None) -> list[str]:
    """Dotted names of the fields whose values differ between two nested dicts (e.g. stored and new JSON); a field
    one of them lacks counts as None, except a field only `new` has at its value in `defaults` (nested like them):
    one added to flatlm since `old` was written, at the value runs without it used."""
    a, b, defaults = _flat(old), _flat(new), _flat(defaults or {})
    return [k for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and not (k not in a and k in defaults and b[k] == defaults[k])]


def load_workdir_config(workdir: str) -> ml_collections.ConfigDict:
    """The resolved config stored in a workdir's config.json, merged over `base_config()`."""
    path = paths.path(workdir, "config.json")
    if not path.exists():
        raise UserError(f"{workdir} is not a flatlm run (no config.json); pass the --workdir of a `flatlm train`")
    data = _read_json(path)
    base = base_config()
    base.config_spec = ""
    for field, value in _legacy(_flat(data)).items():
        section, name = field.split(".")
        data.setdefault(section, {}).setdefault(name, value)
    _merge(base, data)
    return base


# A run repeated over pre-training seeds is named `<name>-seed<k>` (flatlm.experiment); reports group by the name.
SEED_SUFFIX = re.compile(r"^(.+)-seed(\d+)$")


def run_dirs(folder) -> list:
    """The run workdirs under `folder`: the folder itself if it is a run (has config.json), else an experiment's
    runs/*/ (those with a config.json), in the order its experiment.json lists them; [] if neither."""
    p = paths.path(folder)
    if (p / "config.json").exists():
        return [p]
    found = sorted(x.parent for x in p.glob("runs/*/config.json"))
    if (p / "experiment.json").exists():  # the experiment's own run order
        order = [r["name"] for r in _read_json(p / "experiment.json").get("runs", [])]
        found.sort(key=lambda c: order.index(c.name) if c.name in order else len(order))
    return found


def _read_json(path) -> dict:
    """A workdir's config.json, or one line saying it is damaged."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is damaged ({e}); restore it from a copy or start a new --workdir") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a config (a JSON object); restore it or start a new --workdir")
    return data


def _merge(node, data):
    for k, v in data.items():
        if isinstance(v, dict) and k in node and isinstance(node[k], ml_collections.ConfigDict):
            _merge(node[k], v)
        elif k in node and isinstance(node[k], tuple) and isinstance(v, list):
            node[k] = tuple(v)
        else:
            with node.ignore_type():
                node[k] = v
