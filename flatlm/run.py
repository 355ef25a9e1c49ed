"""Open a run without training it: config, language, model, mesh, data splits, downstream tasks, parameters.

`build_run(config, workdir)` is what training, evaluation, flatness and the experiment runner share;
`load_run(workdir)` reads a workdir's `config.json` and gives the same `Run`. Nothing here builds an optimizer:
the optimizer, its state and the train-state shardings live in `flatlm.train`, and `Run.load_params(step)`
restores only the parameters of a checkpoint.

`validate(config, num_devices)` is the one place a config is checked before anything runs: each section is
validated by the layer that owns it, then the checks that span sections.

Multi-host: `initialize_distributed` joins the processes of a run (a TPU pod or cluster JAX detects, or the
coordinator settings `mesh.coordinator_address` / `num_processes` / `process_id` or JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID, as launch/local_multihost.sh sets them). Every process then builds the same
Run; `load_run` fits the mesh to the devices there are, so evaluators run on fewer devices than training had.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from flatlm import checkpoint as ckpt
from flatlm import config as config_lib
from flatlm import data as data_lib
from flatlm import languages, models, paths, sharding
from flatlm.compile_options import run_once
from flatlm.config import check_choice, check_positive
from flatlm.data import builder as builder_lib
from flatlm.data import pipeline
from flatlm.data import tasks as tasks_lib
from flatlm.data.masking import mask_batch
from flatlm.errors import UserError
from flatlm.models import stacking
from flatlm.models.blocks import ALL, block_mask

# the paper's tasks (A.1): HMM task-6 and task-10 (1-based: 0-based positions 5 and 9), PCFG A, B, C
DEFAULT_TASKS = {"hmm": ("task-6", "task-10"), "pcfg": ("A", "B", "C"), "opt": ("qnli", "sst2"), "scb": ("position",)}


def validate(config, num_devices: int | None = None) -> None:
    """Check what opening a run needs (language, data, model, checkpoint, mesh sections): one line naming
    `section.field` and the fix on failure. Training adds its own section (`flatlm.train.validate_config`)."""
    languages.validate_config(config.language)
    data_lib.validate_config(config.data)
    models.validate_config(config.model)
    ckpt.validate_config(config.checkpoint)
    check_positive(config.eval, "eval", "num_subsets", "batch_size")
    check_choice(config.eval.get("loss_average", "token"), ("token", "sentence"), "eval.loss_average")
    grid = config.eval.finetune.get("lr_grid", ())
    if any(isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0 for lr in grid):
        raise UserError(f"config.eval.finetune.lr_grid={tuple(grid)} must hold positive learning rates, e.g. "
                        "--config.eval.finetune.lr_grid=[1e-4,1e-3,1e-2]; () for the fixed eval.finetune.lr")
    layers, depth = tuple(config.eval.probe.get("layers", ())), models.depth(config.model)
    if any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= depth for k in layers):
        raise UserError(f"config.eval.probe.layers={layers} must name layers 1..{depth} of the model, e.g. "
                        "--config.eval.probe.layers=[1]; () probes the last layer only")
    if config.data.eval_size < config.eval.num_subsets:
        raise UserError(f"config.data.eval_size={config.data.eval_size} is smaller than eval.num_subsets="
                        f"{config.eval.num_subsets} (the exact loss's std is over that many subsets); raise it")
    if num_devices is not None:
        sharding.validate_config(config, num_devices)
        _warn_unsharded(config, num_devices)


def _warn_unsharded(config, num_devices: int) -> None:
    """Tensor parallelism over a model axis that divides neither heads nor d_model shards nothing: say so once."""
    _, model_axis = sharding.mesh_shape(config, num_devices)
    if config.model.kind != "bert" or model_axis <= 1 or config.mesh.parallelism != "tp":
        return
    d, heads = models.bert_dims(config.model)
    if heads % model_axis and d % model_axis and (d, heads, model_axis) not in _WARNED:
        _WARNED.add((d, heads, model_axis))
        logging.getLogger("flatlm").warning(
            "mesh.model=%d divides neither the %d heads nor d_model=%d: those parameters stay replicated",
            model_axis, heads, d)


_WARNED: set = set()


COORDINATOR_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")  # JAX reads the first itself


def coordinator_settings(mesh=None) -> tuple[str, int, int] | None:
    """(coordinator address, number of processes, this process's id) of a multi-host run that JAX cannot detect
    (not a TPU pod, SLURM, ...): `mesh.coordinator_address` / `mesh.num_processes` / `mesh.process_id`, each
    defaulting to the environment variable JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.
    None when none of the three is set; UserError (one line) when they are incomplete or inconsistent."""
    env = [os.environ.get(k, "").strip() for k in COORDINATOR_ENV]
    given = [str(mesh.coordinator_address) if mesh is not None and mesh.coordinator_address else env[0],
             str(mesh.num_processes) if mesh is not None and int(mesh.num_processes) > 0 else env[1],
             str(mesh.process_id) if mesh is not None and int(mesh.process_id) >= 0 else env[2]]
    if not any(given):
        return None
    names = [f"mesh.{f} ({e})" for f, e in zip(("coordinator_address", "num_processes", "process_id"),
                                               COORDINATOR_ENV)]
    missing = [n for n, v in zip(names, given) if not v]
    if missing:
        raise UserError(f"a multi-host run needs all three coordinator settings but {', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} not set; set them (config field or environment "
                        "variable) or none (a TPU pod or a cluster JAX detects)")
    address, count, index = given
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"coordinator address {address!r} is not HOST:PORT; set mesh.coordinator_address "
                        "(or JAX_COORDINATOR_ADDRESS) to e.g. 10.0.0.2:8476")
    try:
        count, index = int(count), int(index)
    except ValueError:
        raise UserError(f"the number of processes ({count!r}) and the process id ({index!r}) must be integers; "
                        "fix mesh.num_processes / mesh.process_id (or JAX_NUM_PROCESSES / JAX_PROCESS_ID)") from None
    if count < 1 or not 0 <= index < count:
        raise UserError(f"process id {index} is not in 0..{count - 1} (num_processes={count}); fix "
                        "mesh.process_id / mesh.num_processes (or JAX_PROCESS_ID / JAX_NUM_PROCESSES)")
    return address, count, index


def _stdout_for_results_only() -> None:
    """Native code (gloo: "[Gloo] Rank 0 is connected to 7 peer ranks...") writes on file descriptor 1: point it at
    stderr, and `sys.stdout` at a copy of the original stdout, so stdout keeps only what flatlm prints (--json)."""
    if sys.stdout is not sys.__stdout__:  # captured or replaced (pytest, a notebook): leave it
        return
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):
        return
    sys.stdout.flush()
    sys.stdout = os.fdopen(os.dup(fd), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), fd)


def initialize_distributed(config=None) -> None:
    """Join the run's processes (`jax.distributed.initialize`) once, before JAX is used: with the coordinator
    settings (`coordinator_settings`) when given, else by JAX's detection (TPU pod, SLURM, ...) when
    `config.mesh.multihost` (nothing detected: UserError). Neither: a single process. On the CPU, collectives
    across processes use gloo."""
    mesh = config.mesh if config is not None else None
    settings = coordinator_settings(mesh)
    if jax.distributed.is_initialized() or (settings is None and not (mesh is not None and mesh.multihost)):
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only; GPU/TPU ignore it
    if settings is not None:
        address, count, index = settings
        _stdout_for_results_only()
        jax.distributed.initialize(coordinator_address=address, num_processes=count, process_id=index)
        return
    try:
        jax.distributed.initialize()
    except ValueError as e:  # nothing detected: "coordinator_address should be defined." and the like
        raise UserError(f"mesh.multihost=True but JAX detected no TPU pod or cluster ({e}); set "
                        "mesh.coordinator_address, mesh.num_processes and mesh.process_id (or "
                        "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)") from None


def enable_compilation_cache(env: dict | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache for the command line (a second `flatlm train` of the same
    shapes skips XLA's compile: tiny's whole command 8 s -> 4 s on 2 cores). Folder: $FLATLM_COMPILATION_CACHE,
    else JAX's own $JAX_COMPILATION_CACHE_DIR, else ~/.cache/flatlm/jax ($XDG_CACHE_HOME honoured); "off"
    turns it off. Every compile is kept (JAX's 1 s floor would skip a small model's). Returns the folder."""
    env = os.environ if env is None else env
    folder = env.get("FLATLM_COMPILATION_CACHE") or env.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "flatlm", "jax")
    if folder.lower() in ("off", "0", "none", "false"):
        return None
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


