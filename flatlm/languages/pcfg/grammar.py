"""The `PCFG` class: a grammar in Chomsky normal form, validated, with sampling, exact inference and the
downstream task labels of Section 3.2 / Appendix A.1.

The methods delegate: rules files to `rules_file`, sampling to `sample`, inference to `engine` (chart plans,
compiled kernels, length buckets), task definitions to `tasks`. Those modules take the grammar's arrays, not
the class, so imports run one way (grammar -> the rest).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flatlm.errors import UserError
from flatlm.languages.base import Corpus
from flatlm.languages.pcfg import rules_file, tasks
from flatlm.languages.pcfg.engine import Engine, encode_tokens
from flatlm.languages.pcfg.plan import Plan
from flatlm.languages.pcfg.sample import Sampler, sample_blocks, sample_corpus

_TOL = 1e-6  # allowed |sum - 1| of a probability row passed to the constructor


class PCFG:
    """A PCFG in Chomsky normal form: `root[N]`, `binary[N, N, N]` (P(A -> B C)), `emit[N, V]` (P(A -> w)).

    The generative language of Section 3.2 / Appendix A.1 (`random_grammar` or the released rules file).
    For every A, `binary[A].sum() + emit[A].sum() == 1`, and `root.sum() == 1`. `max_length` caps sentence
    length: by default the longest sentence the grammar can derive (a recursive grammar needs an explicit
    cap; `sample` then conditions on length <= cap, which leaves every conditional P(x_t | x_-t) unchanged).
    `batch_size`: sentences per jitted inference call (64 keeps a chunk's chart in cache).
    `bucket_lengths`: sort sentences by length and size each chunk's chart to its longest sentence (rounded
    up to a multiple of 4, then 8: fewer compiles); False always uses the tokens' width T (one compile).
    """

    def __init__(self, root, binary, emit, nonterminals: Sequence[str] | None = None,
                 words: Sequence[str] | None = None, max_length: int | None = None, batch_size: int = 64,
                 bucket_lengths: bool = True):
        root_N = np.asarray(root, np.float64)
        binary_NNN = np.asarray(binary, np.float64)
        emit_NV = np.asarray(emit, np.float64)
        if root_N.ndim != 1 or root_N.size == 0:
            raise ValueError(f"root must be a non-empty vector [N], got shape {root_N.shape}")
        N = root_N.size
        if binary_NNN.shape != (N, N, N):
            raise ValueError(f"binary must have shape [N, N, N] = {(N, N, N)}, got {binary_NNN.shape}")
        if emit_NV.ndim != 2 or emit_NV.shape[0] != N or emit_NV.shape[1] == 0:
            raise ValueError(f"emit must have shape [N, V] with N = {N}, got {emit_NV.shape}")
        for name, a in (("root", root_N), ("binary", binary_NNN), ("emit", emit_NV)):
            if not np.all(np.isfinite(a)) or np.any(a < 0):
                raise ValueError(f"{name} must be finite and non-negative")
        if abs(root_N.sum() - 1) > _TOL:
            raise ValueError(f"root must sum to 1, sums to {root_N.sum():.9g}")
        total_N = binary_NNN.reshape(N, -1).sum(1) + emit_NV.sum(1)
        bad = np.flatnonzero(np.abs(total_N - 1) > _TOL)
        nonterminals = [f"N{i}" for i in range(N)] if nonterminals is None else [str(s) for s in nonterminals]
        words = [f"w{i}" for i in range(emit_NV.shape[1])] if words is None else [str(s) for s in words]
        if len(nonterminals) != N or len(set(nonterminals)) != N:
            raise ValueError(f"nonterminals must be {N} distinct names, got {len(set(nonterminals))} distinct")
        if len(words) != emit_NV.shape[1] or len(set(words)) != len(words):
            raise ValueError(f"words must be {emit_NV.shape[1]} distinct names")
        if bad.size:
            A = bad[0]
            raise ValueError(
                f"rules of nonterminal {nonterminals[A]!r} sum to {total_N[A]:.9g}, not 1: need "
                "binary[A].sum() + emit[A].sum() == 1 for every A"
            )
        self.root, self.binary, self.emit = root_N, binary_NNN, emit_NV
        self.nonterminals, self.words = nonterminals, words
        self.batch_size = int(batch_size)
        self.bucket_lengths = bool(bucket_lengths)
        longest = _longest_sentence(root_N, binary_NNN, emit_NV)
        if max_length is None:
            if longest is None:
                raise ValueError("this grammar derives sentences of unbounded length; pass max_length")
            if longest == 0:
                raise ValueError("this grammar derives no sentence")
            max_length = longest
        self._max_length = int(max_length)
        if self._max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self._rejects = longest is None or longest > self._max_length  # sampling must reject long sentences
        self._engine = Engine(root_N, binary_NNN, emit_NV)
        self._sampler = None

    # ---- sizes -------------------------------------------------------------------------------------------

    @property
    def num_nonterminals(self) -> int:
        """N."""
        return int(self.root.size)

    @property
    def vocab_size(self) -> int:
        """V: words are ids 0..V-1."""
        return int(self.emit.shape[1])

    @property
    def max_length(self) -> int:
        """T: sentences have 1..T words (the longest derivable sentence, or the configured cap)."""
        return self._max_length

    @property
    def root_children(self) -> np.ndarray:
        """int[K] nonterminals with root[A] > 0, in nonterminal order (task A's label space)."""
        return np.flatnonzero(self.root > 0)

    def __repr__(self) -> str:
        return f"PCFG(N={self.num_nonterminals}, V={self.vocab_size}, max_length={self.max_length})"

    # ---- rules files -------------------------------------------------------------------------------------

    @classmethod
    def from_rules_file(cls, path, max_length: int | None = None, sort_words: bool = True, **kwargs) -> PCFG:
        """Read the released `LHS RHS1 [RHS2] PROB` format (`rules_file.read_rules` says how duplicate rules are
        summed, every LHS renormalised, and symbols numbered; words sorted unless `sort_words=False`).

        Raises `UserError` naming the line, or the file for a grammar the constructor rejects. `max_length` and
        `kwargs` go to the constructor.
        """
        root_N, binary_NNN, emit_NV, nonterminals, words = rules_file.read_rules(path, sort_words)
        try:
            return cls(root_N, binary_NNN, emit_NV, nonterminals, words, max_length=max_length, **kwargs)
        except ValueError as e:
            raise UserError(f"{path}: {e}") from None

    def to_rules_file(self, path) -> None:
        """Write the released format: `S A p` root lines, then `A B C p` and `A w p` (exact float repr)."""
        rules_file.write_rules(path, self.root, self.binary, self.emit, self.nonterminals, self.words)

    # ---- sampling ----------------------------------------------------------------------------------------

    def sample(self, n: int, seed: int, latents: bool = True) -> Corpus:
        """n sentences (tokens int32[n, T], T = max_length, padded with pad = V) and their parse trees.

        Vectorised: the whole batch is expanded one tree level at a time. `latents` holds the tree as
        T-shaped int32 arrays (-1 where unused): `preterminal[t]` is the nonterminal that emitted word t;
        every internal node A -> B C is stored at its split point k (B spans [start, k), C spans [k, end),
        1 <= k < length), as `split_symbol[k]`, `split_start[k]`, `split_end[k]`. `latents=False`: the same
        sentences without their trees (~1.5x faster; the stream source's training batches).
        """
        return sample_corpus(self._get_sampler(), n, seed, self.max_length, self._rejects, latents)

    def sample_blocks(self, ns, seeds, latents: bool = True) -> Corpus:
        """`sample(ns[b], seeds[b], latents)` for every block b, concatenated in block order: the same sentences,
        each tree level expanded once for all blocks (the stream source's batch of `data.stream_block`-row blocks)."""
        return sample_blocks(self._get_sampler(), ns, seeds, self.max_length, self._rejects, latents)

    def _get_sampler(self) -> Sampler:
        if self._sampler is None:
            self._sampler = Sampler(self.root, self.binary, self.emit)
        return self._sampler

    # ---- exact inference ---------------------------------------------------------------------------------

    def log_prob(self, tokens, lengths) -> np.ndarray:
        """float[n] log P(x) (natural log; -inf for sentences the grammar cannot derive)."""
        tokens, lengths = self._check(tokens, lengths)
        out = self._run("forward", tokens, lengths)
        with np.errstate(divide="ignore"):
            return (np.log(out["z"].astype(np.float64)) + out["log_scale"]
                    + out["leaf_log_scale"].astype(np.float64).sum(1))

    def conditionals(self, tokens, lengths) -> np.ndarray:
        """float[n, T, V]: q[b, t, w] = P(x_t = w | x_-t) for t < lengths[b], 0 beyond (Appendix A.2).

        One batched JAX computation for every position and word (the outside pass gives the gradient of
        the inside pass with respect to every leaf). A position whose context no derivable sentence has
        gives a row of zeros. A `mask` id (special_ids(V).mask) inside a sentence is an unobserved word,
        summed over (in every method that takes tokens). In float32, the rows of a sentence the grammar cannot
        derive (P(x) = 0, e.g. one word replaced) can come out as zeros at long lengths when its rules are rare
        (16 words at rule probabilities 1e-3): its chart has no mass to scale by. Run such inputs under
        `jax.enable_x64()`; sentences the grammar derives are exact to rounding in either dtype.
        """
        tokens, lengths = self._check(tokens, lengths)
        return self._run("conditionals", tokens, lengths)["q"][:, : tokens.shape[1]]

    def prefix_inside(self, tokens, lengths) -> np.ndarray:
        """float[n, T, N]: log P(A =>* x_0..x_k) for the prefix span [0, k+1) (-inf where impossible/beyond)."""
        tokens, lengths = self._check(tokens, lengths)
        out = self._run("forward", tokens, lengths)
        with np.errstate(divide="ignore"):
            leaf_nT = np.cumsum(out["leaf_log_scale"].astype(np.float64), 1)
            log_nTN = np.log(out["prefix"].astype(np.float64)) + (out["prefix_log_scale"] + leaf_nT)[..., None]
            return log_nTN[:, : tokens.shape[1]]

    def span_posteriors(self, tokens, lengths) -> np.ndarray:
        """float[n, T, T+1, N]: P(A spans [i, j) | x) at [b, i, j, A], by inside-outside (NaN if P(x) = 0)."""
        tokens, lengths = self._check(tokens, lengths)
        n, T = tokens.shape
        post_nTTN = self._run("posteriors", tokens, lengths)["post"]
        out = np.zeros((n, T, T + 1, self.num_nonterminals), post_nTTN.dtype)
        for i in range(T):
            out[:, i, i + 1: T + 1] = post_nTTN[:, i, : T - i]
        return out

    def length_distribution(self, max_length: int | None = None) -> np.ndarray:
        """float[L+1]: P(length = l) for l = 0..L (L = max_length by default), by an all-ones-leaf inside pass.

        With a cap below the longest derivable sentence the entries sum to less than 1.
        """
        return self._engine.length_distribution(self.max_length if max_length is None else int(max_length))

    # ---- downstream tasks --------------------------------------------------------------------------------

    def num_labels(self, task: str, definition: str = "released") -> int:
        """Task A: the root's children (9 for the released grammar); B and C (and every task under the paper's
        definition): all N nonterminals."""
        return len(self.label_names(task, definition))

    def label_names(self, task: str, definition: str = "released") -> list[str]:
        """The nonterminal each label id stands for."""
        return [self.nonterminals[i] for i in tasks.label_ids(task, self.root, definition)]

    def task_labels(self, tokens, lengths, task: str, definition: str = "released",
                    prefix: int | None = None) -> np.ndarray:
        """int32[n] downstream labels of tasks "A", "B", "C" (Section 3.2, Appendix A.1).

        definition="released" (generate_downstream.py): argmax over nonterminals of the inside probability
        P(A =>* x_0..x_{k-1}); task A: k = length, over the root's children only, *without* the root
        prior; B: k = 4, C: k = 2 (or `prefix`), over all nonterminals. definition="posterior":
        argmax_A P(A spans [0, k) | x) by inside-outside (for A this is root[A] * inside / P(x)).
        definition="paper" (A.1's text): the posterior over all N nonterminals of the span [0, min(L, length)),
        L = 32 / 16 / 8 for A / B / C (`prefix` replaces L).
        Ties go to the lowest label id, as in the released code (Python's max returns the first key of its
        S1..S9, A1_0.., A4_9 dict), so a prefix no nonterminal derives gets label 0. Scores within relative
        1e-5 (float32; 1e-10 under x64) of the best count as tied: mathematically equal scores (e.g. from
        mirror-image rules S2 -> A B, S3 -> B A on a palindrome) then resolve the same way whatever the
        rounding. Label ids: task A indexes `root_children`, B and C index nonterminals (`label_names`).
        """
        tasks.check_task(task)
        tasks.check_definition(definition)
        tokens, lengths = self._check(tokens, lengths)
        rows_n, k_n = np.arange(len(lengths)), tasks.span_ends(task, lengths, prefix, definition)
        if definition == "released":
            score_nN = self._run("forward", tokens, lengths)["prefix"][rows_n, k_n - 1]
        else:
            post = self._run("posteriors", tokens, lengths)["post"]  # [n, start, width - 1, N]
            score_nN = post[rows_n, 0, k_n - 1]
        return tasks.best_label(score_nN, tasks.label_ids(task, self.root, definition))

    def sample_task(self, n: int, seed: int, task: str, definition: str = "released",
                    prefix: int | None = None, min_length: int = 5, max_length: int = 31
                    ) -> tuple[Corpus, np.ndarray]:
        """n sentences with min_length <= length <= max_length (released: 5..31) and their task labels."""
        tasks.check_task(task)
        p = self.length_distribution()[min_length: max_length + 1].sum()
        if p <= 0:
            raise ValueError(f"the grammar derives no sentence of {min_length}..{max_length} words")
        corpus = tasks.sample_lengths(self.sample, n, seed, p, min_length, max_length)
        labels = self.task_labels(corpus.tokens, corpus.lengths, task, definition, prefix)
        return corpus, labels

    # ---- internals ---------------------------------------------------------------------------------------

    def _check(self, tokens, lengths) -> tuple[np.ndarray, np.ndarray]:
        """Validate; return int32 tokens with every position beyond a sentence's length set to pad (= V)."""
        return encode_tokens(tokens, lengths, self.vocab_size)

    def _plan(self, T: int) -> Plan:
        """The static chart plan for T words (benchmarks count its operations)."""
        return self._engine.plan(T)

    def _run(self, kind: str, tokens: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        """Apply a jitted kernel in chunks of sentences of similar length; outputs in the input order."""
        return self._engine.run(kind, tokens, lengths, self.batch_size, self.bucket_lengths)


def _longest_sentence(root_N, binary_NNN, emit_NV) -> int | None:
    """Longest derivable sentence from the root, 0 if none, None if unbounded (a reachable cycle)."""
    N = root_N.size
    rule_N = binary_NNN > 0
    productive = emit_NV.sum(1) > 0
    while True:
        grown = productive | np.any(rule_N & productive[None, :, None] & productive[None, None, :], axis=(1, 2))
        if np.array_equal(grown, productive):
            break
        productive = grown
    useful_rule = rule_N & productive[:, None, None] & productive[None, :, None] & productive[None, None, :]
    reach = (root_N > 0) & productive
    while True:
        grown = reach | np.any(useful_rule[reach], axis=(0, 2)) | np.any(useful_rule[reach], axis=(0, 1))
        if np.array_equal(grown, reach):
            break
        reach = grown
    if not reach.any():
        return 0
    longest = np.where(productive & (emit_NV.sum(1) > 0), 1.0, -np.inf)
    for _ in range(N + 2):
        best = np.full(N, -np.inf)
        for A in np.flatnonzero(reach):
            B, C = np.nonzero(useful_rule[A])
            if B.size:
                best[A] = (longest[B] + longest[C]).max()
        new = np.where(reach, np.maximum(np.where(emit_NV.sum(1) > 0, 1.0, -np.inf), best), -np.inf)
        if np.array_equal(new, longest):
            return int(new[(root_N > 0) & reach].max())
        longest = new
    return None
