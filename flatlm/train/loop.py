"""`train_and_evaluate(config, workdir)`: the whole run, resumable, sharded over the config's mesh.

The step is jitted once with explicit in/out shardings and a donated state. The loop dispatches step t
before pulling step t-1's metrics to the host, so logging never stalls the device. Every `eval_every`
steps the exact pre-training loss (entropy + KL against the true conditionals) is measured on the
validation split. Checkpoints (state + data iterator position) are written every `checkpoint.every`
steps, at the end and on SIGTERM; a run restarts from its latest checkpoint by itself.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import signal
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from flatlm import checkpoint as ckpt
from flatlm import config as config_lib
from flatlm import sharding
from flatlm.data import builder as builder_lib
from flatlm.data import pipeline
from flatlm.evaluate.exact_loss import exact_loss
from flatlm.languages import make_language
from flatlm.metrics import MetricWriter
from flatlm.models import make_model, model_config
from flatlm.train import optim
from flatlm.train.step import mlm_objective, train_step

log = logging.getLogger("flatlm")


class NonFiniteLoss(RuntimeError):
    """Training produced a NaN/inf; the last good checkpoint is left as it was."""


@dataclasses.dataclass
class Run:
    """Everything built from a config that training and the evaluators share."""

    config: object
    workdir: str
    language: object
    model: nn.Module
    mesh: jax.sharding.Mesh
    rules: tuple
    sources: dict
    abstract_boxed: dict  # boxed abstract {"params", "opt_state"} with logical axis metadata
    state_shardings: dict
    optimizer: object

    @property
    def num_words(self) -> int:
        return self.language.vocab_size

    def abstract_state(self) -> dict:
        shapes = nn.unbox(self.abstract_boxed)
        state = {"step": jax.ShapeDtypeStruct((), jnp.int32), **shapes}
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state,
                            self.state_shardings)

    def eval_batches(self, batch_size: int | None = None, limit: int | None = None):
        bs = batch_size or self.config.eval.batch_size
        return pipeline.eval_batches(self.sources["validation"], bs, limit,
                                     jax.process_index(), jax.process_count())

    def mlm_batches(self, num_batches: int, batch_size: int, seed: int = 0, masking: str = "single") -> list[dict]:
        """Masked validation sentences in the MLM batch format (tokens/targets/weights), e.g. for flatness.

        Deterministic in `seed`; batches are disjoint as long as the validation split is large enough.
        """
        from flatlm.data.masking import mask_batch

        rng = np.random.default_rng(seed)
        out = []
        for batch in self.eval_batches(batch_size, limit=num_batches * batch_size):
            out.append(mask_batch(batch["tokens"], batch["length"], self.num_words, rng, masking=masking,
                                  mask_prob=self.config.data.mask_prob,
                                  max_predictions=self.config.data.max_predictions))
        return out

    @property
    def steps(self) -> list[int]:
        """Steps with a committed checkpoint, ascending."""
        return ckpt.all_steps(self.workdir)

    def load_params(self, step: int):
        return ckpt.restore_params(self.workdir, step, self.abstract_state())


def maybe_initialize_distributed(config) -> None:
    if config.mesh.multihost and not jax.distributed.is_initialized():
        jax.distributed.initialize()


def data_dir(config, workdir: str) -> str:
    return config.data.data_dir or os.path.join(workdir, "data")


def prepare_data(config, workdir: str, quiet: bool = False) -> dict:
    """Build the tfds corpus once (process 0, others wait) and open its splits."""
    train_size = config.data.train_size if config.data.source == "tfds" else 0
    kw = dict(language_spec=config.language.to_dict(), data_dir=data_dir(config, workdir),
              train_size=train_size, eval_size=config.data.eval_size, seed=config.seed, quiet=quiet)
    if jax.process_index() == 0:
        builder = builder_lib.build(**kw)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("flatlm-data-built")
    if jax.process_index() != 0:
        builder = builder_lib.build(**kw)
    return builder_lib.data_sources(builder)


def build_run(config, workdir: str, quiet: bool = False) -> Run:
    """Language, data, model, mesh, optimizer and the state's shardings for a config."""
    config_lib.validate(config, jax.device_count())
    language = make_language(config.language)
    sources = prepare_data(config, workdir, quiet=quiet)
    model = make_model(model_config(config.model, language.vocab_size, language.max_length + 1))
    mesh = sharding.make_mesh(config)
    rules = sharding.axis_rules(config.mesh.parallelism)
    optimizer = optim.optimizer(config.train)

    def init_boxed(key):
        tokens = jnp.zeros((2, language.max_length), jnp.int32)
        params = model.init(key, tokens)["params"]
        return {"params": params, "opt_state": optimizer.init(params)}

    with mesh, nn.logical_axis_rules(rules):
        abstract_boxed = jax.eval_shape(init_boxed, jax.random.key(config.seed))
        state_shardings = {"step": sharding.replicated(mesh),
                           **sharding.param_shardings(abstract_boxed, mesh, rules)}
    return Run(config, workdir, language, model, mesh, rules, sources, abstract_boxed, state_shardings, optimizer)