def release_compiled() -> None:
    """Drop every compiled program JAX holds (its jit caches) and collect them: call it between runs of one process.

    XLA:CPU maps each compiled program's code into memory, and a process that trains and evaluates run after run
    (`flatlm experiment`, `flatlm evaluate` over an experiment) kept every run's programs: ~1600 mappings per cpu
    preset run, so a 48-run experiment hit the kernel's limit (vm.max_map_count, 65530 by default) at its 44th run
    and died in LLVM ("Cannot allocate memory", then a segfault). What the next run needs is compiled again, or
    read back from the persistent compilation cache (`enable_compilation_cache`)."""
    jax.clear_caches()
    gc.collect()


def check_workdir(workdir: str) -> None:
    """UserError unless `workdir` is a folder or does not exist yet (local or gs://, whose client must be
    installed: `flatlm.paths.check_backend`)."""
    path = paths.path(workdir)
    if path.exists() and not path.is_dir():
        raise UserError(f"--workdir {workdir} is a file; pass a folder (new or holding a run)")


LOCAL_DATA_CACHE = os.path.join("~", ".cache", "flatlm", "data")  # corpora of runs whose workdir is in a bucket


def data_dir(config, workdir: str) -> str:
    """Where the run's corpora and task splits live: `data.data_dir`, else `<workdir>/data`; for a workdir in a
    bucket, the local `~/.cache/flatlm/data` (corpora are read as local array_record files; a corpus folder is
    named by its language, sizes and seed, so a shared cache never mixes two corpora)."""
    if config.data.data_dir:
        return config.data.data_dir
    if paths.is_cloud(workdir):
        return os.path.expanduser(LOCAL_DATA_CACHE)
    return os.path.join(workdir, "data")


