"""`train_and_evaluate(config, workdir)`: the whole run, resumable, sharded over the config's mesh.

The step is jitted once with explicit in/out shardings and a donated state; it compiles in a thread while the
state initialises (`compile_options.compile_ahead`). The loop dispatches step t
before pulling step t-1's metrics to the host, so logging never stalls the device. Every `eval_every`
steps the exact pre-training loss (entropy + KL against the true conditionals) is measured on the
validation split. Checkpoints (state + data iterator position) are written every `checkpoint.every`
steps, at the end and on SIGTERM; a run restarts from its latest checkpoint by itself. With `train.stacking` the
model grows between stages (`flatlm.train.stacking`); each checkpoint has its step's depth.
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
import optax
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from flatlm import checkpoint as ckpt
from flatlm import config as config_lib
from flatlm import locks, paths, sharding
from flatlm import run as run_lib
from flatlm import train as train_lib
from flatlm.compile_options import compile_ahead, run_once
from flatlm.data import pipeline
from flatlm.errors import NonFiniteLoss, Preempted, UserError
from flatlm.evaluate.runner import run_exact_loss
from flatlm.metrics import MetricWriter
from flatlm.run import Run, build_run, check_workdir, init_boxed, initialize_distributed
from flatlm.train import adversarial as adv
from flatlm.train import flat_objectives, optim, rank, stacking
from flatlm.train.step import mlm_objective, train_step

log = logging.getLogger("flatlm")


def validate(config, num_devices: int | None = None) -> None:
    """Check a whole training config: what opening a run needs (`flatlm.run.validate`) and the train section."""
    run_lib.validate(config, num_devices)
    train_lib.validate_config(config)
    k = config.train.get("microbatches", 1)
    if num_devices is not None and k > 1:
        data = sharding.mesh_shape(config, num_devices)[0]
        if config.data.batch_size % (data * k):
            raise UserError(f"config.train.microbatches={k} must divide each data shard's rows (data.batch_size="
                            f"{config.data.batch_size} over a data axis of {data}); use a batch size that is a "
                            f"multiple of {data * k} or another microbatches")
    processes = jax.process_count()
    if num_devices is not None and processes > 1:  # each process feeds its own rows of the batch to its devices
        data, model = sharding.mesh_shape(config, num_devices)
        if data * model != num_devices or data % processes:
            raise UserError(f"a multi-host mesh must use all {num_devices} devices with a data axis that is a "
                            f"multiple of the {processes} processes, not {data}x{model}; set --config.mesh.data / "
                            "--config.mesh.model accordingly (e.g. mesh.data=-1)")


@dataclasses.dataclass
class TrainSetup:
    """What training adds to a Run: the optimizer and the shardings of the state {"step", "params", "opt_state"}."""

    optimizer: optax.GradientTransformation
    abstract_boxed: dict  # boxed abstract {"params", "opt_state"} with logical axis metadata
    state_shardings: dict

    def abstract_state(self) -> dict:
        """ShapeDtypeStructs of the whole train state, with their shardings (for restoring)."""
        state = {"step": jax.ShapeDtypeStruct((), jnp.int32), **sharding.unbox_abstract(self.abstract_boxed)}
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state,
                            self.state_shardings)


def _init_boxed(key, run: Run, optimizer):
    params = init_boxed(run.model, run.language.max_length, key)
    return {"params": params, "opt_state": optimizer.init(params)}


def train_setup(run: Run) -> TrainSetup:
    """The optimizer of `run.config.train` and the train state's shardings over the run's mesh."""
    optimizer = optim.optimizer(run.config.train)
    with sharding.activated(run.mesh, run.rules):
        boxed = jax.eval_shape(functools.partial(_init_boxed, run=run, optimizer=optimizer),
                               jax.random.key(run.config.seed))
        shardings = {"step": sharding.replicated(run.mesh), **sharding.param_shardings(boxed, run.mesh, run.rules)}
    return TrainSetup(optimizer, boxed, shardings)


def init_state(run: Run, setup: TrainSetup) -> dict:
    """Fresh state, created directly in its shardings."""

    def init(key):
        return {"step": jnp.zeros((), jnp.int32), **nn.unbox(_init_boxed(key, run, setup.optimizer))}

    with sharding.activated(run.mesh, run.rules):
        return run_once(init, jax.random.key(run.config.seed), out_shardings=setup.state_shardings)


def jit_train_step(run: Run, setup: TrainSetup, objective=mlm_objective):
    """The train step jitted once: explicit shardings, donated state."""
    c = run.config
    step_fn = functools.partial(train_step, apply_fn=run.apply_fn, optimizer=setup.optimizer, seed=c.seed,
                                objective=objective, dropout=(c.model.dropout > 0 or
                                                              getattr(c.model, "attention_dropout", 0) > 0),
                                microbatches=c.train.get("microbatches", 1))
    return jax.jit(step_fn, in_shardings=(setup.state_shardings, sharding.batch_sharding(run.mesh)),
                   out_shardings=(setup.state_shardings, sharding.replicated(run.mesh)), donate_argnums=0)


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
    task = a.task or run.task_names()[0]
    # HMM D1/D2 are sampled here with this label definition; PCFG ones come labelled from the task's split
    definition = (c.eval.task_definition or "sampled") if c.language.name == "hmm" else "sampled"
    cfg = adv.AdversarialConfig(**{**a, "task": task}, num_classes=run.num_classes(task),
                                label_definition=definition, seed=c.seed)
    kw = dict(start=max(start, a.start_step), process_index=jax.process_index(), process_count=jax.process_count())
    if c.language.name == "hmm":
        batches = adv.downstream_iterator(cfg, run.language, **kw)
    else:  # D1/D2 from the task's training split: the same data the probe is trained on
        train = run.load_task(task, quiet=True)["train"]
        batches = adv.pool_batches(train["tokens"], train["label"], a.d1_size, a.d2_size, c.seed, **kw)
    return adv.make_objective(cfg), batches


class ConvergenceWatch:
    """Detects when the exact KL stops improving (and, with `convergence_max_kl`, is inside that band) and pins
    log-spaced checkpoint steps after that point.

    State lives in `<workdir>/convergence.json`, so a resumed run keeps its schedule.
    """

    def __init__(self, cfg, total_steps: int, workdir: str, pinned: ckpt.PinnedSteps):
        self.cfg, self.total, self.pinned = cfg, total_steps, pinned
        self.path = paths.path(workdir, "convergence.json")
        self.state = {"best": None, "stalls": 0, "converged_at": None, "log_steps": []}
        if self.path.exists():
            self.state = json.loads(self.path.read_text())
        pinned.pin(*self.state["log_steps"])

    def update(self, step: int, kl: float) -> None:
        """Record the exact KL of an eval at `step`; on convergence pin the log-spaced checkpoint steps."""
        s = self.state
        if not self.cfg.after_convergence or s["converged_at"] is not None:
            return
        if s["best"] is None or kl < s["best"] * (1 - self.cfg.convergence_tol):
            s["best"], s["stalls"] = kl, 0
        else:
            s["stalls"] += 1
        max_kl = getattr(self.cfg, "convergence_max_kl", 0.0)  # absent from configs written before it existed
        if s["stalls"] >= self.cfg.convergence_patience and (not max_kl or kl <= max_kl):
            s["converged_at"] = step
            steps, x = [], float(step)
            while round(x) <= self.total:
                steps.append(int(round(x)))
                x *= self.cfg.log_factor
            s["log_steps"] = sorted(set(steps))
            self.pinned.pin(*s["log_steps"])
            log.info("exact KL converged at step %d; keeping checkpoints at %s", step, s["log_steps"])
        if jax.process_index() != 0:  # every process keeps the state, process 0 writes it
            return
        paths.write_text(self.path, json.dumps(s))


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

    def anywhere(self) -> bool:
        """Whether any process of the run got SIGTERM: every process asks at every step, so all of them save
        the same step and stop together (one preempted host stops the run, none waits for it forever)."""
        if jax.process_count() == 1:
            return self.requested
        return bool(np.any(multihost_utils.process_allgather(np.int32(self.requested))))

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def check_extension(old, new) -> None:
    """Extending a run (a larger `train.steps`) is exact only if the steps already trained would have used the same
    learning rates: UserError unless the schedule of `new` equals that of `old` on steps 0..old.train.steps."""
    steps = np.arange(old.train.steps + 1)
    before, after = np.asarray(optim.schedule(old.train)(steps)), np.asarray(optim.schedule(new.train)(steps))
    if not np.array_equal(before, after):
        first = int(np.flatnonzero(before != after)[0])
        raise UserError(f"raising train.steps from {old.train.steps} to {new.train.steps} changes the learning rate of "
                        f"steps already trained (from step {first}: schedule={old.train.schedule}, warmup_frac="
                        f"{old.train.warmup_frac} scale with train.steps); only a run with train.schedule=constant "
                        "and train.warmup_frac=0 can be extended exactly: use a new --workdir")


def train_and_evaluate(config, workdir: str, progress: bool = True, objective=None) -> dict:
    """Train (resuming if `workdir` has checkpoints), evaluating the exact loss; returns the last eval.

    Process 0 holds the workdir's lock (`flatlm.locks.exclusive`): another writer there stops with one line."""
    initialize_distributed(config)
    validate(config, jax.device_count())
    check_workdir(workdir)
    config_lib.save_workdir_config(config, workdir, write=False,  # a different run there: refuse before building
                                   check_extension=check_extension)
    created = not paths.path(workdir).exists()
    paths.path(workdir).mkdir(parents=True, exist_ok=True)
    try:
        with locks.exclusive(workdir, "training", enabled=jax.process_index() == 0):
            return _train(config, workdir, progress, objective)
    except jax.errors.JaxRuntimeError as e:  # the step out of accelerator memory: one line naming the fix
        oom = train_lib.out_of_memory_error(e, config, sharding.mesh_shape(config, jax.device_count())[0],
                                            run_lib.data_dir(config, workdir))
        if oom is None:
            raise
        raise oom from e
    except UserError:
        if created and {p.name for p in paths.path(workdir).iterdir()} <= {".lock"}:  # refused before writing
            paths.path(workdir).rmtree(missing_ok=True)  # anything: leave no trace
        raise


