"""A tensorflow-datasets builder (array_record, no TensorFlow) that materialises a language's corpus.

Splits: `train` (tokens, length) and `validation` (tokens, length, exact conditionals q[T, V] with
q[t, w] = P(x_t = w | x_-t)); latent variables the language exposes as int arrays of shape [T] (e.g. HMM
states) are stored too. The train split's tokens and lengths are also saved as two .npy arrays beside it
(`corpus_arrays`), which the training pipeline memory-maps: decoding records costs ~60 us a sentence, too slow to
feed an accelerator. A corpus is identified by a hash of (language spec, sizes, seed), so two runs
with the same language share one copy, and a half-written build is never visible (tfds writes into
`incomplete.*` and renames at the end). A dataset is built under the lock of its folder (`building`): a second
process that needs the same dataset waits for the first (one line on stderr) and then finds it built; leftovers
`incomplete.*` of a killed build are removed under that lock before building.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds

from flatlm import locks, paths
from flatlm.errors import UserError, disk_full_is_one_line
from flatlm.languages import make_language

CHUNK = 1024  # sentences sampled (and conditioned) at a time while writing
EXAMPLE_FRAMING = 100  # bytes per stored sentence beyond its arrays (feature names, lengths), at least


@dataclasses.dataclass
class CorpusConfig(tfds.core.BuilderConfig):
    """`spec`: the language section of a config as JSON; sizes in sentences."""

    spec: str = "{}"
    train_size: int = 0
    eval_size: int = 0
    seed: int = 0


def corpus_config(language_spec: dict, train_size: int, eval_size: int, seed: int) -> CorpusConfig:
    """The builder config of a corpus: named by a hash of its language spec, sizes and seed."""
    payload = json.dumps(
        {"spec": language_spec, "train": train_size, "eval": eval_size, "seed": seed}, sort_keys=True
    )
    name = f"{language_spec['name']}_{hashlib.sha1(payload.encode()).hexdigest()[:12]}"
    return CorpusConfig(
        name=name, description=payload, spec=json.dumps(language_spec, sort_keys=True),
        train_size=train_size, eval_size=eval_size, seed=seed,
    )


class FlatlmCorpus(tfds.core.GeneratorBasedBuilder):
    """Sentences sampled from a flatlm language; validation carries the exact MLM conditionals."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "First release."}

    @property
    def language(self):
        """The generative language of this corpus (built from the spec, cached)."""
        if not hasattr(self, "_language"):
            self._language = make_language(json.loads(self.builder_config.spec))
        return self._language

    def _latent_names(self) -> list[str]:
        probe = self.language.sample(2, seed=0)
        return sorted(k for k, v in probe.latents.items()
                      if isinstance(v, np.ndarray) and v.shape == probe.tokens.shape)

    def _info(self) -> tfds.core.DatasetInfo:
        lang = self.language
        T, V = lang.max_length, lang.vocab_size
        features = {
            "tokens": tfds.features.Tensor(shape=(T,), dtype=np.int32),
            "length": tfds.features.Scalar(dtype=np.int32),
            "conditionals": tfds.features.Tensor(shape=(None, V), dtype=np.float32),
        }
        for name in self._latent_names():
            features[f"latent_{name}"] = tfds.features.Tensor(shape=(T,), dtype=np.int32)
        return tfds.core.DatasetInfo(
            builder=self, description=self.builder_config.description,
            features=tfds.features.FeaturesDict(features),
        )

    def _split_generators(self, dl_manager):
        c = self.builder_config
        splits = {"validation": self._generate_examples(c.eval_size, c.seed * 2 + 2, with_conditionals=True)}
        if c.train_size:  # 0 for streamed training data: only the validation split is stored
            splits["train"] = self._generate_examples(c.train_size, c.seed * 2 + 1, with_conditionals=False)
        return splits

    def _generate_examples(self, n: int, seed: int, with_conditionals: bool):
        lang, latents = self.language, self._latent_names()
        T, V = lang.max_length, lang.vocab_size
        empty = np.zeros((0, V), np.float32)
        arrays = [] if not with_conditionals else None  # the train split's tokens and lengths, for corpus_arrays
        for start in range(0, n, CHUNK):
            size = min(CHUNK, n - start)
            corpus = lang.sample(size, seed=seed * 1_000_003 + start // CHUNK)
            if arrays is not None:
                arrays.append((corpus.tokens.astype(np.int32), corpus.lengths.astype(np.int32)))
            q = np.asarray(lang.conditionals(corpus.tokens, corpus.lengths), np.float32) if with_conditionals else None
            for i in range(size):
                ex = {"tokens": corpus.tokens[i].astype(np.int32), "length": np.int32(corpus.lengths[i]),
                      "conditionals": q[i] if q is not None else empty}
                for name in latents:
                    ex[f"latent_{name}"] = np.asarray(corpus.latents[name][i], np.int32)
                assert ex["tokens"].shape == (T,)
                yield start + i, ex
        if arrays is not None and arrays:
            self.generated_train = tuple(np.concatenate(a) for a in zip(*arrays))


@contextlib.contextmanager
def building(builder_cls: type[tfds.core.DatasetBuilder], config_name: str, data_dir: str) -> Iterator[None]:
    """Hold the lock of the dataset folder `<data_dir>/<builder name>/<config_name>` for the `with` block,
    waiting (one line on stderr naming the pid) while another process builds it, and remove the `incomplete.*`
    folders that killed builds left there. Create the builder inside the block: it then sees a finished build."""
    folder = Path(data_dir, builder_cls.name, config_name)
    what = f"building dataset {builder_cls.name}/{config_name} in {data_dir}"
    with locks.waiting(folder / locks.LOCK, what, announce=True):
        for leftover in folder.glob("incomplete.*"):  # no one else builds it now: a killed build's
            shutil.rmtree(leftover, ignore_errors=True)
        yield


def split_bytes(builder: FlatlmCorpus) -> dict[str, int]:
    """A low estimate of each split's size on disk: 4 bytes per stored int (tokens, length, latents) plus framing
    per sentence; validation also stores the [T, V] float32 conditionals of each sentence."""
    lang, c = builder.language, builder.builder_config
    T, V = lang.max_length, lang.vocab_size
    per_sentence = 4 * (T + 1 + T * len(builder._latent_names())) + EXAMPLE_FRAMING
    return {"train": int(c.train_size) * per_sentence, "validation": int(c.eval_size) * (per_sentence + 4 * T * V)}


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def check_space(builder: FlatlmCorpus, data_dir: str) -> None:
    """Refuse (one line naming the estimate, the free space and the field to lower) a corpus that cannot fit."""
    need, free = split_bytes(builder), shutil.disk_usage(data_dir).free
    if sum(need.values()) <= free:
        return
    c = builder.builder_config
    field = "data.train_size" if need["train"] >= need["validation"] else "data.eval_size"
    raise UserError(f"the corpus ({c.train_size:,} train + {c.eval_size:,} validation sentences) needs at least "
                    f"{_gb(sum(need.values()))} but {data_dir} has {_gb(free)} free; lower {field} "
                    "or point data.data_dir at a larger disk")


def build(language_spec: dict, data_dir: str, train_size: int, eval_size: int, seed: int,
          quiet: bool = False) -> FlatlmCorpus:
    """Materialise the corpus in `data_dir` (no-op if it is already there; refused if it cannot fit on the
    disk, see `check_space`). Returns the builder."""
    if paths.is_cloud(data_dir):
        raise UserError(f"data.data_dir={data_dir} is in a bucket; corpora are built and read as local array_record "
                        "files: set --config.data.data_dir to a local folder (a cloud workdir's default is "
                        "~/.cache/flatlm/data)")
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    config = corpus_config(dict(language_spec), train_size, eval_size, seed)
    with building(FlatlmCorpus, config.name, data_dir):
        builder = FlatlmCorpus(data_dir=os.fspath(data_dir), config=config, file_format="array_record")
        if not builder.is_prepared():
            check_space(builder, data_dir)
        with tfds_output(quiet):
            builder.download_and_prepare()
        if getattr(builder, "generated_train", None) is not None:  # written under the lock, after the records
            save_arrays(builder.data_dir, "train", *builder.generated_train)
            del builder.generated_train
    forget_language(builder)
    return builder


def forget_language(builder: tfds.core.DatasetBuilder) -> None:
    """Drop a built corpus's or task's language, and with it the programs its sampler and exact conditionals
    compiled. tfds keeps every builder it made alive (its `info` is an unbounded lru_cache), so a language left on
    one stayed for the process's life: a PCFG's chart kernels, ~860 code mappings per corpus, until an experiment
    over many seeds hit the kernel's vm.max_map_count. `builder.language` makes it again if asked."""
    builder.__dict__.pop("_language", None)


@contextlib.contextmanager
def tfds_output(quiet: bool) -> Iterator[None]:
    """Around a tfds `download_and_prepare`: its "Downloading and preparing dataset" banner goes to stderr (stdout
    is for results), and with `quiet` the banner, the progress bars and tfds' own log lines are dropped."""
    if quiet:
        tfds.disable_progress_bar()
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open(os.devnull, "w")) if quiet else sys.stderr  # noqa: SIM115 - in stack
        stack.enter_context(contextlib.redirect_stdout(sink))
        stack.enter_context(_quiet_logs(quiet))
        yield


