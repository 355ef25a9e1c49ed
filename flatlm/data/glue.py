"""Downstream data for the OPT language: GLUE SST-2 and QNLI re-tokenised into the restricted K-word vocabulary.

Source. The GLUE TSV files in a local manual dir (`<manual_dir>/SST-2/{train,dev,test}.tsv` with header
"sentence\\tlabel"; `<manual_dir>/QNLI/{train,dev,test}.tsv` with header "index\\tquestion\\tsentence\\tlabel"),
read by tensorflow-datasets' own `glue` builder. That builder downloads its zips itself and has no manual mode, so
`LocalGlue` subclasses it and only points its split generators at the local files; preparation writes array_record
files and reading uses `as_data_source`, neither of which needs TensorFlow (checked with tfds 4.9 installed
without TF). Nothing is ever downloaded. `source="tsv"` reads the same files with the builder's parsing
(csv, tab-separated, no quoting) without tfds, for speed. Splits: "train", "validation" (dev.tsv), "test" (labels
-1). Labels as in tfds: SST-2 0 = negative, 1 = positive; QNLI 0 = entailment, 1 = not_entailment.

Tokenisation. A user-supplied function text -> OPT token ids, or a Hugging Face tokenizer from a local directory
(`transformers.AutoTokenizer.from_pretrained(dir, local_files_only=True)`, no special tokens added; text is
tokenised as given, so with OPT's GPT-2 BPE the first word carries no leading-space marker). OPT ids map to words
through the language's `token_ids` (word w = OPT token `token_ids[w]`).

Out-of-vocabulary tokens (OPT tokens outside the K words): dropped by default (`oov="drop"`), because the pre-trained
model's language has exactly the K words and no unknown-word symbol, so any reserved UNK id would be a token the
model never saw in pre-training; `oov=w` maps them to word w instead. A sentence whose tokens are all OOV gets
length 0. `Downstream.oov_rate` reports the fraction of tokens that were OOV.

Length. Sentences are truncated to the model's length T and padded with the pad id (= K). QNLI pairs are
question + [sep word, if given] + sentence, truncated longest-first (one token at a time from the longer
segment, as BERT's tokenizers do) so both segments keep a share of T.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from collections.abc import Callable, Sequence

import numpy as np

from flatlm.errors import UserError
from flatlm.languages.base import special_ids


@dataclasses.dataclass(frozen=True)
class GlueTask:
    """What flatlm needs of a GLUE task: its folder, text columns, label classes (None: integer labels)."""

    folder: str
    text_columns: tuple[str, ...]
    label_classes: tuple[str, ...]


TASKS: dict[str, GlueTask] = {
    "sst2": GlueTask("SST-2", ("sentence",), ("negative", "positive")),
    "qnli": GlueTask("QNLI", ("question", "sentence"), ("entailment", "not_entailment")),
}
SPLIT_FILES = {"train": "train", "validation": "dev", "test": "test"}


@dataclasses.dataclass
class Downstream:
    """A downstream split ready for a probe: tokens int32[n, T] (pad = K), lengths int32[n], labels int32[n]
    (-1 where the split has none), oov_rate (fraction of tokens out of the vocabulary), truncated (count)."""

    tokens: np.ndarray
    lengths: np.ndarray
    labels: np.ndarray
    oov_rate: float
    truncated: int

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def _task(name: str) -> GlueTask:
    if name not in TASKS:
        raise UserError(f"unknown GLUE task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]


def _label(task: GlueTask, raw: str | None) -> int:
    if raw is None or raw == "":
        return -1
    return task.label_classes.index(raw) if raw in task.label_classes else int(raw)


def read_tsv(task: str, manual_dir: str, split: str) -> tuple[list[tuple[str, ...]], np.ndarray]:
    """(texts per example, labels int32[n]) straight from `<manual_dir>/<folder>/<split file>.tsv`."""
    t = _task(task)
    path = os.path.join(manual_dir, t.folder, SPLIT_FILES[split] + ".tsv")
    if not os.path.exists(path):
        raise UserError(f"no {path}; put the GLUE {t.folder} TSV files under {manual_dir}/{t.folder}/")
    texts, labels = [], []
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            texts.append(tuple(row[c] for c in t.text_columns))
            labels.append(_label(t, row.get("label")))
    return texts, np.asarray(labels, np.int32)


def _local_glue_builder():
    """tfds's `glue` builder reading a manual dir instead of downloading (defined lazily: tfds imports slowly)."""
    import tensorflow_datasets as tfds  # start-up time: tfds takes seconds to import, only GLUE needs it here
    from tensorflow_datasets.text import glue  # (same)

    class LocalGlue(glue.Glue, skip_registration=True):
        name = "flatlm_local_glue"
        MANUAL_DOWNLOAD_INSTRUCTIONS = "Put the GLUE task folders (SST-2/, QNLI/) with their TSV files here."

        def _split_generators(self, dl_manager):
            folder = os.path.join(dl_manager.manual_dir, self.builder_config.data_dir)
            return [tfds.core.SplitGenerator(name=split, gen_kwargs={"data_file": os.path.join(folder, f + ".tsv"),
                                                                     "split": f})
                    for split, f in SPLIT_FILES.items() if os.path.exists(os.path.join(folder, f + ".tsv"))]

    return tfds, LocalGlue