def _train(config, workdir: str, progress: bool, objective) -> dict:
    run = build_run(config, workdir, quiet=not progress)  # checks what needs the language (eval.tasks)
    if progress and jax.process_index() == 0:
        k = config.train.get("microbatches", 1)
        accumulate = f"; each step's gradient over {k} microbatches of {config.data.batch_size // k}" if k > 1 else ""
        print(f"flatlm: {jax.device_count()} {jax.default_backend()} device(s) on {jax.process_count()} process(es); "
              f"mesh {dict(run.mesh.shape)}{accumulate}", file=sys.stderr)
    if jax.process_index() == 0:
        config_lib.save_workdir_config(config, workdir, check_extension=check_extension)
    stages = stacking.Stages(run, train_setup)  # one depth, or one per train.stacking stage
    c = config
    pinned = ckpt.PinnedSteps(c.checkpoint.steps)
    convergence = ConvergenceWatch(c.checkpoint, c.train.steps, workdir, pinned)
    mngr = ckpt.manager(workdir, keep=c.checkpoint.keep, pinned=pinned)
    it = pipeline.train_iterator(c.data, run.num_words, c.seed, source=run.sources.get("train"),
                                 language=run.language, process_index=jax.process_index(),
                                 process_count=jax.process_count())
    # damaged steps moved aside; each step restored at its own depth
    state, start = ckpt.restore_latest(mngr, lambda s: stages.at(s)[1].abstract_state(), it)
    run_s, setup = stages.at(start)  # the Run at the depth being trained (`run` itself without stacking)
    adv_objective, down_batches = adversarial_setup(run, start)
    flat_objective = flat_objectives.make_objective(flat_objectives.FlatConfig(**config.train.get("flat", {})))
    step_objective = objective or adv_objective or flat_objective or mlm_objective
    step_fn = jit_train_step(run_s, setup, step_objective)
    warm_until = c.train.adversarial.start_step if down_batches is not None else 0
    plain_step_fn = jit_train_step(run_s, setup, mlm_objective) if start < warm_until else None
    writer = MetricWriter(workdir, enabled=jax.process_index() == 0, resume_step=start)
    # Test hooks: at this step send ourselves SIGKILL (die like a crashed VM) or SIGTERM (a preempted one), only
    # in workdirs whose path contains FLATLM_DEBUG_SIGKILL_WORKDIR, if that is set.
    debug_signals = {}
    if os.environ.get("FLATLM_DEBUG_SIGKILL_WORKDIR", "") in os.path.abspath(workdir):
        for name, sig in (("SIGKILL", signal.SIGKILL), ("SIGTERM", signal.SIGTERM)):
            debug_signals[int(os.environ.get(f"FLATLM_DEBUG_{name}_AT_STEP", "-1"))] = sig
    # Test hook: FLATLM_DEBUG_DATA_LOG=PREFIX appends {"step", "process", "targets"} of every batch this process
    # read to PREFIX.<process>.jsonl (what each process of a multi-host run saw)
    data_log = os.environ.get("FLATLM_DEBUG_DATA_LOG")
    data_log = open(f"{data_log}.{jax.process_index()}.jsonl", "a") if data_log else None  # noqa: SIM115

    def log_batch(step, local):
        if data_log is not None:
            data_log.write(json.dumps({"step": step, "process": jax.process_index(),
                                       "targets": np.asarray(local["targets"]).tolist()}) + "\n")
            data_log.flush()
        return local

    def batch_at(step):  # the global batch of `step`, with its D1/D2 batch after the warm start
        local = log_batch(step, next(it))
        if down_batches is not None and step > warm_until:
            local = {**local, **next(down_batches)}
        return sharding.global_batch(local, run.mesh)

    def step_fn_at(step):  # warm start: plain MLM before the adversarial objective
        return plain_step_fn if step <= warm_until else step_fn

    # The first step compiles while the state initialises (compile_ahead), on the first batch, drawn here.
    first = batch_at(start + 1) if start < c.train.steps and not stages.grows_before(start + 1) else None
    ahead = None if first is None else compile_ahead(
        step_fn_at(start + 1), setup.abstract_state(), first,
        context=functools.partial(sharding.activated, run.mesh, run.rules))
    if state is None:
        state = init_state(run_s, setup)
    else:
        log.info("resumed from step %d", start)
    if ahead is not None:
        ahead.result()
    last_eval: dict = {}
    pending = None  # (step, device metrics) of the previous step, pulled after the next dispatch
    last_saved = start
    bar = tqdm(total=c.train.steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
               disable=not progress or jax.process_index() != 0, file=sys.stderr)
    t_last, steps_since = time.time(), 0
    w0_cache = {}

    def rank_metrics(params) -> dict:
        """train.rank_every: rank of W - W0, W0 recomputed from the seed once (initialisation is deterministic)."""
        if not w0_cache:
            w0_cache["params"] = multihost_utils.process_allgather(init_state(run_s, setup)["params"], tiled=True)
        return rank.update_ranks(multihost_utils.process_allgather(params, tiled=True), w0_cache["params"])

    postfix: dict[str, str] = {}  # the bar's named fields: the training objective and the last exact eval

    def flush(entry):
        nonlocal t_last, steps_since
        step, metrics = entry
        metrics = jax.device_get(metrics)
        if not np.isfinite(metrics["train/loss"]) or not np.isfinite(metrics["train/param_norm"]):
            kept = f"the last good checkpoint (step {last_saved}) is intact" if last_saved else "no checkpoint yet"
            raise NonFiniteLoss(f"non-finite loss at step {step}; {kept}; "
                                "lower --config.train.lr or enable --config.train.grad_clip")
        if step % c.train.log_every == 0 or step == c.train.steps:
            now = time.time()
            metrics["train/steps_per_sec"] = steps_since / max(now - t_last, 1e-9)
            t_last, steps_since = now, 0
            writer.write(step, metrics)
            postfix["train_objective"] = f"{metrics['train/loss']:.4f}"
            bar.set_postfix(postfix, refresh=False)

    with sharding.activated(run.mesh, run.rules), _Preemption() as preempt:
        for step in range(start + 1, c.train.steps + 1):
            if stages.grows_before(step):  # train.stacking: the next stage's depth
                state, (run_s, setup) = stages.grow(state, step), stages.at(step)
                step_fn = jit_train_step(run_s, setup, step_objective)
            batch = first if first is not None else batch_at(step)
            first = None  # drawn before the loop for step start + 1 only
            state, metrics = step_fn_at(step)(state, batch)
            if pending is not None:
                flush(pending)
            pending = (step, metrics)
            steps_since += 1
            bar.update(1)
            if debug_signals.get(step) == signal.SIGTERM:
                os.kill(os.getpid(), signal.SIGTERM)  # arrives during this step, like a real preemption
            last = step == c.train.steps
            stop = preempt.anywhere()
            if step % c.train.eval_every == 0 or last:
                flush(pending)
                pending = None
                t_eval = time.perf_counter()
                last_eval = {f"eval/{k}": v for k, v in run_exact_loss(run_s, state["params"]).items()
                             if not isinstance(v, str)}  # scalars only; "average" is named by the config
                writer.write(step, {**last_eval, "time/exact_loss_s": time.perf_counter() - t_eval})
                convergence.update(step, last_eval["eval/kl"])  # in every process: all must pin the same steps
                postfix.update(exact_loss=f"{last_eval['eval/loss']:.4f} nats", kl=f"{last_eval['eval/kl']:.2e} nats")
                bar.set_postfix(postfix)
            if c.train.get("rank_every", 0) and (step % c.train.rank_every == 0 or last):
                writer.write(step, rank_metrics(state["params"]))
            if step % c.checkpoint.every == 0 or last or step in pinned.steps or stop:
                if pending is not None:
                    flush(pending)
                    pending = None
                ckpt.save(mngr, step, state, it)
                last_saved = step
            if debug_signals.get(step) == signal.SIGKILL:
                os.kill(os.getpid(), signal.SIGKILL)  # after this step's checkpoint, if any
            if stop and not last:
                break
        if pending is not None:
            flush(pending)
    bar.close()
    writer.close()
    if data_log is not None:
        data_log.close()
    mngr.close()
    if last_saved < c.train.steps:  # stopped early: this process or another one got SIGTERM
        raise Preempted(f"interrupted by SIGTERM at step {last_saved} of {c.train.steps}; checkpoint {last_saved} "
                        "is saved; rerun the same command to resume")
    return last_eval