@contextlib.contextmanager
def _quiet_logs(quiet: bool) -> Iterator[None]:
    """With `quiet`, tfds' and absl's INFO / WARNING lines are dropped for the block (errors still show)."""
    loggers = [logging.getLogger(n) for n in ("absl", "tensorflow_datasets")] if quiet else []
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def data_sources(builder: FlatlmCorpus) -> dict:
    """Random-access sources per split (ArrayRecordDataSource)."""
    return builder.as_data_source()


def _array_paths(data_dir, split: str) -> tuple[Path, Path]:
    return Path(data_dir, f"{split}-tokens.npy"), Path(data_dir, f"{split}-lengths.npy")


def save_arrays(data_dir, split: str, tokens_NT: np.ndarray, lengths_N: np.ndarray) -> None:
    """Write a split's tokens (in the smallest unsigned dtype that holds its ids) and lengths beside its records,
    each atomically (a temporary file renamed): a reader sees both files whole or falls back to the records."""
    top = int(tokens_NT.max(initial=0))
    dtype = np.uint8 if top < 2**8 else np.uint16 if top < 2**16 else np.int32
    for path, a in zip(_array_paths(data_dir, split), (tokens_NT.astype(dtype), lengths_N.astype(np.int32))):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with disk_full_is_one_line(f"out of disk space writing {path}; free space in {data_dir} (the corpus "
                                       "itself is complete: rerunning writes these arrays again)"):
                with open(tmp, "wb") as f:
                    np.save(f, a)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def read_items(source, idx: list[int]) -> list[dict]:
    """Records `idx` of a split source, in one batched read where the source has one (`__getitems__`)."""
    return source.__getitems__(idx) if hasattr(source, "__getitems__") else [source[i] for i in idx]