def prepare_data(config, workdir: str, quiet: bool = False) -> dict:
    """Build the tfds corpus once (process 0, others wait) and open its splits: {split: data source}."""
    train_size = config.data.train_size if config.data.source == "tfds" else 0
    kw = dict(language_spec=config.language.to_dict(), data_dir=data_dir(config, workdir),
              train_size=train_size, eval_size=config.data.eval_size, seed=config.seed, quiet=quiet)
    if jax.process_index() == 0:
        builder = builder_lib.build(**kw)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("flatlm-data-built")
    if jax.process_index() != 0:
        builder = builder_lib.build(**kw)
    return builder_lib.data_sources(builder)


def task_names(config, language=None) -> tuple[str, ...]:
    """The run's downstream tasks: `eval.tasks`, else the language's defaults (checked against `language` when
    given: a run already trained was checked then)."""
    downstream = config.eval.get("downstream")
    names = (tuple(config.eval.tasks) or (tuple(downstream.tasks) if downstream is not None else ())
             or DEFAULT_TASKS.get(config.language.name, ()))
    if language is not None:
        for t in names:
            tasks_lib.check_task(language, config.language.name, t)
    return names


@dataclasses.dataclass
class Run:
    """Everything built from a config that training and the evaluators share (no optimizer)."""

    config: object
    workdir: str
    language: object
    model: nn.Module
    mesh: jax.sharding.Mesh
    rules: tuple
    sources: dict  # split -> grain data source of the corpus
    abstract_boxed: dict  # boxed abstract parameters, with their logical axis names
    param_shardings: dict

    @property
    def num_words(self) -> int:
        """V: the language's words are ids 0..V-1."""
        return self.language.vocab_size

    @property
    def apply_fn(self):
        """`model.apply`: the handle every evaluator takes with the parameters."""
        return self.model.apply

    def abstract_params(self) -> dict:
        """ShapeDtypeStructs of the parameters, with their shardings."""
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            sharding.unbox_abstract(self.abstract_boxed), self.param_shardings)

    def init_params(self) -> dict:
        """The parameters training starts from (`model.init` with the run's seed, as `flatlm.train.loop` draws them;
        under `train.stacking` the final depth's, which training never held), placed with the run's shardings:
        fine-tuning them is the "no pre-training" control (`eval.finetune.from_init`)."""
        init = lambda key: nn.unbox(init_boxed(self.model, self.language.max_length, key))  # noqa: E731
        with sharding.activated(self.mesh, self.rules):
            return run_once(init, jax.random.key(self.config.seed), out_shardings=self.param_shardings)

    def eval_batches(self, batch_size: int | None = None, limit: int | None = None):
        """Validation batches (tokens, length, exact conditionals q), in order: all of them in every process, so
        that an evaluation (a jitted computation every process runs with the same inputs) does not depend on the
        number of processes."""
        bs = batch_size or self.config.eval.batch_size
        return pipeline.eval_batches(self.sources["validation"], bs, limit)

    def train_batches(self, num_batches: int, batch_size: int) -> list[dict]:
        """The first `num_batches` batches of `batch_size` sentences of the run's training stream, masked as training
        masks them (its seed and masking; with `data.fixed_masks`, the masks of every step): the training objective,
        e.g. for flatness at the edge of stability."""
        data = self.config.data.copy_and_resolve_references()
        data.batch_size = batch_size
        ds = pipeline.train_dataset(data, self.num_words, self.config.seed, source=self.sources.get("train"),
                                    language=self.language)
        return [ds[i] for i in range(num_batches)]

    def mlm_batches(self, num_batches: int, batch_size: int, seed: int = 0, masking: str = "single") -> list[dict]:
        """Masked validation sentences in the MLM batch format (tokens/targets/weights), e.g. for flatness.

        Deterministic in `seed`; batches are disjoint as long as the validation split is large enough.
        """
        rng = np.random.default_rng(seed)
        return [mask_batch(b["tokens"], b["length"], self.num_words, rng, masking=masking,
                           mask_prob=self.config.data.mask_prob, max_predictions=self.config.data.max_predictions)
                for b in self.eval_batches(batch_size, limit=num_batches * batch_size)]

    @property
    def steps(self) -> list[int]:
        """Steps with a committed checkpoint of the model's (final) shape, ascending: with `train.stacking` the
        checkpoints of earlier, shallower stages are left out."""
        first = stacking.final_shape_from(stacking.stages_of(self.config))
        return [s for s in ckpt.all_steps(self.workdir) if s >= first]

    def load_params(self, step: int):
        """The parameters of checkpoint `step`, placed with the run's shardings. Checked first: a damaged step is
        moved to `<workdir>/checkpoints_damaged/` and `flatlm.checkpoint.DamagedCheckpoint` raised. UserError for a
        checkpoint of an earlier `train.stacking` stage (a shallower model)."""
        stages = stacking.stages_of(self.config)
        if step < stacking.final_shape_from(stages):
            raise UserError(f"checkpoint {step} is from a train.stacking stage of {stacking.layers_at(stages, step)} "
                            f"layers; evaluators read the final depth: steps >= {stacking.final_shape_from(stages)}")
        return ckpt.restore_params(self.workdir, step, self.abstract_params())

    def checkpoint_params(self, steps):
        """(step, parameters) for each of `steps` in order; a damaged step is moved aside and skipped, with one
        line on stderr (what the evaluators iterate over, so none of them reads a damaged checkpoint)."""
        for step in steps:
            try:
                params = self.load_params(step)
            except ckpt.DamagedCheckpoint as e:
                print(f"flatlm: {e}; skipping it", file=sys.stderr)
                continue
            yield step, params

    def task_names(self) -> tuple[str, ...]:
        """The run's downstream tasks (see `task_names`)."""
        return task_names(self.config, self.language)

    def num_classes(self, task: str) -> int:
        """Number of labels of a downstream task of this run's language (checked against the language)."""
        tasks_lib.check_task(self.language, self.config.language.name, task)
        return tasks_lib.num_classes(self.language, self.config.language.name, task,
                                     self.config.eval.task_definition)

    def load_task(self, task: str, quiet: bool = False) -> dict:
        """A downstream task's splits {train, validation, test: {tokens, length, label}} (built once, cached)."""
        c = self.config
        tasks_lib.check_task(self.language, c.language.name, task)
        if c.language.name == "opt":
            return tasks_lib.glue_task(self.language, task, c.eval.downstream, data_dir(c, self.workdir),
                                       c.eval.task_train_size, c.eval.task_eval_size, c.language.checkpoint)
        sizes = (c.eval.task_train_size, c.eval.task_eval_size, c.eval.task_eval_size)
        return tasks_lib.build_task(c.language.to_dict(), task, data_dir(c, self.workdir), sizes, seed=c.seed,
                                    definition=c.eval.task_definition, quiet=quiet)


