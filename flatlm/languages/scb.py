"""The sparse contextual bigram language (SCB; Ren, Nichani, Wu & Lee 2024, "Learning and transfer of sparse
contextual bigrams with linear transformers"), with exact conditionals like flatlm's other languages.

A sentence has T context words x_1..x_T drawn i.i.d. from `mu` (uniform by default) and one last word x_{T+1}:
the last context word k = x_T picks an attention pattern Q_k (a distribution over the T positions, non-zero on
`sparsity` of them), a position s ~ Q_k, and x_{T+1} ~ P[:, x_s] (`transition` P[N, N], column j the
distribution of the next word given a context word j). So

    P(x) = prod_{t <= T} mu(x_t) * sum_s Q_{x_T}[s] P[x_{T+1}, x_s],

a product of known factors: the MLM conditional P(x_j = w | x_-j) is the joint with x_j = w normalised over w
(`conditionals`), and the next-word conditional is sum_s Q_{x_T}[s] P[:, x_s] (`next_word`). Sentences have
L = T + 1 words (word ids 0..N-1, flatlm's padding convention); the last position is the "downstream" of the
setting, and `latents["position"]` records the attended s.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flatlm.languages.base import Corpus, special_ids


@dataclasses.dataclass
class SCB:
    """transition P[N, N] (columns sum to 1), patterns Q[N, T] (rows sum to 1), mu[N] (sums to 1)."""

    transition: np.ndarray
    patterns: np.ndarray
    mu: np.ndarray | None = None

    def __post_init__(self):
        P, Q = np.asarray(self.transition, np.float64), np.asarray(self.patterns, np.float64)
        N, T = Q.shape
        if P.shape != (N, N) or not np.allclose(P.sum(0), 1) or (P < 0).any():
            raise ValueError(f"transition must be [N, N] = [{N}, {N}] with columns on the simplex")
        if not np.allclose(Q.sum(1), 1) or (Q < 0).any():
            raise ValueError("every attention pattern (row of patterns) must be a distribution over the T positions")
        mu = np.full(N, 1.0 / N) if self.mu is None else np.asarray(self.mu, np.float64)
        if mu.shape != (N,) or not np.isclose(mu.sum(), 1) or (mu < 0).any():
            raise ValueError("mu must be a distribution over the N words")
        self.transition, self.patterns, self.mu = P, Q, mu

    @property
    def vocab_size(self) -> int:
        """N, the number of words."""
        return self.transition.shape[0]

    @property
    def context_length(self) -> int:
        """T, the context words before the last one."""
        return self.patterns.shape[1]

    @property
    def max_length(self) -> int:
        """T + 1 words per sentence."""
        return self.context_length + 1

    def sample(self, n: int, seed: int, latents: bool = True) -> Corpus:
        """n sentences (tokens int32[n, T + 1], all of length T + 1), latents {"position": the attended s}
        ({} with `latents=False`)."""
        rng = np.random.default_rng(seed)
        N, T = self.vocab_size, self.context_length
        ctx = rng.choice(N, size=(n, T), p=self.mu)
        cum_Q = np.cumsum(self.patterns[ctx[:, -1]], axis=1)
        s = np.minimum((rng.random((n, 1)) > cum_Q).sum(1), T - 1)
        cum_P = np.cumsum(self.transition[:, ctx[np.arange(n), s]].T, axis=1)  # [n, N]
        last = np.minimum((rng.random((n, 1)) > cum_P).sum(1), N - 1)
        tokens = np.concatenate([ctx, last[:, None]], 1).astype(np.int32)
        return Corpus(tokens, np.full(n, T + 1, np.int32), {"position": s.astype(np.int32)} if latents else {})

    def _joint(self, tokens_nL: np.ndarray) -> np.ndarray:
        """P(x) of full sentences, float64[n]."""
        ctx, last = tokens_nL[:, :-1], tokens_nL[:, -1]
        mix = np.einsum("ns,ns->n", self.patterns[ctx[:, -1]], self.transition[last[:, None], ctx])
        return np.prod(self.mu[ctx], axis=1) * mix

    def _check(self, tokens, lengths) -> np.ndarray:
        tokens = np.asarray(tokens)
        L = self.max_length
        if tokens.ndim != 2 or tokens.shape[1] < L or np.any(np.asarray(lengths) != L):
            raise ValueError(f"SCB sentences have exactly {L} words (lengths {L}, tokens [n, >= {L}])")
        if (tokens[:, :L] < 0).any() or (tokens[:, :L] >= self.vocab_size).any():
            raise ValueError(f"word ids must lie in 0..{self.vocab_size - 1}")
        return tokens[:, :L].astype(np.int64)

    def log_prob(self, tokens, lengths) -> np.ndarray:
        """Exact log P(x) in nats, float64[n]."""
        with np.errstate(divide="ignore"):
            return np.log(self._joint(self._check(tokens, lengths)))

    def conditionals(self, tokens, lengths) -> np.ndarray:
        """Exact q[n, T', N] = P(x_j = w | x_-j) for j < T + 1 (T' = tokens.shape[1]; 0 beyond T + 1)."""
        x = self._check(tokens, lengths)
        n, L = x.shape
        N = self.vocab_size
        q = np.zeros((n, np.asarray(tokens).shape[1], N))
        for j in range(L):
            cand = np.repeat(x[:, None, :], N, axis=1)  # [n, N, L]: sentence b with x_j = w
            cand[:, :, j] = np.arange(N)
            joint = self._joint(cand.reshape(n * N, L)).reshape(n, N)
            total = joint.sum(1, keepdims=True)
            q[:, j] = np.divide(joint, total, out=np.zeros_like(joint), where=total > 0)
        return q

    def next_word(self, tokens) -> np.ndarray:
        """P(x_{T+1} = . | x_1..x_T), float64[n, N], from the first T words of each row."""
        ctx = np.asarray(tokens)[:, : self.context_length].astype(np.int64)
        return np.einsum("ns,mns->nm", self.patterns[ctx[:, -1]], self.transition[:, ctx])

    @property
    def specials(self):
        """pad / mask / cls ids after the N words."""
        return special_ids(self.vocab_size)


def random_scb(seed: int, num_words: int = 8, context_length: int = 10, sparsity: int = 2,
               concentration: float = 1.0) -> SCB:
    """A random SCB: each column of P a Dirichlet(concentration) draw; each word k's pattern Q_k uniform weights
    (Dirichlet(1)) on `sparsity` distinct positions chosen uniformly; mu uniform."""
    if not 1 <= sparsity <= context_length:
        raise ValueError(f"sparsity must be in 1..context_length={context_length}, got {sparsity}")
    rng = np.random.default_rng(seed)
    P = rng.dirichlet(np.full(num_words, concentration), size=num_words).T
    Q = np.zeros((num_words, context_length))
    for k in range(num_words):
        pos = rng.choice(context_length, size=sparsity, replace=False)
        Q[k, pos] = rng.dirichlet(np.ones(sparsity))
    return SCB(P, Q)


def correlated_scb(scb: SCB, seed: int, keep: str = "patterns", mix: float = 0.5, concentration: float = 1.0) -> SCB:
    """A source SCB correlated with `scb` (issue 19's transfer setting): one factor kept, the other
    (1 - mix) * own + mix * a fresh random draw of `random_scb`'s kind (the same sparsity for patterns, so the mixed
    patterns are supported on at most twice as many positions). keep "patterns": same Q, perturbed P; "transition":
    same P, perturbed Q. mix = 0 gives `scb` itself, mix = 1 an independent draw of the perturbed factor."""
    if keep not in ("patterns", "transition") or not 0 <= mix <= 1:
        raise ValueError(f"keep must be patterns or transition and mix in [0, 1], got {keep!r}, {mix}")
    sparsity = int((scb.patterns[0] > 0).sum())
    fresh = random_scb(seed, scb.vocab_size, scb.context_length, sparsity, concentration)
    if keep == "patterns":
        return SCB((1 - mix) * scb.transition + mix * fresh.transition, scb.patterns, scb.mu)
    return SCB(scb.transition, (1 - mix) * scb.patterns + mix * fresh.patterns, scb.mu)