def load_run(workdir: str, quiet: bool = True) -> Run:
    """The Run of an existing workdir, from its config.json (for evaluators and the CLI)."""
    config = config_lib.load_workdir_config(workdir)
    return build_run(config, workdir, quiet=quiet)


def init_state(run: Run) -> dict:
    """Fresh state, created directly in its shardings."""

    def init(key):
        tokens = jnp.zeros((2, run.language.max_length), jnp.int32)
        params = run.model.init(key, tokens)["params"]
        boxed = {"params": params, "opt_state": run.optimizer.init(params)}
        return {"step": jnp.zeros((), jnp.int32), **nn.unbox(boxed)}

    with run.mesh, nn.logical_axis_rules(run.rules):
        return jax.jit(init, out_shardings=run.state_shardings)(jax.random.key(run.config.seed))


def jit_train_step(run: Run, objective=mlm_objective):
    """The train step jitted once: explicit shardings, donated state."""
    c = run.config
    step_fn = functools.partial(train_step, apply_fn=run.model.apply, optimizer=run.optimizer, seed=c.seed,
                                objective=objective, dropout=(c.model.dropout > 0 or
                                                              getattr(c.model, "attention_dropout", 0) > 0))
    return jax.jit(step_fn, in_shardings=(run.state_shardings, sharding.batch_sharding(run.mesh)),
                   out_shardings=(run.state_shardings, sharding.replicated(run.mesh)), donate_argnums=0)


def adversarial_setup(run: Run, start: int):
    """(objective, iterator of D1/D2 batches) for `train.adversarial` with lam > 0 or monitor, else (None, None).

    The iterator yields the D1/D2 batch of step s + 1 as its s-th item, from s = max(start, start_step): steps up
    to `start_step` are plain MLM steps without downstream batches (warm start); a resumed run continues the
    same sequence.
    """
    c = run.config
    a = c.train.adversarial
    if a.lam <= 0 and not a.monitor:
        return None, None
    from flatlm.data import tasks as tasks_lib
    from flatlm.evaluate.probe import model_feature_fn
    from flatlm.evaluate.runner import load_task, task_names
    from flatlm.train import adversarial as adv

    task = a.task or task_names(c, run.language)[0]
    tasks_lib.check_task(run.language, c.language.name, task)
    cfg = adv.AdversarialConfig(
        lam=a.lam, ridge=a.ridge, d1_size=a.d1_size, d2_size=a.d2_size, loss=a.loss, ce_scale=a.ce_scale,
        cap_at_chance=a.cap_at_chance, projection_dim=a.projection_dim, projection_seed=a.projection_seed,
        normalize=a.normalize, task=task, num_classes=tasks_lib.num_classes(run.language, c.language.name, task),
        # HMM D1/D2 are sampled here with this label definition; PCFG ones come labelled from the task's split
        label_definition=(c.eval.task_definition or "sampled") if c.language.name == "hmm" else "sampled",
        pool_size=a.pool_size, seed=c.seed, monitor=a.monitor)
    kw = dict(start=max(start, a.start_step), process_index=jax.process_index(), process_count=jax.process_count())
    if c.language.name == "hmm":
        batches = adv.downstream_batches(run.language, int(task[1:]), a.d1_size, a.d2_size, c.seed,
                                         definition=cfg.label_definition, pool_size=a.pool_size, **kw)
    else:  # D1/D2 from the task's training split: the same data the probe is trained on
        train = load_task(run, task, quiet=True)["train"]
        batches = adv.pool_batches(train["tokens"], train["label"], a.d1_size, a.d2_size, c.seed, **kw)
    return adv.make_objective(cfg, model_feature_fn(run.model)), batches


def evaluate_exact_loss(run: Run, params, limit: int | None = None) -> dict:
    bs = run.config.eval.batch_size
    with run.mesh, nn.logical_axis_rules(run.rules):
        return exact_loss(run.model, params, run.eval_batches(bs, limit), run.config.eval.num_subsets, pad_to=bs)


class ConvergenceWatch:
    """Detects when the exact KL stops improving and pins log-spaced checkpoint steps after that point.

    State lives in `<workdir>/convergence.json`, so a resumed run keeps its schedule.
    """

    def __init__(self, cfg, total_steps: int, workdir: str, pinned: ckpt.PinnedSteps):
        self.cfg, self.total, self.pinned = cfg, total_steps, pinned
        self.path = os.path.join(workdir, "convergence.json")
        self.state = {"best": None, "stalls": 0, "converged_at": None, "log_steps": []}
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.state = json.load(f)
        pinned.pin(*self.state["log_steps"])

    def update(self, step: int, kl: float) -> None:
        s = self.state
        if not self.cfg.after_convergence or s["converged_at"] is not None:
            return
        if s["best"] is None or kl < s["best"] * (1 - self.cfg.convergence_tol):
            s["best"], s["stalls"] = kl, 0
        else:
            s["stalls"] += 1
        if s["stalls"] >= self.cfg.convergence_patience:
            s["converged_at"] = step
            steps, x = [], float(step)
            while round(x) <= self.total:
                steps.append(int(round(x)))
                x *= self.cfg.log_factor
            s["log_steps"] = sorted(set(steps))
            self.pinned.pin(*s["log_steps"])
            log.info("exact KL converged at step %d; keeping checkpoints at %s", step, s["log_steps"])
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(s, f)
        os.replace(tmp, self.path)


