"""Post hoc: the words-alone probe against the Bayes rate of task k = length // 2 over small HMMs (the cpu preset's
language with other states / words / blocks / length; 10 000 + 3 000 sentences, probe 20 epochs, 2 seeds; no model
trained). Run from the repository root:

    python docs/reproduction/cpu-band/c5-lookup-seeds-52-75/task_ceiling_scan.py
"""

import json

import numpy as np

from flatlm.config import load_config
from flatlm.evaluate.lookup import bayes_accuracy, lookup_features, one_hot_words
from flatlm.evaluate.probe import ProbeConfig, run_probe
from flatlm.languages import make_language

PROBE = ProbeConfig(epochs=20, batch_size=256, lr=1e-3, num_seeds=2)
N_TRAIN, N_TEST = 10_000, 3_000
HMMS = ((12, 20, 3, 8), (12, 20, 1, 8), (16, 20, 2, 8), (24, 20, 3, 8), (24, 32, 4, 10), (32, 32, 4, 8),
        (48, 40, 4, 10))  # (states, words, blocks, length); the first is the cpu preset's


def test_accuracy(features_NF, labels_N, num_classes: int) -> float:
    """The probe's mean test accuracy over its seeds."""
    split = lambda a: {"train": a[:N_TRAIN], "test": a[N_TRAIN:]}  # noqa: E731
    out = run_probe(split(features_NF), split(labels_N), PROBE, num_classes=num_classes, progress=False)
    return out["accuracy"]["test"]["mean"]


for states, words, blocks, length in HMMS:
    c = load_config("configs/hmm_mlm.py:cpu")
    c.language.update(num_states=states, vocab_size=words, num_blocks=blocks, length=length)
    language, k = make_language(c.language), length // 2
    corpus = language.sample(N_TRAIN + N_TEST, seed=1)
    tok, ln, z = corpus.tokens, corpus.lengths, corpus.latents["states"][:, k]
    bayes = bayes_accuracy(language.state_posteriors(tok[N_TRAIN:], ln[N_TRAIN:])[:, k])
    w = test_accuracy(one_hot_words(tok, ln, words), z, states)
    look = test_accuracy(lookup_features(language, tok, ln, progress=False), z, states)
    entropy = float(-np.mean(language.log_prob(tok[N_TRAIN:], ln[N_TRAIN:])) / length)
    print(json.dumps(dict(states=states, words=words, blocks=blocks, length=length, k=k, bayes=round(bayes, 3),
                          words_probe=round(w, 3), lookup=round(look, 3), gap=round(bayes - w, 3),
                          nats_per_word=round(entropy, 3))), flush=True)
