"""Post hoc, no model trained: does HMM task-k leave room above the words when the word at position k is masked in
the downstream input? Labels: the sampled state z_k. Features, each through flatlm's linear probe (3 seeds):
  words        one-hot words of the masked sentence (position k all zeros)
  cond_k       P(x_k | x_{-k}) (V numbers: what an MLM head must output at the masked position)
  cond_k+words both
  lookup       the exact conditionals of the masked sentence at every position (the lookup table on the masked input)
  posterior_k  P(z_k | x_{-k}) (K numbers: the ideal representation)
against the Bayes rate argmax_z P(z_k = z | x_{-k}); and the unmasked task's words and Bayes rate for reference.

    python docs/reproduction/cpu-band/c5-lookup-seeds-52-75/masked_ceiling.py
"""

import json
import sys

import numpy as np
from task_ceiling import CASES, N_TEST, N_TRAIN, PROBE  # the unmasked task's HMMs, sizes and probe (same folder)

from flatlm.config import load_config
from flatlm.evaluate.lookup import bayes_accuracy, lookup_features, one_hot_words
from flatlm.evaluate.probe import run_probe
from flatlm.languages import make_language
from flatlm.languages.base import special_ids


def measure(spec: str, k: int, seed: int = 1) -> dict:
    c = load_config(spec)
    language = make_language(c.language)
    V = c.language.vocab_size
    corpus = language.sample(N_TRAIN + N_TEST, seed=seed)
    tok, ln, z = corpus.tokens, corpus.lengths, corpus.latents["states"][:, k]
    masked = tok.copy()
    masked[:, k] = special_ids(V).mask
    split = lambda a: {"train": a[:N_TRAIN], "test": a[N_TRAIN:]}  # noqa: E731
    labels = split(z)
    out = {"language": spec, "task": f"k{k}", "num_states": c.language.num_states, "vocab_size": V,
           "length": c.language.length, "n_train": N_TRAIN, "n_test": N_TEST}
    post_NK = language.state_posteriors(masked, ln)[:, k]
    out["bayes_masked"] = bayes_accuracy(post_NK[N_TRAIN:])
    out["bayes_unmasked"] = bayes_accuracy(language.state_posteriors(tok[N_TRAIN:], ln[N_TRAIN:])[:, k])
    out["majority"] = float(np.mean(z[N_TRAIN:] == np.bincount(z[:N_TRAIN]).argmax()))
    words = one_hot_words(tok, ln, V).reshape(len(tok), -1, V)
    words[:, k] = 0
    words = words.reshape(len(tok), -1)
    cond_k = language.conditionals(tok, ln)[:, k].astype(np.float32)  # P(x_k | x_{-k}) never reads x_k
    feats = {"words": words, "cond_k": cond_k, "cond_k+words": np.concatenate([cond_k, words], 1),
             "lookup": lookup_features(language, masked, ln, progress=False),
             "posterior_k": post_NK.astype(np.float32),
             "words_unmasked": one_hot_words(tok, ln, V)}
    for name, f in feats.items():
        res = run_probe(split(f), labels, PROBE, num_classes=c.language.num_states, progress=False)
        out[name] = res["accuracy"]["test"]["mean"]
        print(name, out[name], file=sys.stderr, flush=True)
    return out


if __name__ == "__main__":
    for spec, k in CASES:
        print(json.dumps(measure(spec, k)), flush=True)
