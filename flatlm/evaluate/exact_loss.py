"""Exact pre-training loss against the language's true conditionals.

For every sentence x and every position t < len(x), mask x_t and compare the model's prediction p(. | x_-t)
with the true conditional q(. | x_-t):  loss = E_{x,t}[ -sum_w q(w) log p(w) ] = entropy + KL(q || p),
in nats per masked position. This is the population MLM loss for single-position masking, so a model that
outputs q exactly has loss = entropy and KL = 0. The std is over `num_subsets` disjoint subsets of the
sentences (as in the paper).

Two averages over (x, t), named in every result as `average`:
  "token" (flatlm's default): sum over all masked positions / number of positions, so long sentences weigh more;
      this is the loss of masking one position drawn uniformly from the corpus's tokens, the functional that
      training with `data.masking=bert` estimates (every token masked independently).
  "sentence" (the paper's E_{x,t}, Section 3.1: t uniform in [T] per sentence): mean over a sentence's positions,
      then mean over sentences; the functional that training with the default `data.masking=single` estimates (one
      position per sentence, a mean over sentences). For fixed-length languages (HMM, Dyck) the two are equal; for
      the PCFG they differ.
The default is "token" for continuity with the results flatlm has recorded, not because it is the training
functional: an earlier version of this note said so, wrongly, for the default single masking (an audit measured
mlm_loss under single masking at the sentence average). `paper` presets use "sentence"; results name their
average and `claims.same_loss` refuses to compare two different ones.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from flatlm.languages.base import special_ids
from flatlm.models.losses import ApplyFn


def position_terms(logp_BTV, q_BTV, lengths_B):
    """Per-sentence sums over valid positions of cross-entropy and entropy (nats), and the position count."""
    T = q_BTV.shape[1]
    valid_BT = (jnp.arange(T)[None, :] < lengths_B[:, None]).astype(logp_BTV.dtype)
    ce_BT = -jnp.sum(jnp.where(q_BTV > 0, q_BTV * logp_BTV, 0.0), axis=-1)
    ent_BT = -jnp.sum(jnp.where(q_BTV > 0, q_BTV * jnp.log(jnp.where(q_BTV > 0, q_BTV, 1.0)), 0.0), axis=-1)
    return (ce_BT * valid_BT).sum(1), (ent_BT * valid_BT).sum(1), valid_BT.sum(1)


@functools.partial(jax.jit, static_argnames=("apply_fn",))
def _sentence_terms(apply_fn: ApplyFn, params, tokens_BT, lengths_B, q_BTV):
    """Per-sentence cross-entropy and entropy sums with every position masked in turn (B * T copies)."""
    B, T = tokens_BT.shape
    mask = special_ids(q_BTV.shape[-1]).mask
    eye_TT = jnp.eye(T, dtype=bool)
    copies_BTT = jnp.where(eye_TT[None], mask, tokens_BT[:, None, :])  # copy t has position t masked
    pos_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
    logits_NV = apply_fn({"params": params}, copies_BTT.reshape(B * T, T), pos_BT.reshape(-1),
                         method="logits_at")
    logp_BTV = jax.nn.log_softmax(logits_NV.astype(jnp.float32), axis=-1).reshape(B, T, -1)
    return position_terms(logp_BTV, q_BTV.astype(jnp.float32), lengths_B)


AVERAGES = ("token", "sentence")


def exact_loss(apply_fn: ApplyFn, params, batches, num_subsets: int = 5, pad_to: int | None = None,
               average: str = "token") -> dict:
    """Exact loss of `apply_fn` (a Flax `model.apply` with a `logits_at` method) over validation batches
    {tokens, length, conditionals q[B, T, V]}; V (and so the pad and mask ids) is read off q.

    Returns loss, entropy, kl, log_kl (natural log of the KL), loss_std / kl_std over subsets, num_sentences,
    and `average` ("token" or "sentence", see the module docstring).
    Batches shorter than `pad_to` are padded with empty sentences so the computation compiles once.
    """
    ce, ent, cnt = [], [], []
    for batch in batches:
        tokens, lengths, q = batch["tokens"], batch["length"], batch["conditionals"]
        n = tokens.shape[0]
        if pad_to and n < pad_to:
            pad = pad_to - n
            tokens = np.concatenate([tokens, np.full((pad, tokens.shape[1]), special_ids(q.shape[-1]).pad,
                                                     tokens.dtype)])
            lengths = np.concatenate([lengths, np.zeros(pad, lengths.dtype)])
            q = np.concatenate([q, np.zeros((pad,) + q.shape[1:], q.dtype)])
        c, e, k = jax.device_get(_sentence_terms(apply_fn, params, tokens, lengths, q))
        ce.append(c[:n])
        ent.append(e[:n])
        cnt.append(k[:n])
    ce, ent, cnt = (np.concatenate(x).astype(np.float64) for x in (ce, ent, cnt))
    return summarize(ce, ent, cnt, num_subsets, average)


def _mean(x_B, count_B, average: str) -> float:
    """Token-weighted (sum / positions) or sentence-weighted (mean over sentences of x / positions) mean."""
    if average == "token":
        return float(x_B.sum() / count_B.sum())
    keep = count_B > 0
    return float(np.mean(x_B[keep] / count_B[keep]))


def summarize(ce_B, ent_B, count_B, num_subsets: int = 5, average: str = "token") -> dict:
    """Means over (sentence, position) by `average`, with the std of the loss and KL over disjoint subsets."""
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
    total = count_B.sum()
    loss, entropy = _mean(ce_B, count_B, average), _mean(ent_B, count_B, average)
    kl = max(loss - entropy, 0.0)
    subsets = [s for s in np.array_split(np.arange(len(ce_B)), num_subsets) if count_B[s].sum() > 0]
    sub_loss = np.array([_mean(ce_B[s], count_B[s], average) for s in subsets])
    sub_kl = np.array([_mean(ce_B[s] - ent_B[s], count_B[s], average) for s in subsets])
    return {
        "loss": float(loss), "entropy": float(entropy), "kl": float(kl),
        "log_kl": float(np.log(kl)) if kl > 0 else float("-inf"),
        "loss_std": float(sub_loss.std(ddof=1)) if len(subsets) > 1 else 0.0,
        "kl_std": float(sub_kl.std(ddof=1)) if len(subsets) > 1 else 0.0,
        "num_sentences": len(ce_B), "num_positions": int(total), "average": average,
    }
