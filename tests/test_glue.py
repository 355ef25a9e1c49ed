"""GLUE SST-2 / QNLI downstream adapter: tfds glue builder on a local fixture, re-tokenisation, OOV, probe."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from flatlm.data import glue
from flatlm.errors import UserError

# A fake OPT vocabulary: word -> "OPT id"; the language keeps K = 6 of them (word ids 0..5).
OPT_IDS = {w: 10 + i for i, w in enumerate("good bad movie plot the what is it was fine ? .".split())}
TOKEN_IDS = np.array([OPT_IDS[w] for w in "good bad movie plot the .".split()])  # word w = OPT token TOKEN_IDS[w]
K, T = len(TOKEN_IDS), 5
UNK_OPT_ID = 3


def whitespace_tokenizer(text: str) -> list[int]:
    return [OPT_IDS.get(w, UNK_OPT_ID) for w in text.split()]


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory):
    """GLUE-format TSVs: SST-2 whose label is "good" vs "bad" as first word; QNLI with string labels."""
    root = tmp_path_factory.mktemp("glue")
    rng = np.random.default_rng(0)
    filler = ["movie", "plot", "the", "was", "fine", "zebra", "."]
    for split, n in [("train", 60), ("dev", 20)]:
        rows = ["sentence\tlabel"]
        for _ in range(n):
            label = int(rng.integers(2))
            words = ["good" if label else "bad"] + list(rng.choice(filler, size=rng.integers(1, 7)))
            rows.append(f"{' '.join(words)}\t{label}")
        (root / "SST-2").mkdir(exist_ok=True)
        (root / "SST-2" / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    (root / "SST-2" / "test.tsv").write_text("index\tsentence\n0\tgood movie\n1\tbad plot .\n")
    (root / "QNLI").mkdir()
    qnli = ["index\tquestion\tsentence\tlabel", "0\twhat is it ?\tit was the movie .\tentailment",
            "1\twhat plot ?\tthe movie was fine fine fine fine .\tnot_entailment"]
    for split in ("train", "dev"):
        (root / "QNLI" / f"{split}.tsv").write_text("\n".join(qnli) + "\n")
    return str(root)


def test_tfds_glue_builder_reads_the_local_files(glue_dir, tmp_path):
    for task, split in [("sst2", "train"), ("sst2", "test"), ("qnli", "validation")]:
        texts, labels = glue.read_tfds(task, glue_dir, split, data_dir=str(tmp_path))
        ref_texts, ref_labels = glue.read_tsv(task, glue_dir, split)
        assert texts == ref_texts
        np.testing.assert_array_equal(labels, ref_labels)
    assert texts[0] == ("what is it ?", "it was the movie .") and list(labels) == [0, 1]  # entailment = 0
    assert list(glue.read_tsv("sst2", glue_dir, "test")[1]) == [-1, -1]
    with pytest.raises(UserError, match="no .*QNLI"):
        glue.read_tsv("qnli", str(tmp_path), "train")


def test_encode_maps_drops_truncates_and_pads():
    pad = K  # special_ids(K).pad
    d = glue.encode([("good zebra movie",), ("zebra",)], [1, 0], whitespace_tokenizer, TOKEN_IDS, T)
    np.testing.assert_array_equal(d.tokens, [[0, 2, pad, pad, pad], [pad] * 5])
    np.testing.assert_array_equal(d.lengths, [2, 0])
    assert d.oov_rate == pytest.approx(2 / 4) and d.tokens.dtype == np.int32
    d = glue.encode([("good zebra movie",)], [1], whitespace_tokenizer, TOKEN_IDS, T, oov=5)
    np.testing.assert_array_equal(d.tokens, [[0, 5, 2, pad, pad]])
    # pairs: question + sep + sentence, longest segment truncated first
    d = glue.encode([("the the", "movie plot movie plot movie")], [0], whitespace_tokenizer, TOKEN_IDS, T,
                    sep_word=5)
    np.testing.assert_array_equal(d.tokens, [[4, 4, 5, 2, 3]])
    assert d.truncated == 1
    with pytest.raises(UserError):
        glue.encode([("good",)], [0], whitespace_tokenizer, TOKEN_IDS, T, oov=K)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="needs transformers (pip install 'flatlm[hf]')")
def test_hugging_face_tokenizer_from_a_local_directory(glue_dir, tmp_path):
    import tokenizers
    import transformers

    vocab = {"<unk>": UNK_OPT_ID, **OPT_IDS}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(tmp_path)
    via_hf = glue.load_downstream("qnli", glue_dir, "train", str(tmp_path), TOKEN_IDS, T, source="tsv")
    via_fn = glue.load_downstream("qnli", glue_dir, "train", whitespace_tokenizer, TOKEN_IDS, T, source="tsv")
    np.testing.assert_array_equal(via_hf.tokens, via_fn.tokens)
    np.testing.assert_array_equal(via_hf.labels, [0, 1])


def test_downstream_data_trains_a_linear_probe(glue_dir, tmp_path):
    """SST-2 fixture -> adapter -> linear probe on concatenated one-hot token embeddings (flatlm.evaluate.probe)."""
    from flatlm.evaluate.probe import ProbeConfig, run_probe

    splits = {s: glue.load_downstream("sst2", glue_dir, s, whitespace_tokenizer, TOKEN_IDS, T,
                                      data_dir=str(tmp_path)) for s in ("train", "validation")}
    assert splits["train"].tokens.shape == (60, T) and splits["train"].oov_rate > 0
    features = {s: np.eye(K + 1, dtype=np.float32)[d.tokens].reshape(len(d), -1) for s, d in splits.items()}
    labels = {s: d.labels for s, d in splits.items()}
    result = run_probe(features, labels, ProbeConfig(lr=1e-2, epochs=40, batch_size=16,
                                                    warmup_steps=0, num_seeds=1),
                       progress=False)
    assert result["accuracy"]["train"]["mean"] == 1.0
    assert result["accuracy"]["validation"]["mean"] >= 0.9