def init_boxed(model: nn.Module, max_length: int, key) -> dict:
    """The boxed parameters (with their logical axis names) of `model` drawn from `key`: the one initialisation
    that the parameter shapes, training's starting point and the init control (`Run.init_params`) all use."""
    return model.init(key, jnp.zeros((2, max_length), jnp.int32))["params"]


def build_run(config, workdir: str, quiet: bool = False, fit_mesh: bool = False) -> Run:
    """Validate the config, then build its language, data, model, mesh and parameter shardings. `fit_mesh`: a
    mesh that does not fit the devices there are is shrunk to one that does (`flatlm.sharding.fit_mesh`; for
    evaluators, which may run on fewer devices than training had)."""
    if fit_mesh:
        config = sharding.fit_mesh(config, jax.device_count())
    validate(config, jax.device_count())
    language = languages.make_language(config.language)
    task_names(config, language)  # eval.tasks must name tasks of this language
    model = models.make_model(models.model_config(config.model, language.vocab_size, language.max_length + 1))
    mesh = sharding.make_mesh(config)
    rules = sharding.axis_rules(config.mesh.parallelism)
    with sharding.activated(mesh, rules):
        abstract_boxed = jax.eval_shape(lambda key: init_boxed(model, language.max_length, key),
                                        jax.random.key(config.seed))
        shardings = sharding.param_shardings(abstract_boxed, mesh, rules)
    # train.flat.blocks must name blocks of this model: checked before the data are written
    block_mask(sharding.unbox_abstract(abstract_boxed), config.train.get("flat", {}).get("blocks", ALL))
    sources = prepare_data(config, workdir, quiet=quiet)
    return Run(config, workdir, language, model, mesh, rules, sources, abstract_boxed, shardings)


def load_run(workdir: str, quiet: bool = True) -> Run:
    """The Run of an existing workdir, from its config.json (for evaluators, flatness and the CLI), on the devices
    there are: its mesh is fitted to them (`flatlm.sharding.fit_mesh`), so a run trained on 8 devices (or 2
    processes) is evaluated on 1 as well."""
    return build_run(config_lib.load_workdir_config(workdir), workdir, quiet=quiet, fit_mesh=True)