def read_tfds(task: str, manual_dir: str, split: str, data_dir: str | None = None):
    """(texts per example, labels int32[n]) through tfds's glue builder, prepared (array_record, once) into
    `data_dir` (default `<manual_dir>/tfds`), in file order."""
    t = _task(task)
    if not os.path.isdir(os.path.join(manual_dir, t.folder)):
        raise UserError(f"no {os.path.join(manual_dir, t.folder)}; put the GLUE {t.folder} TSV files there")
    tfds, LocalGlue = _local_glue_builder()
    builder = LocalGlue(config=task, data_dir=data_dir or os.path.join(manual_dir, "tfds"),
                        file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
    if split not in builder.info.splits:
        raise UserError(f"{task} has no {split} split under {manual_dir} (missing {SPLIT_FILES[split]}.tsv?)")
    source = builder.as_data_source(split=split)
    rows = sorted((source[i] for i in range(len(source))), key=lambda r: int(r["idx"]))
    texts = [tuple(_text(r[c]) for c in t.text_columns) for r in rows]
    return texts, np.asarray([int(r["label"]) for r in rows], np.int32)


def _text(x) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


Tokenizer = Callable[[str], Sequence[int]]


def make_tokenizer(spec: Tokenizer | str) -> Tokenizer:
    """A text -> OPT ids function: `spec` itself if callable; a `.json` file {token: OPT id} (whitespace split,
    unknown tokens -> -1, i.e. out of vocabulary: for pre-tokenised text and tests without transformers); else a
    local HF tokenizer directory."""
    if callable(spec):
        return spec
    if str(spec).endswith(".json") and os.path.isfile(spec):
        with open(spec) as f:
            vocab = {str(k): int(v) for k, v in json.load(f).items()}
        return lambda text: [vocab.get(w, -1) for w in text.split()]
    if not os.path.isdir(spec):
        raise UserError(f"tokenizer must be a function or a local tokenizer directory; {spec!r} is neither")
    try:
        import transformers  # optional extra `flatlm[hf]`
    except ImportError as e:
        raise UserError("loading a tokenizer directory needs transformers (pip install 'flatlm[hf]')") from e
    tok = transformers.AutoTokenizer.from_pretrained(spec, local_files_only=True)
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


def _truncate_longest_first(segments: list[list[int]], budget: int) -> tuple[list[list[int]], bool]:
    segments = [list(s) for s in segments]
    cut = False
    while sum(map(len, segments)) > budget:
        longest = max(range(len(segments)), key=lambda i: (len(segments[i]), -i))
        segments[longest].pop()
        cut = True
    return segments, cut


def encode(texts: Sequence[Sequence[str]], labels, tokenize: Tokenizer | str, token_ids, length: int,
           oov: str | int = "drop", sep_word: int | None = None) -> Downstream:
    """Map texts (one tuple of segments per example) into the K-word vocabulary; see the module docstring."""
    tokenize = make_tokenizer(tokenize)
    token_ids = np.asarray(token_ids)
    K = int(token_ids.size)
    word_of = {int(o): w for w, o in enumerate(token_ids)}
    if oov != "drop" and not (isinstance(oov, int | np.integer) and 0 <= int(oov) < K):
        raise UserError(f"oov must be 'drop' or a word id in 0..{K - 1}, got {oov!r}")
    pad = special_ids(K).pad
    tokens = np.full((len(texts), length), pad, np.int32)
    lengths = np.zeros(len(texts), np.int32)
    n_tok = n_oov = n_cut = 0
    for i, segs in enumerate(texts):
        words = []
        for text in segs:
            ids = [int(x) for x in tokenize(text)]
            n_tok += len(ids)
            mapped = [word_of.get(x, -1) for x in ids]
            n_oov += sum(w < 0 for w in mapped)
            words.append([w for w in mapped if w >= 0] if oov == "drop" else [w if w >= 0 else int(oov)
                                                                             for w in mapped])
        seps = 0 if sep_word is None else len(words) - 1
        words, cut = _truncate_longest_first(words, max(length - seps, 0))
        n_cut += cut
        flat = words[0]
        for seg in words[1:]:
            flat = flat + ([] if sep_word is None else [int(sep_word)]) + seg
        tokens[i, : len(flat)] = flat
        lengths[i] = len(flat)
    return Downstream(tokens, lengths, np.asarray(labels, np.int32), n_oov / max(n_tok, 1), n_cut)


def load_downstream(task: str, manual_dir: str, split: str, tokenize: Tokenizer | str, token_ids, length: int,
                    oov: str | int = "drop", sep_word: int | None = None, source: str = "tfds",
                    data_dir: str | None = None) -> Downstream:
    """GLUE `task` ("sst2" | "qnli") `split` from a local manual dir, re-tokenised for a K-word OPT language
    (`token_ids` = `OPTLanguage.token_ids`, `length` = the model's T). source: "tfds" (the glue builder) | "tsv"."""
    if split not in SPLIT_FILES:
        raise UserError(f"unknown split {split!r}; choose one of {', '.join(SPLIT_FILES)}")
    if source == "tfds":
        texts, labels = read_tfds(task, manual_dir, split, data_dir)
    elif source == "tsv":
        texts, labels = read_tsv(task, manual_dir, split)
    else:
        raise UserError(f"source must be 'tfds' or 'tsv', got {source!r}")
    return encode(texts, labels, tokenize, token_ids, length, oov, sep_word)
