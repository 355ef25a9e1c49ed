"""OPT restricted to a fixed vocabulary of K tokens, as a language with exact log-probabilities and conditionals.

The paper samples "sentences of 24 tokens from OPT-125M restricted to its 2000 most frequent tokens". Here:
- Vocabulary. Word w in 0..K-1 is OPT token `token_ids[w]`. The K tokens are the top-K of a frequency table: one the
  user supplies (e.g. counts of an OPT-tokenised corpus), or by default the model's own unigram estimate, the
  average next-token distribution over every position of contexts sampled ancestrally from BOS by the unrestricted
  model (`model_unigram`), i.e. the expected token frequencies of OPT's own text. The paper does not say which
  frequency it meant; the default keeps the choice inside the model, needs no corpus and is reproducible from the
  checkpoint and a seed. OPT's special tokens <s>, <pad>, </s>, <unk> (ids 0..3) are never words.
- Distribution. A sentence is x_0..x_{T-1} (T = 24 by default, no EOS) drawn from BOS by the restricted model
  p_K(w | ctx) = p(token_ids[w] | ctx) / sum_k p(token_ids[k] | ctx) (renormalised over the K tokens), so
  log P(x) = sum_t log p_K(x_t | BOS, x_<t) exactly and sums to 1 over the K^T sentences. For lengths l < T,
  `log_prob` and `conditionals` are those of the marginal of the first l words.
- Conditionals. q[t, w] = P(x_t = w | x_-t) ∝ p_K(w | x_<t) * prod_{s>t} p_K(x_s | x_<t, w, x_{t+1..s-1}).
  One forward of the sentence gives the first factor for every t and the keys/values of every prefix (the prefix
  KV cache). The K continuations [w, x_{t+1}, ..., x_{l-2}] for position t then run as one batch attending to the
  cached prefix; two positions t and l-2-t share each row (their suffixes have l-1-t and t+1 tokens, l together),
  so every call has one shape and a sentence costs K*l*ceil((l-1)/2) ~ K*l^2/2 token-forwards instead of
  K*l*(l-1) when each candidate sentence is recomputed in full (`prefix_cache=False`, kept for comparison).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from flatlm.errors import UserError
from flatlm.languages.base import Corpus, special_ids
from flatlm.languages.opt.hf import load_hf_checkpoint
from flatlm.languages.opt.model import OPT, KVCache, OPTConfig, append_cache, init_cache, random_params

DEFAULT_K = 2000
DEFAULT_LENGTH = 24
OPT_SPECIAL_IDS = (0, 1, 2, 3)  # <s>, <pad>, </s>, <unk> in OPT's GPT-2 BPE vocabulary


def top_k_token_ids(freq_V, k: int, exclude=OPT_SPECIAL_IDS) -> np.ndarray:
    """The k most frequent token ids by `freq_V` (counts or probabilities over OPT's vocabulary), most frequent
    first (ties by smaller id), never any id in `exclude`. int32[k]."""
    freq_V = np.asarray(freq_V, np.float64)
    allowed = np.ones(freq_V.shape[0], bool)
    allowed[[i for i in exclude if i < freq_V.shape[0]]] = False
    if k > allowed.sum():
        raise UserError(f"asked for {k} tokens but the frequency table has only {allowed.sum()} candidates")
    order = np.lexsort((np.arange(freq_V.shape[0]), -freq_V))
    return order[allowed[order]][:k].astype(np.int32)


def _ancestral(model: OPT, params, key, n: int, steps: int, head_ids):
    """Ancestral sampling from BOS with a KV cache: (samples int32[n, steps] indexing `head_ids` (or the full
    vocabulary if None), mean next-token distribution over rows and steps [K or Vopt])."""
    cfg = model.cfg
    cache = init_cache(cfg, n, steps)

    def step(carry, _):
        cache, tok_B, key, total = carry
        logits_B1V, kv = model.apply({"params": params}, tok_B[:, None], cache=cache, head_ids=head_ids,
                                     method=OPT.decode)
        cache = append_cache(cache, kv)
        key, sub = jax.random.split(key)
        logits_BV = logits_B1V[:, 0].astype(jnp.float32)
        w_B = jax.random.categorical(sub, logits_BV)
        total = total + jax.nn.softmax(logits_BV).sum(0)
        tok_B = w_B if head_ids is None else head_ids[w_B]
        return (cache, tok_B.astype(jnp.int32), key, total), w_B

    V = cfg.vocab_size if head_ids is None else head_ids.shape[0]
    init = (cache, jnp.full((n,), cfg.bos_token_id, jnp.int32), key, jnp.zeros((V,), jnp.float32))
    (_, _, _, total), w_SB = jax.lax.scan(step, init, None, length=steps)
    return w_SB.T.astype(jnp.int32), total / (n * steps)


_ancestral_jit = jax.jit(_ancestral, static_argnums=(0, 3, 4))


def model_unigram(cfg: OPTConfig, params, num_contexts: int = 256, context_length: int = DEFAULT_LENGTH,
                  seed: int = 0, batch_size: int = 64) -> np.ndarray:
    """The model's unigram estimate float64[Vopt]: its next-token distribution averaged over every position of
    `num_contexts` contexts of `context_length` tokens sampled from BOS by the unrestricted model."""
    model, params = OPT(cfg), jax.tree.map(jnp.asarray, params)
    total, done = np.zeros(cfg.vocab_size), 0
    for i in range(0, num_contexts, batch_size):
        n = min(batch_size, num_contexts - i)
        key = jax.random.fold_in(jax.random.PRNGKey(seed), i)
        _, mean_V = _ancestral_jit(model, params, key, n, context_length, None)
        total += n * np.asarray(mean_V, np.float64)
        done += n
    return total / done


class OPTLanguage:
    """OPT restricted to K words (word w = OPT token `token_ids[w]`), sentences of `length` words from BOS.

    batch_size: sentences per forward in `sample` / `log_prob`; candidate_chunk: candidates per forward in
    `conditionals` (bounds memory: chunk * T * K restricted logits); prefix_cache: False recomputes every
    candidate sentence in full (the baseline the cache is measured against).
    """

    def __init__(self, cfg: OPTConfig, params, token_ids, length: int = DEFAULT_LENGTH, *, batch_size: int = 64,
                 candidate_chunk: int = 256, prefix_cache: bool = True):
        token_ids = np.asarray(token_ids, np.int32)
        if token_ids.ndim != 1 or len(set(token_ids.tolist())) != token_ids.size:
            raise UserError("token_ids must be a 1-D array of distinct OPT token ids")
        if token_ids.min() < 0 or token_ids.max() >= cfg.vocab_size:
            raise UserError(f"token_ids must lie in 0..{cfg.vocab_size - 1}")
        if length + 1 > cfg.max_positions:
            raise UserError(f"length {length} exceeds the model's {cfg.max_positions} positions")
        self.cfg, self.token_ids = cfg, token_ids
        self.params = jax.tree.map(jnp.asarray, params)  # on the device once, not per call
        self.vocab_size, self.max_length = int(token_ids.size), int(length)
        self.specials = special_ids(self.vocab_size)
        self.batch_size, self.candidate_chunk, self.prefix_cache = batch_size, candidate_chunk, prefix_cache
        self.model = OPT(cfg)
        self._head_K = jnp.asarray(token_ids)
        num_chunks = -(-self.vocab_size // candidate_chunk)
        chunk = -(-self.vocab_size // num_chunks)  # equal chunks of at most candidate_chunk, least padding
        padded = num_chunks * chunk
        self._cands_NC = jnp.asarray(np.resize(token_ids, padded).reshape(-1, chunk))  # padding rows dropped later
        self._sample = functools.partial(_ancestral_jit, self.model)
        self._restricted_lp = jax.jit(self._restricted_lp_impl)
        self._pair = jax.jit(self._pair_impl)
        self._full_candidates = jax.jit(self._full_candidates_impl)

    # -- construction --------------------------------------------------------------------------------------------

    @classmethod
    def from_model(cls, cfg: OPTConfig, params, k: int = DEFAULT_K, length: int = DEFAULT_LENGTH,
                   freq=None, unigram_contexts: int = 256, seed: int = 0, **kw) -> OPTLanguage:
        """Restrict to the top-k tokens of `freq` (counts over OPT's vocabulary) or, if None, of the model's own
        unigram estimate from `unigram_contexts` sampled contexts of `length` tokens."""
        if freq is None:
            freq = model_unigram(cfg, params, unigram_contexts, length, seed)
        return cls(cfg, params, top_k_token_ids(freq, k), length, **kw)

    @classmethod
    def from_checkpoint(cls, path: str, k: int = DEFAULT_K, length: int = DEFAULT_LENGTH, **kw) -> OPTLanguage:
        """From a local Hugging Face OPT directory (see `flatlm.languages.opt.hf.load_hf_checkpoint`)."""
        cfg, params = load_hf_checkpoint(path)
        return cls.from_model(cfg, jax.tree.map(jnp.asarray, params), k, length, **kw)

    # -- helpers -------------------------------------------------------------------------------------------------

    def to_opt_ids(self, tokens) -> np.ndarray:
        """OPT ids of word ids; pad/mask/cls (>= K) become OPT's pad id."""
        tokens = np.asarray(tokens)
        ids = self.token_ids[np.clip(tokens, 0, self.vocab_size - 1)]
        return np.where((tokens >= 0) & (tokens < self.vocab_size), ids, self.cfg.pad_token_id).astype(np.int32)

    def _inputs(self, tokens, lengths):
        """Validated (tokens int32[n, T], lengths int32[n], model inputs [BOS, x_0..x_{T-2}] int32[n, T])."""
        tokens, lengths = np.asarray(tokens, np.int32), np.asarray(lengths, np.int32)
        if tokens.ndim != 2 or lengths.shape != tokens.shape[:1]:
            raise UserError(f"expected tokens [n, T] and lengths [n], got {tokens.shape} and {lengths.shape}")
        T = tokens.shape[1]
        if lengths.min(initial=1) < 1 or lengths.max(initial=0) > min(T, self.max_length):
            raise UserError(f"lengths must lie in 1..{min(T, self.max_length)}")
        valid = np.arange(T) < lengths[:, None]
        if np.any(valid & ((tokens < 0) | (tokens >= self.vocab_size))):
            raise UserError(f"word ids must lie in 0..{self.vocab_size - 1} within each length")
        bos = np.full((tokens.shape[0], 1), self.cfg.bos_token_id, np.int32)
        return tokens, lengths, np.concatenate([bos, self.to_opt_ids(tokens)[:, :-1]], axis=1)

    def _restricted_lp_impl(self, params, inputs_BS, positions_BS=None, cache=None):
        """log p_K(. | context) at every input position: float32[B, S, K]."""
        logits, kv = self.model.apply({"params": params}, inputs_BS, positions_BS, cache, self._head_K,
                                      method=OPT.decode)
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), kv

    def _pair_impl(self, params, kv: KVCache, inputs_L, words_L, t_a):
        """Suffix log-likelihoods for two positions t_a and t_b = l-2-t_a at once, for every candidate w: [K, 2].

        Column 0: sum_{s>t_a} log p_K(x_s | x_<t_a, w, x_{t_a+1..s-1}); column 1 the same for t_b. Each row packs
        candidate w's two continuations [w, x_{t+1}, ..., x_{l-2}] (l-1-t_a + t_a+1 = l tokens: one shape for every
        pair) as two segments, each attending to its own prefix of the sentence's cached keys/values.
        kv: the sentence pass's cache [L, 1, T, H, Dh]; inputs_L: [BOS, x_0..x_{l-2}] (OPT ids); words_L: x_0..x_{l-1}.
        """
        l = inputs_L.shape[0]
        t_b, S_a = l - 2 - t_a, l - 1 - t_a
        j_L = jnp.arange(l)
        in_a_L = j_L < S_a
        pos_L = jnp.where(in_a_L, t_a + 1 + j_L, t_b + 1 + j_L - S_a)  # candidate at t + 1, then x_{t+1}, ...
        start_L = (j_L == 0) | (j_L == S_a)
        visible_L = jnp.where(in_a_L, t_a + 1, t_b + 1)
        base_L, targets_L = inputs_L[pos_L], words_L[pos_L]

        def chunk(cands_C):
            C = cands_C.shape[0]
            inputs_CL = jnp.where(start_L, cands_C[:, None], base_L[None, :])
            logits, _ = self.model.apply({"params": params}, inputs_CL, jnp.broadcast_to(pos_L, (C, l)), kv,
                                         self._head_K, (~in_a_L).astype(jnp.int32), visible_L, method=OPT.decode)
            lp_CLK = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            g_CL = jnp.take_along_axis(lp_CLK, jnp.broadcast_to(targets_L[None, :, None], (C, l, 1)), -1)[..., 0]
            return jnp.stack([(g_CL * in_a_L).sum(-1), (g_CL * ~in_a_L).sum(-1)], axis=-1)

        return jax.lax.map(chunk, self._cands_NC).reshape(-1, 2)[: self.vocab_size]

    def _full_candidates_impl(self, params, inputs_T, targets_T, weights_T, t):
        """Without a cache: sum_{s>=t} log p_K(x_s | ...) of the whole sentence with x_t = w, for every w: [K].

        inputs_T: [BOS, x_0..x_{T-2}] (OPT ids); targets_T: word ids; weights_T: 1 within the length.
        """
        T = inputs_T.shape[0]
        words_C = jnp.arange(self._cands_NC.size).reshape(self._cands_NC.shape) % self.vocab_size

        def chunk(args):
            cands_C, w_C = args
            C = cands_C.shape[0]
            at_T = jnp.arange(T) == t + 1  # x_t is input t + 1 (none when t = T - 1)
            inputs_CT = jnp.where(at_T, cands_C[:, None], inputs_T[None, :])
            lp_CTK, _ = self._restricted_lp_impl(params, inputs_CT)
            tgt_CT = jnp.where(jnp.arange(T) == t, w_C[:, None], jnp.broadcast_to(targets_T, (C, T)))
            g_CT = jnp.take_along_axis(lp_CTK, tgt_CT[..., None], axis=-1)[..., 0]
            return (g_CT * (weights_T * (jnp.arange(T) >= t))).sum(-1)

        return jax.lax.map(chunk, (self._cands_NC, words_C)).reshape(-1)[: self.vocab_size]

    def precompile(self, length: int | None = None) -> None:
        """Compile ahead what `conditionals` runs on sentences of `length` (default T) words: the sentence pass and
        the paired-suffix pass (or the full-sentence pass without the cache)."""
        T = length or self.max_length
        sds = jax.ShapeDtypeStruct
        inputs = sds((1, T), jnp.int32)
        self._restricted_lp.lower(self.params, inputs).compile()
        if not self.prefix_cache:
            self._full_candidates.lower(self.params, sds((T,), jnp.int32), sds((T,), jnp.int32),
                                        sds((T,), jnp.float32), sds((), jnp.int32)).compile()
            return
        _, kv = jax.eval_shape(self._restricted_lp, self.params, inputs)
        self._pair.lower(self.params, kv, sds((T,), jnp.int32), sds((T,), jnp.int32), sds((), jnp.int32)).compile()

    # -- the Language interface ------------------------------------------------------------------------------------

    def sample(self, n: int, seed: int, latents: bool = True) -> Corpus:
        """n sentences of `max_length` words by ancestral sampling from BOS (renormalised over the K words).
        Batches of `batch_size` use keys fold_in(seed, batch index), so samples depend on (seed, batch_size).
        latents {"opt_ids": the OPT token ids}, {} with `latents=False`."""
        out = []
        for i, start in enumerate(range(0, n, self.batch_size)):
            m = min(self.batch_size, n - start)
            words, _ = self._sample(self.params, jax.random.fold_in(jax.random.PRNGKey(seed), i), m,
                                    self.max_length, self._head_K)
            out.append(np.asarray(words))
        tokens = np.concatenate(out) if out else np.zeros((0, self.max_length), np.int32)
        return Corpus(tokens=tokens.astype(np.int32), lengths=np.full((n,), self.max_length, np.int32),
                      latents={"opt_ids": self.token_ids[tokens]} if latents else {})

    def log_prob(self, tokens, lengths) -> np.ndarray:
        """log P(x_0..x_{l-1}) = sum_{t<l} log p_K(x_t | BOS, x_<t), float64[n] (nats)."""
        tokens, lengths, inputs = self._inputs(tokens, lengths)
        T = tokens.shape[1]
        out = np.zeros(tokens.shape[0])
        for s in range(0, tokens.shape[0], self.batch_size):
            lp_BTK, _ = self._restricted_lp(self.params, jnp.asarray(inputs[s: s + self.batch_size]))
            lp_BTK = np.asarray(lp_BTK, np.float64)
            tok = np.clip(tokens[s: s + self.batch_size], 0, self.vocab_size - 1)
            g_BT = np.take_along_axis(lp_BTK, tok[..., None], axis=-1)[..., 0]
            out[s: s + self.batch_size] = (g_BT * (np.arange(T) < lengths[s: s + self.batch_size, None])).sum(-1)
        return out

    def conditionals(self, tokens, lengths) -> np.ndarray:
        """q[b, t, w] = P(x_t = w | x_-t) for t < lengths[b], 0 beyond: float32[n, T, K]."""
        tokens, lengths, inputs = self._inputs(tokens, lengths)
        n, T = tokens.shape
        q = np.zeros((n, T, self.vocab_size), np.float32)
        for b in range(n):
            l = int(lengths[b])
            inputs_1T = jnp.asarray(inputs[b: b + 1])
            lp_1TK, kv = self._restricted_lp(self.params, inputs_1T)
            lp_TK = np.asarray(lp_1TK[0], np.float64)
            scores_LK = lp_TK[:l].copy()
            if self.prefix_cache:
                for t_a in range(l // 2):  # pairs (t_a, l-2-t_a) cover t = 0..l-2; t = l-1 has no suffix
                    sums_K2 = np.asarray(self._pair(self.params, kv, inputs_1T[0, :l], jnp.asarray(tokens[b, :l]),
                                                    jnp.asarray(t_a, jnp.int32)), np.float64)
                    scores_LK[t_a] += sums_K2[:, 0]
                    if l - 2 - t_a != t_a:
                        scores_LK[l - 2 - t_a] += sums_K2[:, 1]
            for t in range(l):
                score_K = scores_LK[t]
                if t < l - 1 and not self.prefix_cache:
                    weights_T = (np.arange(T) < l).astype(np.float32)
                    words_T = jnp.asarray(np.clip(tokens[b], 0, self.vocab_size - 1))  # pad ids are weighted 0
                    score_K = np.asarray(self._full_candidates(self.params, inputs_1T[0], words_T,
                                                               jnp.asarray(weights_T), jnp.asarray(t, jnp.int32)),
                                         np.float64)
                score_K = np.exp(score_K - score_K.max())
                q[b, t] = score_K / score_K.sum()
        return q


def from_spec(spec) -> OPTLanguage:
    """The language a config's `language` section describes (name "opt"; fields in configs/opt_mlm.py)."""
    freq = None
    if spec.get("freq_file"):
        if not os.path.isfile(spec["freq_file"]):
            raise UserError(f"language.freq_file {spec['freq_file']!r} not found; give a .npy of token counts")
        freq = np.load(spec["freq_file"])
    kw = dict(k=spec["vocab_size"], length=spec["length"], freq=freq, unigram_contexts=spec["unigram_contexts"],
              seed=spec["seed"])
    if spec.get("checkpoint"):
        return OPTLanguage.from_checkpoint(spec["checkpoint"], **kw)
    if not spec.get("opt_shape"):
        raise UserError("language.checkpoint is empty; set --config.language.checkpoint=/path/to/local/opt-125m "
                        "(a Hugging Face directory), or language.opt_shape=tiny for a random model")
    cfg = OPTConfig.named(spec["opt_shape"])
    return OPTLanguage.from_model(cfg, random_params(cfg, spec["seed"], spec["init_std"]), **kw)