class _Preemption:
    """Turns SIGTERM into a flag the loop checks between steps."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread (e.g. a notebook worker): no handler
            self._old = None
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def train_and_evaluate(config, workdir: str, progress: bool = True, objective=None) -> dict:
    """Train (resuming if `workdir` has checkpoints), evaluating the exact loss; returns the last eval."""
    maybe_initialize_distributed(config)
    config_lib.validate(config, jax.device_count())
    os.makedirs(workdir, exist_ok=True)
    if jax.process_index() == 0:
        config_lib.save_workdir_config(config, workdir)
    run = build_run(config, workdir, quiet=not progress)
    c = config
    pinned = ckpt.PinnedSteps(c.checkpoint.steps)
    convergence = ConvergenceWatch(c.checkpoint, c.train.steps, workdir, pinned)
    mngr = ckpt.manager(workdir, keep=c.checkpoint.keep, pinned=pinned)
    it = pipeline.train_iterator(c.data, run.num_words, c.seed, source=run.sources.get("train"),
                                 language=run.language, process_index=jax.process_index(),
                                 process_count=jax.process_count())
    start = mngr.latest_step()
    if start is not None:
        state = ckpt.restore(mngr, start, run.abstract_state(), it)
        log.info("resumed from step %d", start)
    else:
        start = 0
        state = init_state(run)
    adv_objective, down_batches = adversarial_setup(run, start)
    step_fn = jit_train_step(run, objective or adv_objective or mlm_objective)
    warm_until = c.train.adversarial.start_step if down_batches is not None else 0
    plain_step_fn = jit_train_step(run, mlm_objective) if start < warm_until else None
    writer = MetricWriter(workdir, enabled=jax.process_index() == 0)
    # Test hook: die like a preempted VM at this step (only in workdirs containing ..._WORKDIR, if set).
    kill_at = int(os.environ.get("FLATLM_DEBUG_SIGKILL_AT_STEP", "-1"))
    if os.environ.get("FLATLM_DEBUG_SIGKILL_WORKDIR", "") not in os.path.abspath(workdir):
        kill_at = -1
    last_eval: dict = {}
    pending = None  # (step, device metrics) of the previous step, pulled after the next dispatch
    last_saved = start
    bar = tqdm(total=c.train.steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
               disable=not progress or jax.process_index() != 0, file=sys.stderr)
    t_last, steps_since = time.time(), 0

    def flush(entry):
        nonlocal t_last, steps_since
        step, metrics = entry
        metrics = jax.device_get(metrics)
        if not np.isfinite(metrics["train/loss"]) or not np.isfinite(metrics["train/param_norm"]):
            raise NonFiniteLoss(
                f"non-finite loss at step {step}; the last good checkpoint (step {last_saved}) is intact; "
                "lower --config.train.lr or enable --config.train.grad_clip"
            )
        if step % c.train.log_every == 0 or step == c.train.steps:
            now = time.time()
            metrics["train/steps_per_sec"] = steps_since / max(now - t_last, 1e-9)
            t_last, steps_since = now, 0
            writer.write(step, metrics)
            bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", refresh=False)

    with run.mesh, nn.logical_axis_rules(run.rules), _Preemption() as preempt:
        for step in range(start + 1, c.train.steps + 1):
            if step <= warm_until:  # warm start: plain MLM before the adversarial objective
                state, metrics = plain_step_fn(state, sharding.global_batch(next(it), run.mesh))
            else:
                local = next(it) if down_batches is None else {**next(it), **next(down_batches)}
                state, metrics = step_fn(state, sharding.global_batch(local, run.mesh))
            if pending is not None:
                flush(pending)
            pending = (step, metrics)
            steps_since += 1
            bar.update(1)
            last = step == c.train.steps
            if step % c.train.eval_every == 0 or last:
                flush(pending)
                pending = None
                last_eval = {f"eval/{k}": v for k, v in evaluate_exact_loss(run, state["params"]).items()}
                writer.write(step, last_eval)
                if jax.process_index() == 0:
                    convergence.update(step, last_eval["eval/kl"])
                bar.set_postfix(loss=f"{last_eval['eval/loss']:.4f}", kl=f"{last_eval['eval/kl']:.2e}")
            if step % c.checkpoint.every == 0 or last or step in pinned.steps or preempt.requested:
                if pending is not None:
                    flush(pending)
                    pending = None
                ckpt.save(mngr, step, state, it)
                last_saved = step
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if preempt.requested:
                bar.write(f"SIGTERM: checkpoint saved at step {step}; rerun the same command to resume")
                break
        if pending is not None:
            flush(pending)
    bar.close()
    writer.close()
    mngr.close()
    return last_eval
