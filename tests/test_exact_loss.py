"""Exact pre-training loss = entropy + KL, checked against an oracle and an explicit per-position loop."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flatlm.evaluate.exact_loss import exact_loss, position_terms, summarize
from flatlm.languages import hmm
from flatlm.models import Bert, BertConfig


def _hmm_batch(n=64):
    lang = hmm.random_hmm(3, num_states=6, vocab_size=9, length=6, num_blocks=2)
    corpus = lang.sample(n, seed=1)
    lengths = corpus.lengths.copy()
    lengths[::3] = 4  # some shorter sentences, padded
    tokens = np.where(np.arange(6)[None] < lengths[:, None], corpus.tokens, lang.vocab_size)
    q = np.asarray(lang.conditionals(tokens, lengths), np.float64)
    return lang, tokens, lengths, q


def test_true_conditionals_give_loss_equal_entropy_and_zero_kl():
    _, tokens, lengths, q = _hmm_batch()
    logq = np.log(np.where(q > 0, q, 1e-300))
    ce, ent, cnt = (np.asarray(x, np.float64) for x in position_terms(jnp.asarray(logq), jnp.asarray(q),
                                                                        jnp.asarray(lengths)))
    out = summarize(ce, ent, cnt)
    assert abs(out["loss"] - out["entropy"]) < 1e-6
    assert out["kl"] < 1e-6
    assert out["num_positions"] == lengths.sum()
    # entropy by hand
    valid = np.arange(6)[None] < lengths[:, None]
    h = -(q * logq).sum(-1)
    assert abs(out["entropy"] - h[valid].mean()) < 1e-6


def test_exact_loss_matches_an_explicit_loop_over_masked_positions():
    lang, tokens, lengths, q = _hmm_batch(n=24)
    V = lang.vocab_size
    model = Bert(BertConfig(num_words=V, max_len=7, d_model=32, num_layers=1, dropout=0.0))
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.asarray(tokens))["params"])
    batches = [{"tokens": tokens[i:i + 10], "length": lengths[i:i + 10], "conditionals": q[i:i + 10]}
               for i in range(0, len(tokens), 10)]
    # the reference's forward, one compiled program (op by op it compiled ~170 tiny ones)
    log_probs = jax.jit(lambda masked_1T, t: jax.nn.log_softmax(model.apply({"params": params}, masked_1T)[0, t]))
    out = exact_loss(model.apply, params, batches, num_subsets=3, pad_to=10)
    paper = exact_loss(model.apply, params, batches, num_subsets=3, pad_to=10, average="sentence")
    ce_sum, ent_sum, count = 0.0, 0.0, 0
    ce_sent, ent_sent = [], []  # the paper's E_x E_t: per-sentence means, then their mean
    for b in range(len(tokens)):
        ce_sent.append(ce_sum), ent_sent.append(ent_sum)
        for t in range(lengths[b]):
            masked = tokens[b].copy()
            masked[t] = V + 1
            logp = log_probs(jnp.asarray(masked[None]), t)
            ce_sum += -(q[b, t] * np.asarray(logp, np.float64)).sum()
            ent_sum += -(q[b, t][q[b, t] > 0] * np.log(q[b, t][q[b, t] > 0])).sum()
            count += 1
        ce_sent[-1] = (ce_sum - ce_sent[-1]) / lengths[b]
        ent_sent[-1] = (ent_sum - ent_sent[-1]) / lengths[b]
    assert out["average"] == "token" and paper["average"] == "sentence"
    assert abs(paper["loss"] - np.mean(ce_sent)) < 1e-5 and abs(paper["entropy"] - np.mean(ent_sent)) < 1e-6
    assert abs(paper["loss"] - out["loss"]) > 1e-4  # sentences of 4 and 6 words: the two averages differ
    assert abs(out["loss"] - ce_sum / count) < 1e-5
    assert abs(out["entropy"] - ent_sum / count) < 1e-6
    assert abs(out["kl"] - (ce_sum - ent_sum) / count) < 1e-5
    assert out["kl"] > 0.05  # an untrained model is far from the truth
    assert out["num_sentences"] == len(tokens) and out["loss_std"] > 0
