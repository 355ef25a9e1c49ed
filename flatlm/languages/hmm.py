"""Hidden Markov model language (the paper's HMM corpus) with exact inference by scaled forward-backward.

A sentence of length T is z_0 ~ initial, z_t ~ transition[z_{t-1}], x_t ~ emission[z_t]. Inference runs in
JAX, batched over sentences, in float32 by default and in float64 when `jax_enable_x64` is on (e.g. inside
`with jax.enable_x64(True):`). Results come back as numpy arrays.

Padding: positions t >= lengths[b] are unobserved (their token, normally pad = V, is ignored), so sentences of
any length up to T share one batch; outputs there are 0. Within a sentence, a token id >= V (pad or mask) is
treated as unobserved too, i.e. marginalised out.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from flatlm.languages.base import Corpus, exact_dot, host_outputs, special_ids
from flatlm.languages.row_sampler import RowSampler

_ATOL = 1e-6  # tolerance on row sums of the stochastic matrices
# Default sentences per device call; temporaries take about chunk * T * (2K + V) floats. CPU: 1024, so that the
# allocator recycles each call's buffers (at 4096 page faults on the fresh output took ~30% of the CPU time).
# Accelerators: the largest power of two within _ACCEL_BYTES (paper HMM: 2^18), as one call's pinned output is read
# in place; in chunks of 2^16 the copy into one fresh array cut 3.31M to 268k sent/s (H200, RESULTS.md 2026-11-29).
_CHUNK, _ACCEL_BYTES = 1024, 8 << 30
_SAMPLE_CHUNK = 1 << 16  # sentences per numpy sampling step


def _check_stochastic(name: str, p: np.ndarray) -> None:
    """Raises ValueError unless `p` is finite, nonnegative and its last axis sums to 1 within _ATOL."""
    if not np.all(np.isfinite(p)):
        raise ValueError(f"HMM {name} has non-finite entries")
    if np.any(p < 0):
        raise ValueError(f"HMM {name} has negative entries (min {p.min():.3g})")
    err = np.max(np.abs(p.sum(axis=-1) - 1.0))
    if err > _ATOL:
        raise ValueError(f"HMM {name} rows must sum to 1 (worst row is off by {err:.3g})")


@dataclasses.dataclass(frozen=True, eq=False)
class HMM:
    """A discrete HMM over words 0..V-1 that emits sentences of `length` words.

    initial: float64[K] P(z_0 = k); transition: float64[K, K] P(z_t = j | z_{t-1} = i) (rows sum to 1);
    emission: float64[K, V] P(x_t = w | z_t = k) (rows sum to 1); length: T, the sentence length of `sample`.
    Arrays are copied, checked (nonnegative, rows summing to 1 within 1e-6, else ValueError), renormalised and
    made read-only.
    """

    initial: np.ndarray
    transition: np.ndarray
    emission: np.ndarray
    length: int

    def __post_init__(self):
        initial_K = np.array(self.initial, dtype=np.float64)
        transition_KK = np.array(self.transition, dtype=np.float64)
        emission_KV = np.array(self.emission, dtype=np.float64)
        if initial_K.ndim != 1 or initial_K.size == 0:
            raise ValueError(f"HMM initial must be a nonempty vector [K], got shape {initial_K.shape}")
        K = initial_K.shape[0]
        if transition_KK.shape != (K, K):
            raise ValueError(f"HMM transition must have shape ({K}, {K}), got {transition_KK.shape}")
        if emission_KV.ndim != 2 or emission_KV.shape[0] != K or emission_KV.shape[1] == 0:
            raise ValueError(f"HMM emission must have shape ({K}, V), got {emission_KV.shape}")
        if int(self.length) != self.length or self.length < 1:
            raise ValueError(f"HMM length must be a positive integer, got {self.length!r}")
        for name, p in (("initial", initial_K), ("transition", transition_KK), ("emission", emission_KV)):
            _check_stochastic(name, p)
            p /= p.sum(axis=-1, keepdims=True)  # exact up to rounding, so the language's total mass is 1
            p.setflags(write=False)
            object.__setattr__(self, name, p)
        object.__setattr__(self, "length", int(self.length))
        object.__setattr__(self, "_device_params", {})
        object.__setattr__(self, "_samplers", None)  # (initial, transition, emission) `RowSampler`s, built once

    def __repr__(self) -> str:
        return f"HMM(num_states={self.num_states}, vocab_size={self.vocab_size}, length={self.length})"

    @property
    def vocab_size(self) -> int:
        """V, the number of words (ids 0..V-1); pad = V."""
        return int(self.emission.shape[1])

    @property
    def num_states(self) -> int:
        """K, the number of hidden states."""
        return int(self.initial.shape[0])

    @property
    def max_length(self) -> int:
        """T, the length of every sampled sentence."""
        return self.length

    # ---------------------------------------------------------------- sampling

    def sample(self, n: int, seed: int, latents: bool = True) -> Corpus:
        """Draws n sentences: tokens int32[n, T], lengths int32[n] (all T), latents {"states": int32[n, T]} ({}
        with `latents=False`).

        Deterministic in (n, seed), and the first m sentences of `sample(n, seed)` equal `sample(m, seed)`.
        """
        return self.sample_blocks([n], [seed], latents)

    def sample_blocks(self, ns, seeds, latents: bool = True) -> Corpus:
        """`sample(ns[b], seeds[b], latents)` for every block b, concatenated in block order: the same sentences.
        A sentence is a function of its own uniforms, which block b draws from its generator in chunks of
        `_SAMPLE_CHUNK` rows as its own call does; the chain then runs once over the rows of several small blocks
        (the stream source's batch of `data.stream_block`-row blocks) instead of once per block."""
        if any(n < 0 for n in ns):
            raise ValueError(f"number of sentences must be >= 0, got {min(ns)}")
        T = self.length
        if self._samplers is None:  # the arrays are read-only: built on the first call
            object.__setattr__(self, "_samplers", tuple(
                RowSampler(p) for p in (self.initial[None, :], self.transition, self.emission)))
        N = int(sum(ns))
        states_NT = np.empty((N, T), dtype=np.int32)
        tokens_NT = np.empty((N, T), dtype=np.int32)
        pending, rows, done = [], 0, 0  # uniforms not yet run through the chain, and their row count
        for n, seed in zip(ns, seeds, strict=True):
            rng = np.random.default_rng(seed)
            for start in range(0, n, _SAMPLE_CHUNK):
                stop = min(n, start + _SAMPLE_CHUNK)
                pending.append(rng.integers(0, 1 << RowSampler.BITS, size=(stop - start, 2, T), dtype=np.int64))
                rows += stop - start
                if rows >= _SAMPLE_CHUNK:
                    done, pending, rows = self._chain(pending, states_NT, tokens_NT, done), [], 0
        if pending:
            self._chain(pending, states_NT, tokens_NT, done)
        return Corpus(tokens_NT, np.full(N, T, dtype=np.int32), {"states": states_NT} if latents else {})

    def _chain(self, u_parts, states_NT, tokens_NT, start: int) -> int:
        """Rows [start, start + B) of `states_NT` / `tokens_NT` from their uniforms, the arrays `u_parts` stacked
        into u_B2T (the state draws in [:, 0], the word draws in [:, 1]; one array is used as it is); returns
        start + B."""
        u_B2T = u_parts[0] if len(u_parts) == 1 else np.concatenate(u_parts)
        init_sampler, trans_sampler, emit_sampler = self._samplers
        stop = start + len(u_B2T)
        z_B = init_sampler(np.zeros(len(u_B2T), dtype=np.int64), u_B2T[:, 0, 0])
        for t in range(self.length):
            if t > 0:
                z_B = trans_sampler(z_B, u_B2T[:, 0, t])
            states_NT[start:stop, t] = z_B
            tokens_NT[start:stop, t] = emit_sampler(z_B, u_B2T[:, 1, t])
        return stop

    # ---------------------------------------------------------------- exact inference

    def log_prob(self, tokens, lengths, *, chunk_size: int | None = None) -> np.ndarray:
        """log P(x_0..x_{L-1}) in nats for each sentence: [n] (-inf for impossible sentences)."""
        return self._run(_log_prob_fn, tokens, lengths, chunk_size)

    def conditionals(self, tokens, lengths, *, chunk_size: int | None = None) -> np.ndarray:
        """q[b, t, w] = P(x_t = w | x_{-t}): [n, T, V], rows summing to 1 for t < lengths[b], 0 beyond.

        A row is all 0 also where the context x_{-t} itself has probability 0.
        """
        return self._run(_conditionals_fn, tokens, lengths, chunk_size)

    def state_posteriors(self, tokens, lengths, *, chunk_size: int | None = None) -> np.ndarray:
        """P(z_t = k | x): [n, T, K] for t < lengths[b], 0 beyond (and 0 for impossible sentences)."""
        return self._run(_posteriors_fn, tokens, lengths, chunk_size)

    def task_labels(
        self,
        tokens,
        lengths,
        k: int,
        definition: Literal["posterior", "sampled"] = "posterior",
        states=None,
    ) -> np.ndarray:
        """Labels int32[n] of task-k, classifying the hidden state at 0-based position k (paper A.1: task-6 and
        task-10 classify the 6th and 10th hidden variables, k = 5 and 9).

        "posterior": argmax_j P(z_k = j | x), the Bayes-optimal label given the sentence.
        "sampled": the state that generated x_k, read from `states` (a Corpus's `latents["states"]`).
        Every sentence must have more than k words.
        """
        tokens_NT, lengths_N = self._check_batch(tokens, lengths)
        if not 0 <= k < tokens_NT.shape[1] or np.any(lengths_N <= k):
            raise ValueError(f"task position k={k} must be < every sentence length (min {lengths_N.min()})")
        if definition == "posterior":
            return self.state_posteriors(tokens_NT, lengths_N)[:, k].argmax(-1).astype(np.int32)
        if definition == "sampled":
            if states is None:
                raise ValueError('task_labels(definition="sampled") needs states=corpus.latents["states"]')
            states_NT = np.asarray(states)
            if states_NT.shape != tokens_NT.shape:
                raise ValueError(f"states shape {states_NT.shape} != tokens shape {tokens_NT.shape}")
            return states_NT[:, k].astype(np.int32)
        raise ValueError(f'unknown task definition {definition!r}; use "posterior" or "sampled"')

    # ---------------------------------------------------------------- helpers

    def _check_batch(self, tokens, lengths) -> tuple[np.ndarray, np.ndarray]:
        """Validates and converts to int32 tokens [n, T] and lengths [n] in 0..T."""
        tokens_NT = np.asarray(tokens)
        lengths_N = np.asarray(lengths)
        if tokens_NT.ndim != 2 or tokens_NT.shape[1] == 0 or lengths_N.shape != tokens_NT.shape[:1]:
            raise ValueError(f"need tokens [n, T>0], lengths [n]; got {tokens_NT.shape}, {lengths_N.shape}")
        if not (np.issubdtype(tokens_NT.dtype, np.integer) and np.issubdtype(lengths_N.dtype, np.integer)):
            raise ValueError(f"tokens and lengths must be integers, got {tokens_NT.dtype}, {lengths_N.dtype}")
        if tokens_NT.size and tokens_NT.min() < 0:
            raise ValueError(f"token ids must be >= 0, got {tokens_NT.min()}")
        if lengths_N.size and (lengths_N.min() < 0 or lengths_N.max() > tokens_NT.shape[1]):
            raise ValueError(f"lengths must lie in 0..{tokens_NT.shape[1]}")
        return tokens_NT.astype(np.int32), lengths_N.astype(np.int32)

    def _params(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """initial, transition, emission on device in the current default float dtype (cached per dtype)."""
        dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
        cache = self._device_params
        if dtype not in cache:
            params = (self.initial, self.transition, self.emission)
            cache[dtype] = tuple(jnp.asarray(p, dtype) for p in params)
        return cache[dtype]

    def _run(self, fn, tokens, lengths, chunk_size: int | None) -> np.ndarray:
        """Applies a jitted kernel in chunks of at most chunk_size sentences (None: see `_CHUNK`), padding each
        call to a bucket size (a power of two up to chunk_size) so that only a few shapes are ever compiled.
        Chunk i+1 is dispatched before chunk i is copied to the host, so device work overlaps the transfer."""
        tokens_NT, lengths_N = self._check_batch(tokens, lengths)
        if chunk_size is None:
            per_sentence = 4 * tokens_NT.shape[1] * (2 * self.num_states + self.vocab_size)  # float32 bytes
            accel = 1 << (max(_ACCEL_BYTES // per_sentence, 1).bit_length() - 1)
            chunk_size = _CHUNK if jax.default_backend() == "cpu" else accel
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        n = tokens_NT.shape[0]
        params = self._params()
        starts = range(0, max(n, 1), chunk_size)

        def calls():
            for start in starts:
                tok_BT, len_B = tokens_NT[start : start + chunk_size], lengths_N[start : start + chunk_size]
                b = tok_BT.shape[0]
                bucket = min(chunk_size, 1 << max(b - 1, 0).bit_length())
                if bucket > b:
                    pad = special_ids(self.vocab_size).pad
                    tok_BT = np.pad(tok_BT, ((0, bucket - b), (0, 0)), constant_values=pad)
                    len_B = np.pad(len_B, (0, bucket - b))
                yield fn(*params, tok_BT, len_B)

        if n <= chunk_size:  # one call: its host array as it is (no copy into another)
            return next(host_outputs(calls()))[:n]
        out = None
        for start, result in zip(starts, host_outputs(calls()), strict=True):
            if out is None:
                out = np.empty((n, *result.shape[1:]), result.dtype)
            rows = min(chunk_size, n - start)
            out[start : start + rows] = result[:rows]
        return out


# ------------------------------------------------------------ JAX kernels: module level, so compiled once per
# shape and dtype and shared by every HMM instance.


def _likelihoods(emission_KV, tokens_BT, lengths_B):
    """like[t, b, k] = P(x_t | z_t = k), or 1 where x_t is unobserved (t >= length or id >= V): [T, B, K];
    and the observed mask [T, B]."""
    K, V = emission_KV.shape
    table_VK = jnp.concatenate([emission_KV.T, jnp.ones((1, K), emission_KV.dtype)], axis=0)
    observed_TB = ((jnp.arange(tokens_BT.shape[1]) < lengths_B[:, None]) & (tokens_BT < V)).T
    return table_VK[jnp.where(observed_TB, tokens_BT.T, V)], observed_TB


def _safe(x):
    """x, with zeros replaced by 1 so that 0 / 0 gives 0 (impossible contexts) instead of nan."""
    return jnp.where(x > 0, x, 1)


def _forward(initial_K, transition_KK, like_TBK):
    """Scaled forward pass. Returns per position t the predictive P(z_t | x_<t) [B, K], the filtered
    P(z_t | x_<=t) [B, K] and the scale c_t = P(x_t | x_<t) [B] (a Python loop: T is static and small)."""
    T, B, K = like_TBK.shape
    pred_BK = jnp.broadcast_to(initial_K, (B, K))
    preds, filts, scales = [], [], []
    for t in range(T):
        if t > 0:
            pred_BK = exact_dot(filts[-1], transition_KK)
        joint_BK = pred_BK * like_TBK[t]
        c_B = joint_BK.sum(-1)
        preds.append(pred_BK)
        filts.append(joint_BK / _safe(c_B)[:, None])
        scales.append(c_B)
    return preds, filts, scales


def _backward(transition_KK, like_TBK):
    """Scaled backward pass: per position t, beta_t = P(x_>t | z_t = k) normalised over k: [B, K].

    Unobserved positions have likelihood 1 and transition rows sum to 1, so beta stays constant after a
    sentence's last word; this is what makes padding exact.
    """
    T, B, K = like_TBK.shape
    beta_BK = jnp.ones((B, K), like_TBK.dtype) / K
    betas = [beta_BK]
    for t in range(T - 2, -1, -1):
        beta_BK = exact_dot(like_TBK[t + 1] * beta_BK, transition_KK.T)
        beta_BK = beta_BK / _safe(beta_BK.sum(-1))[:, None]
        betas.append(beta_BK)
    return betas[::-1]


def _normalise_masked(parts, lengths_B):
    """Stacks per-position [B, K] weights to [B, T, K], normalises over K and zeroes positions t >= length."""
    w_BTK = jnp.stack(parts, axis=1)
    mask_BT = jnp.arange(len(parts)) < lengths_B[:, None]
    return w_BTK * (mask_BT / _safe(w_BTK.sum(-1)))[..., None]


@jax.jit
def _log_prob_fn(initial_K, transition_KK, emission_KV, tokens_BT, lengths_B):
    """log P(x) = sum_t log c_t over the observed positions: [B]."""
    like_TBK, observed_TB = _likelihoods(emission_KV, tokens_BT, lengths_B)
    _, _, scales = _forward(initial_K, transition_KK, like_TBK)
    return jnp.sum(jnp.where(observed_TB, jnp.log(jnp.stack(scales)), 0), axis=0)


@jax.jit
def _conditionals_fn(initial_K, transition_KK, emission_KV, tokens_BT, lengths_B):
    """P(x_t = w | x_{-t}) = sum_k P(z_t = k | x_<t) beta_t[k] emission[k, w] / norm: [B, T, V].

    The normaliser is sum_k P(z_t = k | x_<t) beta_t[k] (emission rows sum to 1), so normalising the [B, T, K]
    weights first leaves one big matmul with emission and no pass over the [B, T, V] output.
    """
    like_TBK, _ = _likelihoods(emission_KV, tokens_BT, lengths_B)
    preds, _, _ = _forward(initial_K, transition_KK, like_TBK)
    betas = _backward(transition_KK, like_TBK)
    w_BTK = _normalise_masked([p * b for p, b in zip(preds, betas)], lengths_B)
    return exact_dot(w_BTK, emission_KV)


@jax.jit
def _posteriors_fn(initial_K, transition_KK, emission_KV, tokens_BT, lengths_B):
    """P(z_t = k | x) proportional to P(z_t = k | x_<=t) beta_t[k]: [B, T, K]."""
    like_TBK, _ = _likelihoods(emission_KV, tokens_BT, lengths_B)
    _, filts, _ = _forward(initial_K, transition_KK, like_TBK)
    betas = _backward(transition_KK, like_TBK)
    return _normalise_masked([f * b for f, b in zip(filts, betas)], lengths_B)


# -------------------------------------------------------------------- random HMMs as in the paper


def _block_rows(
    rng: np.random.Generator,
    row_block: np.ndarray,
    col_block: np.ndarray,
    concentration: float,
    leakage: float,
) -> np.ndarray:
    """Rows r: (1 - leakage) * Dirichlet(concentration) over the columns in block row_block[r]
    + leakage * uniform over all columns."""
    R, C = row_block.size, col_block.size
    in_block_RC = row_block[:, None] == col_block[None, :]
    gamma_RC = np.maximum(rng.gamma(concentration, size=(R, C)), np.finfo(np.float64).tiny)
    gamma_RC = np.where(in_block_RC, gamma_RC, 0.0)
    p_RC = (1.0 - leakage) * gamma_RC / gamma_RC.sum(axis=1, keepdims=True) + leakage / C
    return p_RC / p_RC.sum(axis=1, keepdims=True)


def random_hmm(
    seed: int,
    num_states: int = 100,
    vocab_size: int = 200,
    length: int = 16,
    num_blocks: int = 10,
    concentration: float = 1.0,
    leakage: float = 0.01,
    emission_leakage: float = 0.01,
) -> HMM:
    """A random block-diagonal HMM of the paper's shape (100 states, 200 words, length 16), deterministic in
    seed.

    States and words are split into `num_blocks` contiguous blocks (state k is in block k * num_blocks // K,
    word w in block w * num_blocks // V; default 10 blocks of 10 states and 20 words). Each transition row is,
    with probability 1 - leakage, a Dirichlet(concentration) draw over the states of its own block, and with
    probability `leakage` uniform over all states; emission rows likewise over the words of the state's block
    with `emission_leakage`. Leakage > 0 makes every entry positive, so the chain is ergodic and every
    sentence has positive probability (needed for well-defined conditionals); with the default 0.01 a state
    leaves its block with probability ~0.01 per step. Smaller `concentration` gives peakier rows. The initial
    distribution is uniform, so every block is equally likely to start a sentence.
    """
    if not 1 <= num_blocks <= min(num_states, vocab_size):
        raise ValueError(f"num_blocks must be in 1..{min(num_states, vocab_size)}, got {num_blocks}")
    if concentration <= 0 or not 0 <= leakage <= 1 or not 0 <= emission_leakage <= 1:
        raise ValueError("need concentration > 0 and leakage, emission_leakage in [0, 1]")
    rng = np.random.default_rng(seed)
    state_block_K = np.arange(num_states) * num_blocks // num_states
    word_block_V = np.arange(vocab_size) * num_blocks // vocab_size
    transition_KK = _block_rows(rng, state_block_K, state_block_K, concentration, leakage)
    emission_KV = _block_rows(rng, state_block_K, word_block_V, concentration, emission_leakage)
    initial_K = np.full(num_states, 1.0 / num_states)
    return HMM(initial_K, transition_KK, emission_KV, length)
