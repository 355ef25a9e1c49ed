"""Downstream task datasets: sentences from the language with labels, as tfds splits (train/validation/test).

Task names per language:
  HMM:  "task-<k>" — the paper's task-k (A.1): classify the k-th hidden variable, 1-based (task-6 is the 6th
        variable, 0-based position 5); "k<i>" — the hidden state at 0-based position i (so task-6 == k5).
        Definition "sampled" (the state that generated the sentence, default) or "posterior" (argmax P(z_i | x)).
  PCFG: "A", "B", "C" — released definition (default), "posterior" or "paper"; see `flatlm.languages.pcfg`.
  SCB:  "position" — the context position s (0-based, T classes) the last word was drawn from (latents["position"]):
        which earlier position the last word "attended".
  OPT:  "sst2", "qnli" — GLUE from local TSV files re-tokenised into the K words (`flatlm.data.glue`; the
        paper's Figures 1b, 2c, 5b); splits train and validation (GLUE's test split has no labels).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds

from flatlm.data import glue
from flatlm.data.builder import building, forget_language, tfds_output
from flatlm.errors import UserError
from flatlm.languages import make_language

SPLITS = ("train", "validation", "test")


def default_definition(language_name: str) -> str:
    """The label definition used when the config leaves it empty: HMM "sampled", PCFG "released"."""
    return {"hmm": "sampled", "pcfg": "released"}.get(language_name, "")


def hmm_position(task: str) -> int:
    """0-based position of an HMM task: "task-<k>" (the paper's 1-based k-th variable) -> k - 1; "k<i>" -> i.

    Raises ValueError for any other name."""
    if task.startswith("task-") and task[5:].isdigit() and int(task[5:]) >= 1:
        return int(task[5:]) - 1
    if task.startswith("k") and task[1:].isdigit():
        return int(task[1:])
    raise ValueError(f"HMM task {task!r} is neither task-<k> (the paper's k-th variable, 1-based, e.g. task-6) "
                     "nor k<position> (0-based, e.g. k5)")


def check_task(language, name: str, task: str) -> None:
    """UserError unless `task` is a task of this language (HMM task-<k> / k<position>, PCFG A/B/C)."""
    if name == "hmm":
        try:
            position = hmm_position(task)
        except ValueError as e:
            raise UserError(str(e)) from None
        if position >= language.max_length:
            raise UserError(f"HMM task {task!r} is position {position} (0-based) of sentences of "
                            f"{language.max_length}; use task-1 .. task-{language.max_length}")
    elif name == "pcfg":
        if task not in ("A", "B", "C"):
            raise UserError(f"PCFG task {task!r} is unknown; use A, B or C")
    elif name == "scb":
        if task != "position":
            raise UserError(f"SCB task {task!r} is unknown; use position (the attended context position)")
    elif name == "opt":
        if task not in glue.TASKS:
            raise UserError(f"OPT task {task!r} is unknown; use one of {', '.join(glue.TASKS)} (GLUE, local files)")
    else:
        raise UserError(f"language {name!r} has no downstream tasks")


def num_classes(language, name: str, task: str, definition: str = "") -> int:
    """Number of labels of a task: HMM states, the PCFG nonterminals the task ranges over (by definition), the
    GLUE task's classes, or the SCB's T context positions."""
    if name == "hmm":
        return language.num_states
    if name == "scb":
        return language.context_length
    if name == "opt":
        return len(glue.TASKS[task].label_classes)
    return language.num_labels(task, definition or default_definition(name))


def sample_task(language, name: str, task: str, n: int, seed: int, definition: str = "") -> dict:
    """n labelled sentences: {"tokens" int32[n, T], "length" int32[n], "label" int32[n]}."""
    check_task(language, name, task)
    definition = definition or default_definition(name)
    if name == "hmm":
        corpus = language.sample(n, seed)
        labels = language.task_labels(corpus.tokens, corpus.lengths, hmm_position(task), definition=definition,
                                      states=corpus.latents.get("states"))
    elif name == "scb":
        corpus = language.sample(n, seed)
        labels = corpus.latents["position"]
    else:
        corpus, labels = language.sample_task(n, seed, task, definition=definition)
        T = language.max_length
        if corpus.tokens.shape[1] < T:  # pad to the language's T so every split has one shape
            pad = np.full((n, T - corpus.tokens.shape[1]), language.vocab_size, np.int32)
            corpus.tokens = np.concatenate([corpus.tokens, pad], 1)
    return {"tokens": corpus.tokens.astype(np.int32), "length": corpus.lengths.astype(np.int32),
            "label": np.asarray(labels, np.int32)}


@dataclasses.dataclass
class TaskConfig(tfds.core.BuilderConfig):
    """tfds builder config of a task's splits: language spec, task, sizes, seed and label definition."""
    spec: str = "{}"
    task: str = ""
    definition: str = ""
    sizes: tuple = (0, 0, 0)
    seed: int = 0


class FlatlmTask(tfds.core.GeneratorBasedBuilder):
    """Labelled sentences for one downstream task of a flatlm language."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "First release."}
    CHUNK = 4096

    @property
    def language(self):
        """The generative language of this task (built from the spec, cached)."""
        if not hasattr(self, "_language"):
            self._language = make_language(json.loads(self.builder_config.spec))
        return self._language

    def _info(self):
        T = self.language.max_length
        return tfds.core.DatasetInfo(builder=self, description=self.builder_config.description,
                                     features=tfds.features.FeaturesDict({
                                         "tokens": tfds.features.Tensor(shape=(T,), dtype=np.int32),
                                         "length": tfds.features.Scalar(dtype=np.int32),
                                         "label": tfds.features.Scalar(dtype=np.int32)}))

    def _split_generators(self, dl_manager):
        c = self.builder_config
        return {split: self._generate_examples(size, c.seed * 10 + i + 1)
                for i, (split, size) in enumerate(zip(SPLITS, c.sizes)) if size > 0}

    def _generate_examples(self, n: int, seed: int):
        c = self.builder_config
        name = json.loads(c.spec)["name"]
        for start in range(0, n, self.CHUNK):
            size = min(self.CHUNK, n - start)
            part = sample_task(self.language, name, c.task, size, seed * 1_000_003 + start // self.CHUNK,
                               c.definition)
            for i in range(size):
                yield start + i, {k: v[i] for k, v in part.items()}


def build_task(language_spec: dict, task: str, data_dir: str, sizes: tuple[int, int, int], seed: int,
               definition: str = "", quiet: bool = False) -> dict:
    """Materialise (once) and load a task's splits into memory: {split: {"tokens", "length", "label"}}."""
    definition = definition or default_definition(language_spec["name"])
    payload = json.dumps({"spec": language_spec, "task": task, "definition": definition, "sizes": list(sizes),
                          "seed": seed}, sort_keys=True)
    config = TaskConfig(name=f"{language_spec['name']}_{task}_{hashlib.sha1(payload.encode()).hexdigest()[:12]}",
                        description=payload, spec=json.dumps(language_spec, sort_keys=True), task=task,
                        definition=definition, sizes=tuple(sizes), seed=seed)
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    with building(FlatlmTask, config.name, data_dir):  # one process builds it, others wait for it
        builder = FlatlmTask(data_dir=os.fspath(data_dir), config=config, file_format="array_record")
        check_task(builder.language, language_spec["name"], task)
        with tfds_output(quiet):  # the banner on stderr, and nothing at all with `quiet`
            builder.download_and_prepare()
        forget_language(builder)
    out = {}
    for split, src in builder.as_data_source().items():
        items = src.__getitems__(list(range(len(src))))
        out[split] = {k: np.stack([it[k] for it in items]) for k in ("tokens", "length", "label")}
    return out


def glue_task(language, task: str, downstream, data_dir: str, train_size: int = 0, eval_size: int = 0,
              checkpoint: str = "") -> dict:
    """GLUE `task` for the OPT language: {train, validation: {tokens, length, label}} re-tokenised into its K words.

    `downstream` is a config's `eval.downstream` (glue_dir, tokenizer, oov_word, source); the tokenizer defaults to
    the teacher `checkpoint` directory (its tokenizer files). Sizes > 0 keep the first that many examples of a
    split (file order).
    """
    if not downstream.glue_dir:
        raise UserError("config.eval.downstream.glue_dir is empty; point it at a local folder holding the GLUE "
                        f"{glue.TASKS[task].folder}/ TSV files (nothing is downloaded)")
    tokenizer = downstream.tokenizer or checkpoint
    if not tokenizer:
        raise UserError("config.eval.downstream.tokenizer is empty and the OPT language has no checkpoint directory; "
                        "give a local tokenizer directory or a .json {token: OPT id} vocabulary")
    oov = "drop" if downstream.oov_word < 0 else int(downstream.oov_word)
    out = {}
    for split, n in (("train", train_size), ("validation", eval_size)):
        d = glue.load_downstream(task, downstream.glue_dir, split, tokenizer, language.token_ids,
                                 language.max_length, oov=oov, source=downstream.source,
                                 data_dir=os.path.join(data_dir, "glue"))
        keep = slice(0, n or len(d.labels))
        out[split] = {"tokens": d.tokens[keep], "length": d.lengths[keep], "label": d.labels[keep]}
    return out
