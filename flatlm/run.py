"""Open a run without training it: config, language, model, mesh, data splits, downstream tasks, parameters.

`build_run(config, workdir)` is what training, evaluation, flatness and the experiment runner share;
`load_run(workdir)` reads a workdir's `config.json` and gives the same `Run`. Nothing here builds an optimizer:
the optimizer, its state and the train-state shardings live in `flatlm.train`, and `Run.load_params(step)`
restores only the parameters of a checkpoint.

`validate(config, num_devices)` is the one place a config is checked before anything runs: each section is
validated by the layer that owns it, then the checks that span sections.
"""

from __future__ import annotations

import dataclasses
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
from flatlm.config import check_positive
from flatlm.data import builder as builder_lib
from flatlm.data import pipeline
from flatlm.data import tasks as tasks_lib
from flatlm.data.masking import mask_batch
from flatlm.errors import UserError

DEFAULT_TASKS = {"hmm": ("k6", "k10"), "pcfg": ("A", "B", "C")}  # the paper's tasks (A.2)


def validate(config, num_devices: int | None = None) -> None:
    """Check what opening a run needs (language, data, model, checkpoint, mesh sections): one line naming
    `section.field` and the fix on failure. Training adds its own section (`flatlm.train.validate_config`)."""
    languages.validate_config(config.language)
    data_lib.validate_config(config.data)
    models.validate_config(config.model)
    ckpt.validate_config(config.checkpoint)
    check_positive(config.eval, "eval", "num_subsets", "batch_size")
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


def initialize_distributed(config) -> None:
    """`jax.distributed.initialize()` once, when the config asks for a multi-host run."""
    if config.mesh.multihost and not jax.distributed.is_initialized():
        jax.distributed.initialize()


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


def task_names(config, language) -> tuple[str, ...]:
    """The run's downstream tasks: `eval.tasks`, else the language's defaults (checked against the language)."""
    names = tuple(config.eval.tasks) or DEFAULT_TASKS.get(config.language.name, ())
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
                            nn.unbox(self.abstract_boxed), self.param_shardings)

    def eval_batches(self, batch_size: int | None = None, limit: int | None = None):
        """Validation batches (tokens, length, exact conditionals q) of this process, in order."""
        bs = batch_size or self.config.eval.batch_size
        return pipeline.eval_batches(self.sources["validation"], bs, limit, jax.process_index(),
                                     jax.process_count())

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
        """Steps with a committed checkpoint, ascending."""
        return ckpt.all_steps(self.workdir)

    def load_params(self, step: int):
        """The parameters of checkpoint `step`, placed with the run's shardings. Checked first: a damaged step is
        moved to `<workdir>/checkpoints_damaged/` and `flatlm.checkpoint.DamagedCheckpoint` raised."""
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
        return tasks_lib.num_classes(self.language, self.config.language.name, task)

    def load_task(self, task: str, quiet: bool = False) -> dict:
        """A downstream task's splits {train, validation, test: {tokens, length, label}} (built once, cached)."""
        c = self.config
        tasks_lib.check_task(self.language, c.language.name, task)
        sizes = (c.eval.task_train_size, c.eval.task_eval_size, c.eval.task_eval_size)
        return tasks_lib.build_task(c.language.to_dict(), task, data_dir(c, self.workdir), sizes, seed=c.seed,
                                    definition=c.eval.task_definition, quiet=quiet)


def build_run(config, workdir: str, quiet: bool = False) -> Run:
    """Validate the config, then build its language, data, model, mesh and parameter shardings."""
    validate(config, jax.device_count())
    language = languages.make_language(config.language)
    task_names(config, language)  # eval.tasks must name tasks of this language
    sources = prepare_data(config, workdir, quiet=quiet)
    model = models.make_model(models.model_config(config.model, language.vocab_size, language.max_length + 1))
    mesh = sharding.make_mesh(config)
    rules = sharding.axis_rules(config.mesh.parallelism)
    tokens = jnp.zeros((2, language.max_length), jnp.int32)
    with mesh, nn.logical_axis_rules(rules):
        abstract_boxed = jax.eval_shape(lambda key: model.init(key, tokens)["params"], jax.random.key(config.seed))
        shardings = sharding.param_shardings(abstract_boxed, mesh, rules)
    return Run(config, workdir, language, model, mesh, rules, sources, abstract_boxed, shardings)


def load_run(workdir: str, quiet: bool = True) -> Run:
    """The Run of an existing workdir, from its config.json (for evaluators, flatness and the CLI)."""
    return build_run(config_lib.load_workdir_config(workdir), workdir, quiet=quiet)
