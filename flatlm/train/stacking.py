"""Gradual stacking as a training schedule (`train.stacking`): grow the model's depth in stages.

`stages` ((num_layers, steps), ...) trains `num_layers` layers for `steps` steps each; the layers increase, the
last stage has `model.num_layers` and the steps add up to `train.steps`. Between stages the train state is grown by
`rule` (`flatlm.models.stacking`: `midas` duplicates the middle block, Saunshi et al. 2024; `top` stacks copies of
the top layers, Reddi et al. 2023; `function_preserving` adds zero-residual blocks, the grown model computing the
same function). The optimizer state is
- `carry`: every per-parameter moment (Adam's mu and nu, SGD's momentum) grown by the same rule as its parameter
  (copies for copied layers, zeros for new zero-residual blocks), every count kept;
- `reset`: a fresh optimizer state for the grown model (zero moments, Adam's bias correction restarting), except
  the learning-rate schedule's count, which stays at the step: the schedule runs over `train.steps` unchanged.
Growth happens after the checkpoint of a stage's last step S and before step S + 1, so the checkpoint of step t has
the shape of the stage containing t (`flatlm.models.stacking.layers_at`), and a run resumes exactly from any step:
the restore builds the abstract state of that step's depth, a resume at S grows exactly as the straight run did.
New blocks of `function_preserving` draw qkv and mlp.wi from fold_in(fold_in(key(seed), GROWTH_SALT), S).
Evaluators read only checkpoints of the final depth (`flatlm.run.Run.steps`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import optax

from flatlm import models, sharding
from flatlm.config import check_choice
from flatlm.errors import UserError
from flatlm.models import stacking
from flatlm.models.bert import SHAPES
from flatlm.run import init_boxed

OPT_RULES = ("carry", "reset")
GROWTH_SALT = 0x5374636B  # folded into the seed's key for new blocks' weights: never a step or a dropout key


def validate(config) -> None:
    """Check `train.stacking` against the model and the train section; one line naming the fix on failure."""
    s = config.train.get("stacking")
    if s is None or not s.stages:
        return
    example = "e.g. --config.train.stacking.stages='((1, 500), (2, 1500))'"
    try:
        stages = stacking.normalize_stages(s.stages)
    except ValueError as e:
        raise UserError(f"config.train.stacking.stages: {e}; {example}") from None
    check_choice(s.rule, stacking.RULES, "train.stacking.rule")
    check_choice(s.opt_state, OPT_RULES, "train.stacking.opt_state")
    if config.model.kind != "bert":
        raise UserError("train.stacking grows BERT only; set --config.model.kind=bert or "
                        "--config.train.stacking.stages=()")
    layers, steps = [n for n, _ in stages], [t for _, t in stages]
    if min(layers) < 1 or min(steps) < 1 or any(b <= a for a, b in zip(layers, layers[1:])):
        raise UserError(f"config.train.stacking.stages={stages}: layers must increase from >= 1 and every stage "
                        f"needs >= 1 step; {example}")
    final = SHAPES[config.model.shape][0] if config.model.shape else config.model.num_layers
    if layers[-1] != final:
        raise UserError(f"config.train.stacking.stages ends at {layers[-1]} layers but the model has {final}; make "
                        f"the last stage ({final}, steps) or set model.num_layers={layers[-1]}")
    if sum(steps) != config.train.steps:
        raise UserError(f"config.train.stacking.stages sum to {sum(steps)} steps but train.steps="
                        f"{config.train.steps}; make them add up")
    for a, b in zip(layers, layers[1:]):
        if s.rule != "function_preserving" and b - a > a:
            raise UserError(f"train.stacking.rule={s.rule} copies existing layers: {a} -> {b} layers needs {b - a} "
                            f"> {a}; add a stage in between (at most doubling) or use rule=function_preserving")
    if config.train.get("rank_every", 0):
        raise UserError("train.rank_every measures W - W0 of one shape; set it to 0 with train.stacking")
    if config.train.adversarial.lam > 0 or config.train.adversarial.monitor:
        raise UserError("train.stacking and the adversarial objective cannot be combined; set one of them off")


def _is_param_tree(x) -> bool:
    return isinstance(x, dict) and "tok_embed" in x


def grow_state(state: dict, optimizer: optax.GradientTransformation, cfg: models.BertConfig, num_layers: int,
               rule: str, opt_state: str, key: jax.Array | None) -> dict:
    """The train state {"step", "params", "opt_state"} of a `cfg` model grown to `num_layers` (module docstring)."""
    params = stacking.grow_params(state["params"], cfg, num_layers, rule, key=key)
    if opt_state == "carry":
        grow = lambda x: stacking.grow_moments(x, cfg.ln_mode, num_layers, rule) if _is_param_tree(x) else x
        opt = jax.tree.map(grow, state["opt_state"], is_leaf=_is_param_tree)
    else:
        keep = lambda x: x._replace(count=state["step"]) if isinstance(x, optax.ScaleByScheduleState) else x
        opt = jax.tree.map(keep, optimizer.init(params), is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
    return {"step": state["step"], "params": params, "opt_state": opt}


def stage_run(run, num_layers: int):
    """`run` (a `flatlm.run.Run` of the final shape) with a model of `num_layers` layers and its shardings."""
    if num_layers == run.model.cfg.num_layers:
        return run
    model = models.make_model(dataclasses.replace(run.model.cfg, num_layers=num_layers))
    with sharding.activated(run.mesh, run.rules):
        boxed = jax.eval_shape(lambda key: init_boxed(model, run.language.max_length, key),
                               jax.random.key(run.config.seed))
        shardings = sharding.param_shardings(boxed, run.mesh, run.rules)
    return dataclasses.replace(run, model=model, abstract_boxed=boxed, param_shardings=shardings)


class Stages:
    """The Run and TrainSetup of each depth a run trains at (the final one only, without stacking), and the growth
    between stages. `make_setup(run)` is the trainer's `train_setup`."""

    def __init__(self, run, make_setup: Callable):
        self.run, self.make_setup = run, make_setup
        self.stages = stacking.stages_of(run.config)
        ends = [sum(t for _, t in self.stages[: i + 1]) for i in range(len(self.stages))]
        self.boundaries = set(ends[:-1])  # growth comes after these steps
        self._cache: dict[int, tuple] = {}

    def layers(self, step: int) -> int:
        """Depth of the state saved at `step`."""
        return stacking.layers_at(self.stages, step) if self.stages else self.run.model.cfg.num_layers

    def at(self, step: int):
        """(Run, TrainSetup) of the depth at `step`."""
        n = self.layers(step)
        if n not in self._cache:
            run = stage_run(self.run, n)
            self._cache[n] = (run, self.make_setup(run))
        return self._cache[n]

    def grows_before(self, step: int) -> bool:
        """Whether the state is grown before training step `step`."""
        return step - 1 in self.boundaries

    def grow(self, state: dict, step: int) -> dict:
        """The state before step `step` (a stage boundary) grown to the next stage, in that stage's shardings."""
        (old_run, old_setup), (new_run, new_setup) = self.at(step - 1), self.at(step)
        s = self.run.config.train.stacking
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.run.config.seed), GROWTH_SALT), step - 1)
        fn = lambda st: grow_state(st, old_setup.optimizer, old_run.model.cfg, new_run.model.cfg.num_layers,
                                   s.rule, s.opt_state, key)
        with sharding.activated(self.run.mesh, self.run.rules):
            return jax.jit(fn, out_shardings=new_setup.state_shardings)(state)