def corpus_arrays(source, quiet: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [N, T], lengths [N]) of a tfds split source, memory-mapped from the arrays the builder saved (in
    generation order: the corpus, in another order than the records' index). A corpus built before the arrays
    existed, or any other source, is read record by record once (in index order) and, for a tfds source, saved."""
    where = getattr(source, "dataset_info", None)
    paths_ = _array_paths(where.data_dir, source.split) if where is not None else None
    if paths_ is not None and all(p.exists() for p in paths_):
        tokens_NT, lengths_N = (np.load(p, mmap_mode="r") for p in paths_)
        if len(lengths_N) == len(source) == len(tokens_NT):
            return tokens_NT, lengths_N
    from tqdm.auto import tqdm  # reason: only this slow path shows progress

    n, parts = len(source), []
    for start in tqdm(range(0, n, 4096), desc="reading the corpus into arrays (once)", disable=quiet or n < 10**5):
        items = read_items(source, list(range(start, min(start + 4096, n))))
        parts.append((np.stack([it["tokens"] for it in items]), np.array([it["length"] for it in items])))
    tokens_NT, lengths_N = (np.concatenate(a) for a in zip(*parts))
    if paths_ is not None:
        save_arrays(where.data_dir, source.split, tokens_NT, lengths_N)
    return tokens_NT, lengths_N

