"""The lookup-table baseline (paper, Section 3.2 and A.4): a linear probe on the exact conditionals of every
position.

A "perfect pre-training loss" model outputs q_t = P(x_t | x_{-t}) at every masked position; the paper's
lookup table represents a sentence by the concatenation [q_1; ...; q_T] (float[T*V]; zeros beyond a sentence's
length) and fits the same linear probe on it as on a trained model's features. Comparing it with trained
models shows how much of the downstream accuracy the pre-training loss alone accounts for.

Note that q_t does not depend on x_t itself: the table sees each word only through its neighbours'
conditionals, so even when the words identify a latent label it can fall short of the Bayes rate.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from flatlm.evaluate.cache import feature_cache_path, fingerprint, load_or_compute
from flatlm.evaluate.features import gaussian_projection
from flatlm.evaluate.probe import ProbeConfig, run_probe
from flatlm.languages.base import Language


def lookup_features(
    language: Language,
    tokens_NT,
    lengths_N,
    *,
    batch_size: int = 4096,
    projection_dim: int = 0,
    projection_seed: int = 0,
    progress: bool = True,
    desc: str = "conditionals",
    with_words: bool = False,
) -> np.ndarray:
    """Concatenated exact conditionals float32[N, T*V] (or [N, projection_dim] through the same fixed Gaussian
    projection as `features.extract_features`; 0 = none), from `language.conditionals` in batches of `batch_size`.

    The paper's lookup table (Section 3.2, A.4) uses the true conditionals as a sentence's contextual embeddings.
    `with_words` appends the one-hot words [onehot(x_1); ...; onehot(x_T)] (float32[N, 2*T*V] before projection;
    zeros beyond a sentence's length): the information each q_t leaves out (not the paper's; C5's control).
    """
    tokens_NT = np.asarray(tokens_NT, np.int32)
    lengths_N = np.asarray(lengths_N, np.int32)
    n, T = tokens_NT.shape
    proj_FP = None
    out_NF = None
    for start in tqdm(range(0, n, batch_size), desc=desc, disable=not progress, leave=False):
        stop = min(start + batch_size, n)
        q_BTV = np.asarray(language.conditionals(tokens_NT[start:stop], lengths_N[start:stop]), np.float32)
        x_BF = q_BTV.reshape(stop - start, -1)
        if with_words:
            words_BF = one_hot_words(tokens_NT[start:stop], lengths_N[start:stop], q_BTV.shape[-1])
            x_BF = np.concatenate([x_BF, words_BF], axis=1)
        if projection_dim:
            if proj_FP is None:
                proj_FP = gaussian_projection(x_BF.shape[1], projection_dim, projection_seed)
            x_BF = np.asarray(jnp.asarray(x_BF) @ proj_FP)
        if out_NF is None:
            out_NF = np.empty((n, x_BF.shape[1]), np.float32)
        out_NF[start:stop] = x_BF
    if out_NF is None:
        raise ValueError("lookup_features: no examples")
    return out_NF


def one_hot_words(tokens_NT, lengths_N, num_words: int) -> np.ndarray:
    """The words as features, [onehot(x_1); ...; onehot(x_T)] float32[N, T * num_words], zeros beyond each
    sentence's length: what `lookup_features(with_words=True)` appends to the conditionals."""
    tokens_NT, lengths_N = np.asarray(tokens_NT), np.asarray(lengths_N)
    inside_NT = np.arange(tokens_NT.shape[1])[None, :] < lengths_N[:, None]
    # beyond a sentence's length the token is the pad id (= num_words): read word 0 there, then zero it
    words_NTV = np.eye(num_words, dtype=np.float32)[np.where(inside_NT, tokens_NT, 0)] * inside_NT[..., None]
    return words_NTV.reshape(len(tokens_NT), -1)


def bayes_accuracy(posterior_NC) -> float:
    """Expected accuracy of the Bayes classifier, E[max_c P(label = c | x)], for posteriors float[N, C].

    This bounds every classifier of x, the lookup table included, when labels are drawn from the posterior
    (e.g. HMM task-k with the sampled state: posterior = `language.state_posteriors(...)[:, k]`).
    """
    return float(np.mean(np.max(np.asarray(posterior_NC, np.float64), axis=-1)))


def run_lookup_probe(
    language: Language,
    tokens: Mapping[str, Any],
    lengths: Mapping[str, Any],
    labels: Mapping[str, Any],
    config: ProbeConfig = ProbeConfig(),
    *,
    cache_dir: str | None = None,
    batch_size: int = 4096,
    num_classes: int | None = None,
    progress: bool = True,
    with_words: bool = False,
) -> dict:
    """Linear probe (same `ProbeConfig` as for models) on the lookup-table features of every split.

    tokens: split -> int[N, T]; lengths: split -> int[N]; labels: split -> int[N]; "train" is required.
    Features are cached in `cache_dir` (key step "lookup", or "lookup_words" `with_words`) when given. Returns
    `run_probe`'s dict, kind "lookup_table" (or "lookup_words": the conditionals and the words, C5's control).
    """
    kind = "lookup_words" if with_words else "lookup_table"
    t0 = time.perf_counter()
    feats = {}
    for split, tok in tokens.items():
        compute = lambda tok=tok, split=split: lookup_features(
            language, tok, lengths[split], batch_size=batch_size, projection_dim=config.projection_dim,
            projection_seed=config.projection_seed, progress=progress, desc=f"conditionals {split}",
            with_words=with_words)
        if cache_dir is None:
            feats[split] = compute()
        else:
            proj = config.projection_dim, config.projection_seed
            path = feature_cache_path(cache_dir, "lookup_words" if with_words else "lookup", split, *proj)
            key = fingerprint(np.asarray(tok, np.int32), np.asarray(lengths[split], np.int32))
            feats[split] = load_or_compute(path, key, compute)
    out = run_probe(feats, labels, config, num_classes=num_classes, progress=progress)
    out["kind"] = kind
    out["seconds"] = time.perf_counter() - t0
    return out
