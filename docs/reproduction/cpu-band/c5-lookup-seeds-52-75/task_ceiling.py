"""Post hoc: how much of HMM task-k a linear probe gets from the words alone, against the Bayes rate and the lookup
table, for the cpu preset's HMM (task k4) and the paper's (100 states, 200 words, length 16; task k6), with no model
trained. Sentences and labels (the sampled state at position k) come from the language itself; the probe is
flatlm's (`run_probe`, 3 seeds).

    python docs/reproduction/cpu-band/c5-lookup-seeds-52-75/task_ceiling.py
"""

import json

import numpy as np

from flatlm.config import load_config
from flatlm.evaluate.lookup import bayes_accuracy, lookup_features, one_hot_words
from flatlm.evaluate.probe import ProbeConfig, run_probe
from flatlm.languages import make_language

CASES = (("configs/hmm_mlm.py:cpu", 4), ("configs/hmm_mlm.py:paper", 6))
N_TRAIN, N_TEST = 20_000, 5_000
PROBE = ProbeConfig(epochs=30, batch_size=256, lr=1e-3, num_seeds=3)


def measure(spec: str, k: int, seed: int = 1) -> dict:
    c = load_config(spec)
    language = make_language(c.language)
    corpus = language.sample(N_TRAIN + N_TEST, seed=seed)
    tok, ln, z = corpus.tokens, corpus.lengths, corpus.latents["states"][:, k]
    split = lambda a: {"train": a[:N_TRAIN], "test": a[N_TRAIN:]}  # noqa: E731
    labels, out = split(z), {"language": spec, "task": f"k{k}", "num_states": c.language.num_states,
                             "vocab_size": c.language.vocab_size, "length": c.language.length}
    post = language.state_posteriors(tok[N_TRAIN:], ln[N_TRAIN:])[:, k]
    out["bayes"] = bayes_accuracy(post)
    out["majority"] = float(np.mean(z[N_TRAIN:] == np.bincount(z[:N_TRAIN]).argmax()))
    feats = {"words": split(one_hot_words(tok, ln, c.language.vocab_size)),
             "lookup": split(lookup_features(language, tok, ln, progress=False)),
             "lookup+words": split(lookup_features(language, tok, ln, progress=False, with_words=True))}
    for name, f in feats.items():
        res = run_probe(f, labels, PROBE, num_classes=c.language.num_states, progress=False)
        out[name] = res["accuracy"]["test"]["mean"]
    return out


if __name__ == "__main__":
    rows = [measure(spec, k) for spec, k in CASES]
    for r in rows:
        print(json.dumps(r), flush=True)
