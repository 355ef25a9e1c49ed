"""Probabilistic context-free grammars (Chomsky normal form) with exact, batched inference in JAX.

A grammar has nonterminals 0..N-1 and words 0..V-1 (special ids pad, mask, cls come after the words):
`root[A]` = P(a sentence is derived from A), `binary[A, B, C]` = P(A -> B C), `emit[A, w]` = P(A -> w).

Inference runs the inside algorithm for a whole batch at once, width by width, in *scaled linear space*:
each span keeps its inside vector divided by its maximum, with the log of that scale beside it, so float32
is exact to rounding and the grammar's many exact zeros stay exact zeros (log space would give NaN
gradients there). The chart is linear in each position's leaf vector, so the derivative of the root value
with respect to the leaf vectors -- the outside pass, written out as the mirror image of the inside pass --
gives P(x_-t, x_t = w) / P(x) for every position t and word w at once. Only the nonterminals that can span
a width, and only blocks of child pairs (B, C) that some rule uses, are computed: the released grammar's
layers make that about 20x cheaper than a dense N^3 chart.

The released rules format (Liu et al. 2023, `pcfg_rule_deep_mlm.txt`) is one rule per line,
`LHS RHS1 [RHS2] PROB`; the first line's LHS is the start symbol, whose unary rules `S -> Sk` become `root`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flatlm.errors import UserError
from flatlm.languages.base import Corpus, special_ids

TASKS = ("A", "B", "C")
TASK_PREFIX = {"B": 4, "C": 2}  # released generate_downstream.py: inside_partial(sent, grammar, 4 / 2)
DEFINITIONS = ("released", "posterior")
_TOL = 1e-6  # allowed |sum - 1| of a probability row passed to the constructor


# ----------------------------------------------------------------------------------------------------------
# The grammar
# ----------------------------------------------------------------------------------------------------------


class PCFG:
    """A PCFG in Chomsky normal form: `root[N]`, `binary[N, N, N]` (P(A -> B C)), `emit[N, V]` (P(A -> w)).

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
        binary_NxNxN = np.asarray(binary, np.float64)
        emit_NxV = np.asarray(emit, np.float64)
        if root_N.ndim != 1 or root_N.size == 0:
            raise ValueError(f"root must be a non-empty vector [N], got shape {root_N.shape}")
        N = root_N.size
        if binary_NxNxN.shape != (N, N, N):
            raise ValueError(f"binary must have shape [N, N, N] = {(N, N, N)}, got {binary_NxNxN.shape}")
        if emit_NxV.ndim != 2 or emit_NxV.shape[0] != N or emit_NxV.shape[1] == 0:
            raise ValueError(f"emit must have shape [N, V] with N = {N}, got {emit_NxV.shape}")
        for name, a in (("root", root_N), ("binary", binary_NxNxN), ("emit", emit_NxV)):
            if not np.all(np.isfinite(a)) or np.any(a < 0):
                raise ValueError(f"{name} must be finite and non-negative")
        if abs(root_N.sum() - 1) > _TOL:
            raise ValueError(f"root must sum to 1, sums to {root_N.sum():.9g}")
        total_N = binary_NxNxN.reshape(N, -1).sum(1) + emit_NxV.sum(1)
        bad = np.flatnonzero(np.abs(total_N - 1) > _TOL)
        nonterminals = [f"N{i}" for i in range(N)] if nonterminals is None else [str(s) for s in nonterminals]
        words = [f"w{i}" for i in range(emit_NxV.shape[1])] if words is None else [str(s) for s in words]
        if len(nonterminals) != N or len(set(nonterminals)) != N:
            raise ValueError(f"nonterminals must be {N} distinct names, got {len(set(nonterminals))} distinct")
        if len(words) != emit_NxV.shape[1] or len(set(words)) != len(words):
            raise ValueError(f"words must be {emit_NxV.shape[1]} distinct names")
        if bad.size:
            A = bad[0]
            raise ValueError(
                f"rules of nonterminal {nonterminals[A]!r} sum to {total_N[A]:.9g}, not 1: need "
                "binary[A].sum() + emit[A].sum() == 1 for every A"
            )
        self.root, self.binary, self.emit = root_N, binary_NxNxN, emit_NxV
        self.nonterminals, self.words = nonterminals, words
        self.batch_size = int(batch_size)
        self.bucket_lengths = bool(bucket_lengths)
        longest = _longest_sentence(root_N, binary_NxNxN, emit_NxV)
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
        self._plans: dict = {}
        self._fns: dict = {}
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
        """Read the released `LHS RHS1 [RHS2] PROB` format.

        Duplicate rules are summed and every left-hand side is renormalised. The first rule's LHS is the start
        symbol: if its rules are unary (`S -> Sk`) they become `root` and S is dropped; otherwise root is
        one-hot on it. A 2-symbol rule whose RHS has no rules of its own is a word. Words get ids in sorted
        order (as the released code's vocabulary) unless `sort_words=False` (order of first appearance);
        nonterminals are numbered in order of first appearance as a LHS. Raises `UserError` naming the line.
        """
        path = os.fspath(path)
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise UserError(f"cannot read grammar rules file {path}: {e.strerror}") from None
        entries = []
        for lineno, line in enumerate(lines, 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if len(fields) not in (3, 4):
                raise UserError(f"{path}:{lineno}: expected 'LHS RHS1 [RHS2] PROB', got {line.strip()!r}")
            try:
                prob = float(fields[-1])
            except ValueError:
                raise UserError(f"{path}:{lineno}: probability {fields[-1]!r} is not a number") from None
            if not (math.isfinite(prob) and prob >= 0):
                raise UserError(f"{path}:{lineno}: probability {fields[-1]!r} must be finite and >= 0")
            entries.append((lineno, fields[0], tuple(fields[1:-1]), prob))
        if not entries:
            raise UserError(f"{path}: no rules found; expected lines 'LHS RHS1 [RHS2] PROB'")
        lhs_order = list(dict.fromkeys(e[1] for e in entries))
        lhs_set = set(lhs_order)
        start = entries[0][1]
        start_unary = [e for e in entries if e[1] == start and len(e[2]) == 1 and e[2][0] in lhs_set]
        fold = bool(start_unary)
        nonterminals = [s for s in lhs_order if not (fold and s == start)]
        nt_index = {s: i for i, s in enumerate(nonterminals)}
        word_order: dict[str, None] = {}
        for lineno, lhs, rhs, _ in entries:
            if len(rhs) == 2:
                if fold and lhs == start:
                    raise UserError(f"{path}:{lineno}: the start symbol {start!r} mixes unary rules with others")
                for s in rhs:
                    if s not in lhs_set:
                        raise UserError(f"{path}:{lineno}: {s!r} has no rules of its own; a binary rule "
                                        "'LHS B C PROB' needs two nonterminals")
                    if fold and s == start:
                        raise UserError(f"{path}:{lineno}: the start symbol {start!r} appears on a right-hand side")
            elif rhs[0] in lhs_set:
                if lhs != start:
                    raise UserError(f"{path}:{lineno}: unary rule {lhs} -> {rhs[0]} (only the start symbol "
                                    f"{start!r}, the first line's LHS, may have unary rules)")
                if rhs[0] == start:
                    raise UserError(f"{path}:{lineno}: unary rule {start} -> {start}")
            else:
                if fold and lhs == start:
                    raise UserError(f"{path}:{lineno}: the start symbol {start!r} mixes unary rules with others")
                word_order.setdefault(rhs[0], None)
        words = sorted(word_order) if sort_words else list(word_order)
        w_index = {w: i for i, w in enumerate(words)}
        N, V = len(nonterminals), len(words)
        if N == 0 or V == 0:
            raise UserError(f"{path}: the grammar needs at least one nonterminal and one word")
        root_N = np.zeros(N)
        binary_NxNxN = np.zeros((N, N, N))
        emit_NxV = np.zeros((N, V))
        for _, lhs, rhs, prob in entries:
            if fold and lhs == start:
                root_N[nt_index[rhs[0]]] += prob
            elif len(rhs) == 2:
                binary_NxNxN[nt_index[lhs], nt_index[rhs[0]], nt_index[rhs[1]]] += prob
            else:
                emit_NxV[nt_index[lhs], w_index[rhs[0]]] += prob
        if not fold:
            root_N[nt_index[start]] = 1.0
        total_N = binary_NxNxN.reshape(N, -1).sum(1) + emit_NxV.sum(1)
        for A in range(N):
            if total_N[A] <= 0:
                raise UserError(f"{path}: the rules of {nonterminals[A]!r} have total probability 0")
        if root_N.sum() <= 0:
            raise UserError(f"{path}: the start symbol's rules have total probability 0")
        binary_NxNxN /= total_N[:, None, None]
        emit_NxV /= total_N[:, None]
        try:
            return cls(root_N / root_N.sum(), binary_NxNxN, emit_NxV, nonterminals, words,
                       max_length=max_length, **kwargs)
        except ValueError as e:
            raise UserError(f"{path}: {e}") from None

    def to_rules_file(self, path) -> None:
        """Write the released format: `S A p` root lines, then `A B C p` and `A w p` (exact float repr)."""
        names = set(self.nonterminals) | set(self.words)
        for s in names:
            if not s or any(c.isspace() for c in s) or s.startswith("#"):
                raise ValueError(f"symbol name {s!r} cannot be written to a rules file")
        if set(self.nonterminals) & set(self.words):
            raise ValueError("a word has the same name as a nonterminal; rename before writing")
        start = "S"
        while start in names:
            start += "_"
        lines = [f"{start} {self.nonterminals[A]} {float(self.root[A])!r}" for A in np.flatnonzero(self.root)]
        for A, name in enumerate(self.nonterminals):
            for B, C in zip(*np.nonzero(self.binary[A])):
                lines.append(f"{name} {self.nonterminals[B]} {self.nonterminals[C]} {float(self.binary[A, B, C])!r}")
            for w in np.flatnonzero(self.emit[A]):
                lines.append(f"{name} {self.words[w]} {float(self.emit[A, w])!r}")
        with open(os.fspath(path), "w") as f:
            f.write("\n".join(lines) + "\n")

    # ---- sampling ----------------------------------------------------------------------------------------

    def sample(self, n: int, seed: int) -> Corpus:
        """n sentences (tokens int32[n, T], T = max_length, padded with pad = V) and their parse trees.

        Vectorised: the whole batch is expanded one tree level at a time. `latents` holds the tree as
        T-shaped int32 arrays (-1 where unused): `preterminal[t]` is the nonterminal that emitted word t;
        every internal node A -> B C is stored at its split point k (B spans [start, k), C spans [k, end),
        1 <= k < length), as `split_symbol[k]`, `split_start[k]`, `split_end[k]`.
        """
        if self._sampler is None:
            self._sampler = _Sampler(self)
        rng = np.random.default_rng(seed)
        parts, have = [], 0
        while have < n:
            want = n - have
            m = want if not self._rejects else int(want * 1.25) + 16
            part = self._sampler.draw(rng, m, self.max_length)
            parts.append(part)
            have += len(part["lengths"])
        out = {k: np.concatenate([p[k] for p in parts])[:n] for k in parts[0]}
        tokens = out.pop("tokens")
        lengths = out.pop("lengths")
        return Corpus(tokens=tokens, lengths=lengths, latents=out)

    # ---- exact inference ---------------------------------------------------------------------------------

    def log_prob(self, tokens, lengths) -> np.ndarray:
        """float[n] log P(x) (natural log; -inf for sentences the grammar cannot derive)."""
        tokens, lengths = self._check(tokens, lengths)
        out = self._run("forward", tokens, lengths)
        with np.errstate(divide="ignore"):
            return (np.log(out["z"].astype(np.float64)) + out["log_scale"]
                    + out["leaf_log_scale"].astype(np.float64).sum(1))

    def conditionals(self, tokens, lengths) -> np.ndarray:
        """float[n, T, V]: q[b, t, w] = P(x_t = w | x_-t) for t < lengths[b], 0 beyond.

        One batched JAX computation for every position and word (the outside pass gives the gradient of
        the inside pass with respect to every leaf). A position whose context no derivable sentence has
        gives a row of zeros. A `mask` id (special_ids(V).mask) inside a sentence is an unobserved word,
        summed over (in every method that takes tokens).
        """
        tokens, lengths = self._check(tokens, lengths)
        return self._run("conditionals", tokens, lengths)["q"][:, : tokens.shape[1]]

    def prefix_inside(self, tokens, lengths) -> np.ndarray:
        """float[n, T, N]: log P(A =>* x_0..x_k) for the prefix span [0, k+1) (-inf where impossible/beyond)."""
        tokens, lengths = self._check(tokens, lengths)
        out = self._run("forward", tokens, lengths)
        with np.errstate(divide="ignore"):
            leaf_nxT = np.cumsum(out["leaf_log_scale"].astype(np.float64), 1)
            log_nxTxN = np.log(out["prefix"].astype(np.float64)) + (out["prefix_log_scale"] + leaf_nxT)[..., None]
            return log_nxTxN[:, : tokens.shape[1]]

    def span_posteriors(self, tokens, lengths) -> np.ndarray:
        """float[n, T, T+1, N]: P(A spans [i, j) | x) at [b, i, j, A], by inside-outside (NaN if P(x) = 0)."""
        tokens, lengths = self._check(tokens, lengths)
        n, T = tokens.shape
        post_nxTxTxN = self._run("posteriors", tokens, lengths)["post"]
        out = np.zeros((n, T, T + 1, self.num_nonterminals), post_nxTxTxN.dtype)
        for i in range(T):
            out[:, i, i + 1: T + 1] = post_nxTxTxN[:, i, : T - i]
        return out

    def length_distribution(self, max_length: int | None = None) -> np.ndarray:
        """float[L+1]: P(length = l) for l = 0..L (L = max_length by default), by an all-ones-leaf inside pass.

        With a cap below the longest derivable sentence the entries sum to less than 1.
        """
        L = self.max_length if max_length is None else int(max_length)
        plan = self._plan(L)
        fn = self._fn("lengths", L)
        leaf_1xTxN = jnp.broadcast_to(plan.consts["leaf_total"], (1, L, plan.N))
        z_1xT, log_scale_1xT, leaf_log_1xT = (np.asarray(a[0], np.float64) for a in fn(plan.consts, leaf_1xTxN))
        p = z_1xT * np.exp(log_scale_1xT + np.cumsum(leaf_log_1xT))
        return np.concatenate([[0.0], p])

    # ---- downstream tasks --------------------------------------------------------------------------------

    def num_labels(self, task: str) -> int:
        """Task A: the root's children (9 for the released grammar); B and C: all N nonterminals."""
        return len(self.label_names(task))

    def label_names(self, task: str) -> list[str]:
        """The nonterminal each label id stands for."""
        _check_task(task)
        ids = self.root_children if task == "A" else np.arange(self.num_nonterminals)
        return [self.nonterminals[i] for i in ids]

    def task_labels(self, tokens, lengths, task: str, definition: str = "released",
                    prefix: int | None = None) -> np.ndarray:
        """int32[n] downstream labels of tasks "A", "B", "C".

        definition="released" (generate_downstream.py): argmax over nonterminals of the inside probability
        P(A =>* x_0..x_{k-1}); task A: k = length, over the root's children only, *without* the root
        prior; B: k = 4, C: k = 2 (or `prefix`), over all nonterminals. definition="posterior":
        argmax_A P(A spans [0, k) | x) by inside-outside (for A this is root[A] * inside / P(x)).
        Ties go to the lowest label id, as in the released code (Python's max returns the first key of its
        S1..S9, A1_0.., A4_9 dict), so a prefix no nonterminal derives gets label 0. Scores within relative
        1e-5 (float32; 1e-10 under x64) of the best count as tied: mathematically equal scores (e.g. from
        mirror-image rules S2 -> A B, S3 -> B A on a palindrome) then resolve the same way whatever the
        rounding. Label ids: task A indexes `root_children`, B and C index nonterminals (`label_names`).
        """
        _check_task(task)
        if definition not in DEFINITIONS:
            raise ValueError(f"definition must be one of {DEFINITIONS}, got {definition!r}")
        tokens, lengths = self._check(tokens, lengths)
        n = len(lengths)
        if task == "A":
            if prefix is not None:
                raise ValueError("task A always uses the whole sentence; prefix applies to B and C")
            k_n = lengths.astype(np.int64)
            ids = self.root_children
        else:
            k = TASK_PREFIX[task] if prefix is None else int(prefix)
            if k < 1 or np.any(lengths < k):
                raise ValueError(f"task {task} needs sentences of at least {k} words")
            k_n = np.full(n, k)
            ids = np.arange(self.num_nonterminals)
        if definition == "released":
            out = self._run("forward", tokens, lengths)
            score_nxN = out["prefix"][np.arange(n), k_n - 1]
        else:
            post = self._run("posteriors", tokens, lengths)["post"]  # [n, start, width - 1, N]
            score_nxN = post[np.arange(n), 0, k_n - 1]
        score_nxK = score_nxN[:, ids].astype(np.float64)
        tol = 1e-10 if score_nxN.dtype == np.float64 else 1e-5  # rounding of the scaled chart
        best_nx1 = score_nxK.max(1, keepdims=True)
        return np.argmax(score_nxK >= best_nx1 * (1 - tol), axis=1).astype(np.int32)

    def sample_task(self, n: int, seed: int, task: str, definition: str = "released",
                    prefix: int | None = None, min_length: int = 5, max_length: int = 31
                    ) -> tuple[Corpus, np.ndarray]:
        """n sentences with min_length <= length <= max_length (released: 5..31) and their task labels."""
        _check_task(task)
        p = self.length_distribution()[min_length: max_length + 1].sum()
        if p <= 0:
            raise ValueError(f"the grammar derives no sentence of {min_length}..{max_length} words")
        rng = np.random.default_rng(seed)
        parts, have = [], 0
        while have < n:
            c = self.sample(int((n - have) / p * 1.1) + 16, int(rng.integers(2**31)))
            keep = (c.lengths >= min_length) & (c.lengths <= max_length)
            parts.append(Corpus(c.tokens[keep], c.lengths[keep], {k: v[keep] for k, v in c.latents.items()}))
            have += int(keep.sum())
        corpus = Corpus(
            tokens=np.concatenate([c.tokens for c in parts])[:n],
            lengths=np.concatenate([c.lengths for c in parts])[:n],
            latents={k: np.concatenate([c.latents[k] for c in parts])[:n] for k in parts[0].latents},
        )
        labels = self.task_labels(corpus.tokens, corpus.lengths, task, definition, prefix)
        return corpus, labels

    # ---- internals ---------------------------------------------------------------------------------------

    def _check(self, tokens, lengths) -> tuple[np.ndarray, np.ndarray]:
        """Validate; return int32 tokens with every position beyond a sentence's length set to pad (= V)."""
        tokens = np.asarray(tokens)
        lengths = np.asarray(lengths)
        if tokens.ndim != 2 or lengths.shape != tokens.shape[:1]:
            raise ValueError(f"need tokens [n, T] and lengths [n], got {tokens.shape} and {lengths.shape}")
        lengths = lengths.astype(np.int32)
        T = tokens.shape[1]
        if np.any(lengths < 0) or np.any(lengths > T):
            raise ValueError(f"lengths must lie in 0..{T}")
        V, mask = self.vocab_size, special_ids(self.vocab_size).mask
        inside_nxT = np.arange(T)[None, :] < lengths[:, None]
        words = tokens[inside_nxT]
        if np.any(((words < 0) | (words >= V)) & (words != mask)):
            raise ValueError(f"word ids within each sentence's length must lie in 0..{V - 1} (or be mask = {mask})")
        # Internally row V of the leaf table is pad (zero), row V + 1 mask (the word is summed over).
        tokens = np.where(tokens == mask, V + 1, tokens)
        return np.where(inside_nxT, tokens, V).astype(np.int32), lengths

    def _plan(self, T: int) -> _Plan:
        dtype = jnp.float64 if jax.config.x64_enabled else jnp.float32
        key = (T, np.dtype(dtype).name)
        if key not in self._plans:
            self._plans[key] = _Plan(self, T, dtype)
        return self._plans[key]

    def _fn(self, kind: str, T: int):
        plan = self._plan(T)
        key = (kind, T, plan.dtype.name)
        if key not in self._fns:
            self._fns[key] = _Compiled(functools.partial(_KERNELS[kind], plan))
        return self._fns[key]

    def _run(self, kind: str, tokens: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        """Apply a jitted kernel in chunks of sentences of similar length; outputs in the input order.

        Time axes of the outputs have size max(T, largest chart size used); callers slice them to T.
        """
        n, T_in = tokens.shape
        order = np.argsort(lengths, kind="stable") if self.bucket_lengths else np.arange(n)
        chunks = [order[a: a + self.batch_size] for a in range(0, n, self.batch_size)]
        if self.bucket_lengths:
            sizes = [_bucket(max(int(lengths[idx].max()), 1)) for idx in chunks]
        else:
            sizes = [max(T_in, 1)] * len(chunks)
        T_max = max([T_in, *sizes])
        calls = []
        for idx, T in zip(chunks, sizes):
            B = min(self.batch_size, _next_pow2(len(idx)))
            tok_BxT = np.full((B, T), self.vocab_size, np.int32)  # pad id = V
            width = min(T, T_in)
            tok_BxT[: len(idx), :width] = tokens[idx, :width]
            len_B = np.zeros(B, np.int32)
            len_B[: len(idx)] = lengths[idx]
            calls.append((idx, self._fn(kind, T), (self._plan(T).consts, tok_BxT, len_B)))
        _compile_all([(fn, args) for _, fn, args in calls])  # every chart size first, in parallel
        results: dict[str, np.ndarray] = {}
        for idx, fn, args in calls:
            for k, v in fn(*args).items():
                v = np.asarray(v)[: len(idx)]
                axes = _TIME_AXES.get(k, ())
                if k not in results:
                    shape = [T_max if ax in axes else s for ax, s in enumerate(v.shape)][1:]
                    results[k] = np.zeros([n, *shape], v.dtype)
                results[k][(idx, *(slice(0, s) for s in v.shape[1:]))] = v
        return results


_TIME_AXES = {"q": (1,), "prefix": (1,), "prefix_log_scale": (1,), "leaf_log_scale": (1,), "post": (1, 2)}


# The charts are unrolled over widths (hundreds of small fusions): XLA:CPU's newer fusion emitters and
# LLVM -O3 each about double the compile time of these kernels, for no measurable speed.
_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 2}


class _Compiled:
    """A kernel compiled ahead of time per argument shape, with `_COMPILER_OPTIONS` where XLA knows them.

    `prepare` compiles several shapes at once in threads (XLA releases the GIL), so the few chart sizes
    one call needs compile in parallel on a multi-core host.
    """

    def __init__(self, fn):
        self.jitted = jax.jit(fn)
        self.executables: dict = {}
        self.options = dict(_COMPILER_OPTIONS)

    @staticmethod
    def _key(args) -> tuple:
        return tuple((tuple(np.shape(a)), np.result_type(a).name) for a in jax.tree.leaves(args))

    def _compile(self, args):
        lowered = self.jitted.lower(*args)
        try:
            return lowered.compile(compiler_options=self.options)
        except jax.errors.JaxRuntimeError as e:  # an XLA without these debug options
            if "compile option" not in str(e):
                raise
            self.options = {}
            return lowered.compile()

    def prepare(self, arg_lists: list) -> None:
        _compile_all([(self, args) for args in arg_lists])

    def __call__(self, *args):
        self.prepare([args])
        return self.executables[self._key(args)](*args)


def _compile_all(pairs: list) -> None:
    """Compile the missing (kernel, arguments) shapes, in parallel threads when there are several."""
    todo = {}
    for fn, args in pairs:
        key = (id(fn), fn._key(args))
        if fn._key(args) not in fn.executables and key not in todo:
            todo[key] = (fn, args)
    jobs = list(todo.values())
    x64 = bool(jax.config.x64_enabled)  # a thread-local setting: carry it into the workers

    def compile_job(job):
        with jax.enable_x64(x64):
            return job[0]._compile(job[1])

    if len(jobs) > 1:
        with concurrent.futures.ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
            exes = list(pool.map(compile_job, jobs))
    else:
        exes = [fn._compile(args) for fn, args in jobs]
    for (fn, args), exe in zip(jobs, exes):
        fn.executables[fn._key(args)] = exe


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _bucket(length: int) -> int:
    """Chart size for a chunk whose longest sentence has `length` words (few sizes -> few compiles)."""
    if length <= 4:
        return length
    if length <= 16:
        return -(-length // 4) * 4
    return -(-length // 8) * 8


def _longest_sentence(root_N, binary_NxNxN, emit_NxV) -> int | None:
    """Longest derivable sentence from the root, 0 if none, None if unbounded (a reachable cycle)."""
    N = root_N.size
    rule_N = binary_NxNxN > 0
    productive = emit_NxV.sum(1) > 0
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
    longest = np.where(productive & (emit_NxV.sum(1) > 0), 1.0, -np.inf)
    for _ in range(N + 2):
        best = np.full(N, -np.inf)
        for A in np.flatnonzero(reach):
            B, C = np.nonzero(useful_rule[A])
            if B.size:
                best[A] = (longest[B] + longest[C]).max()
        new = np.where(reach, np.maximum(np.where(emit_NxV.sum(1) > 0, 1.0, -np.inf), best), -np.inf)
        if np.array_equal(new, longest):
            return int(new[(root_N > 0) & reach].max())
        longest = new
    return None


# ----------------------------------------------------------------------------------------------------------
# Vectorised sampling
# ----------------------------------------------------------------------------------------------------------


class _Sampler:
    """All rules in one table sorted by LHS; rule r of A covers (A + cum[r-1], A + cum[r]] on the real line."""

    def __init__(self, g: PCFG):
        N, V = g.num_nonterminals, g.vocab_size
        left, right, word, prob = [], [], [], []
        for A in range(N):
            B, C = np.nonzero(g.binary[A])
            w = np.flatnonzero(g.emit[A])
            left += list(B) + [-1] * w.size
            right += list(C) + [-1] * w.size
            word += [-1] * B.size + list(w)
            p = np.concatenate([g.binary[A][B, C], g.emit[A][w]])
            c = np.cumsum(p) / p.sum()
            c[-1] = 1.0
            prob += list(A + c)
        self.left = np.asarray(left, np.int32)
        self.right = np.asarray(right, np.int32)
        self.word = np.asarray(word, np.int32)
        self.edge = np.asarray(prob, np.float64)
        support = np.flatnonzero(g.root)
        c = np.cumsum(g.root[support]) / g.root[support].sum()
        c[-1] = 1.0
        self.root_support, self.root_cum = support.astype(np.int32), c
        self.V, self.N = V, N

    def _rules(self, rng, sym):
        r = np.searchsorted(self.edge, sym + rng.random(sym.size), side="right")
        return np.minimum(r, self.edge.size - 1)

    def draw(self, rng, m: int, cap: int) -> dict[str, np.ndarray]:
        """m trees; sentences longer than `cap` are dropped (so fewer than m may come back)."""
        pick = np.searchsorted(self.root_cum, rng.random(m), side="right")
        sym = self.root_support[np.minimum(pick, self.root_cum.size - 1)]
        sent = np.arange(m, dtype=np.int64)
        alive = np.ones(m, bool)
        words_done = np.zeros(m, np.int64)
        levels = []  # per depth: sym, sent, word (-1: binary), child (index of left child in next level, -1)
        while sym.size:
            r = self._rules(rng, sym)
            word = self.word[r]
            expand = (word < 0) & alive[sent]
            words_done += np.bincount(sent[word >= 0], minlength=m)
            child = np.full(sym.size, -1, np.int64)
            child[expand] = 2 * np.arange(int(expand.sum()))
            levels.append((sym, sent, word, child))
            nxt_sent = np.repeat(sent[expand], 2)
            pending = np.bincount(nxt_sent, minlength=m)
            alive &= words_done + pending <= cap
            sym = np.stack([self.left[r[expand]], self.right[r[expand]]], 1).reshape(-1)
            sent = nxt_sent
        # bottom-up sizes, then top-down starts
        sizes = [None] * len(levels)
        for d in range(len(levels) - 1, -1, -1):
            sym_d, sent_d, word_d, child_d = levels[d]
            size = np.ones(sym_d.size, np.int64)
            inner = child_d >= 0
            if inner.any():
                nxt = sizes[d + 1]
                size[inner] = nxt[child_d[inner]] + nxt[child_d[inner] + 1]
            size[(word_d < 0) & ~inner] = 0  # binary node of a rejected sentence: never expanded
            sizes[d] = size
        lengths = sizes[0].copy()
        keep = alive & (lengths <= cap) & (lengths >= 1)
        T = cap
        tokens = np.full((m, T), special_ids(self.V).pad, np.int32)
        pre = np.full((m, T), -1, np.int32)
        split_sym = np.full((m, T), -1, np.int32)
        split_start = np.full((m, T), -1, np.int32)
        split_end = np.full((m, T), -1, np.int32)
        start = np.zeros(m, np.int64)
        for d, (sym_d, sent_d, word_d, child_d) in enumerate(levels):
            ok = keep[sent_d]
            leaf = ok & (word_d >= 0)
            tokens[sent_d[leaf], start[leaf]] = word_d[leaf]
            pre[sent_d[leaf], start[leaf]] = sym_d[leaf]
            inner = ok & (child_d >= 0)
            if d + 1 < len(levels):
                nxt_start = np.zeros(levels[d + 1][0].size, np.int64)
                has = child_d >= 0
                lc = child_d[has]
                nxt_start[lc] = start[has]
                nxt_start[lc + 1] = start[has] + sizes[d + 1][lc]
                k = start[inner] + sizes[d + 1][child_d[inner]]
                split_sym[sent_d[inner], k] = sym_d[inner]
                split_start[sent_d[inner], k] = start[inner]
                split_end[sent_d[inner], k] = start[inner] + sizes[d][inner]
                start = nxt_start
        return {
            "tokens": tokens[keep], "lengths": lengths[keep].astype(np.int32), "preterminal": pre[keep],
            "split_symbol": split_sym[keep], "split_start": split_start[keep], "split_end": split_end[keep],
        }


# ----------------------------------------------------------------------------------------------------------
# Batched inside / outside in JAX
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Width:
    """Static plan for spans of width w: the splits that matter and the child blocks they combine."""

    d0: int  # left-child widths d0..d1 cover every split with a usable rule
    d1: int
    blocks: list[_Block]


@dataclasses.dataclass
class _Block:
    """Rules A -> B C with B in [l0, l1), C in [r0, r1), usable at left-child widths d0..d1."""

    l0: int
    l1: int
    r0: int
    r1: int
    d0: int
    d1: int


class _Plan:
    """Everything static about a chart of T words.

    A nonterminal is *feasible* at width w if it can derive some w-word string. For each width the rules
    whose children can span complementary widths are grouped into blocks (connected components of the
    left-child/right-child graph, each widened to contiguous index ranges so that it is read by slicing):
    a layered grammar gets one small dense block per layer, a dense grammar one N x N block.
    """

    def __init__(self, g: PCFG, T: int, dtype):
        self.T, self.dtype = T, np.dtype(dtype)
        N = g.num_nonterminals
        rule_NxNxN = g.binary > 0
        feas_TxN = np.zeros((T + 1, N), bool)
        feas_TxN[1] = g.emit.sum(1) > 0
        for w in range(2, T + 1):
            for d in range(1, w):
                ok_NxN = feas_TxN[d][:, None] & feas_TxN[w - d][None, :]
                feas_TxN[w] |= np.any(rule_NxNxN & ok_NxN[None], axis=(1, 2))
        self.feasible = feas_TxN
        self.widths: dict[int, _Width] = {}
        consts = {"G": {}}
        for w in range(2, T + 1):
            parents = np.flatnonzero(feas_TxN[w])
            if parents.size == 0:
                continue
            used_NxN = np.any(rule_NxNxN[parents], axis=0)
            split_DxNxN = np.stack([used_NxN & feas_TxN[d][:, None] & feas_TxN[w - d][None, :]
                                    for d in range(1, w)])  # pairs usable at split d = 1..w-1
            splits = np.flatnonzero(split_DxNxN.any((1, 2))) + 1
            pairs_NxN = split_DxNxN.any(0)
            blocks, cols = [], []
            for B_set, C_set in _merge_small(_components(pairs_NxN)):
                l0, l1, r0, r1 = B_set.min(), B_set.max() + 1, C_set.min(), C_set.max() + 1
                own_NxN = np.zeros((N, N), bool)  # each rule counted in exactly one block
                own_NxN[np.ix_(B_set, C_set)] = pairs_NxN[np.ix_(B_set, C_set)]
                d_used = np.flatnonzero((split_DxNxN & own_NxN).any((1, 2))) + 1
                G_NxLxR = np.where(own_NxN[None, l0:l1, r0:r1], g.binary[:, l0:l1, r0:r1], 0.0)
                G_NxLxR[~feas_TxN[w]] = 0.0
                blocks.append(_Block(int(l0), int(l1), int(r0), int(r1), int(d_used.min()), int(d_used.max())))
                cols.append(G_NxLxR.reshape(N, -1).T)
            self.widths[w] = _Width(int(splits.min()), int(splits.max()), blocks)
            consts["G"][w] = jnp.asarray(np.concatenate(cols, 0), dtype)  # [sum of block sizes, N]
        self.N, self.V = N, g.vocab_size
        self.leaf_total = g.emit.sum(1)
        consts["root"] = jnp.asarray(g.root, dtype)
        emit_ext = np.concatenate([g.emit.T, np.zeros((1, N)), g.emit.sum(1)[None]], 0)  # words, pad, mask
        consts["emit_ext"] = jnp.asarray(emit_ext, dtype)
        consts["emit"] = jnp.asarray(g.emit, dtype)  # [N, V]
        consts["leaf_total"] = jnp.asarray(self.leaf_total, dtype)
        self.consts = consts


def _merge_small(groups: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Merge blocks while the merged bounding box costs little more than the parts (fewer ops to compile)."""
    area = lambda b, c: (b.max() - b.min() + 1) * (c.max() - c.min() + 1)  # noqa: E731
    groups = sorted(groups, key=lambda g: (g[0].min(), g[1].min()))
    merged = True
    while merged and len(groups) > 1:
        merged = False
        for x in range(len(groups)):
            for y in range(x + 1, len(groups)):
                b, c = np.union1d(groups[x][0], groups[y][0]), np.union1d(groups[x][1], groups[y][1])
                if area(b, c) <= 1.5 * (area(*groups[x]) + area(*groups[y])) + 16:
                    groups[x] = (b, c)
                    del groups[y]
                    merged = True
                    break
            if merged:
                break
    return groups


def _components(pairs_NxN: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Connected components (left set, right set) of the bipartite graph with an edge B - C per pair."""
    N = pairs_NxN.shape[0]
    parent = list(range(2 * N))  # union-find over left nodes 0..N-1 and right nodes N..2N-1

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for B, C in zip(*np.nonzero(pairs_NxN)):
        parent[find(int(B))] = find(int(C) + N)
    groups: dict[int, tuple[list, list]] = {}
    for B in np.flatnonzero(pairs_NxN.any(1)):
        groups.setdefault(find(int(B)), ([], []))[0].append(B)
    for C in np.flatnonzero(pairs_NxN.any(0)):
        groups.setdefault(find(int(C) + N), ([], []))[1].append(C)
    return [(np.asarray(b), np.asarray(c)) for b, c in groups.values()]


def _tree(op, xs: list):
    """op-reduce a list of equal-shape arrays pairwise; XLA fuses it into one elementwise loop."""
    while len(xs) > 1:
        xs = [op(xs[i], xs[i + 1]) if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


_TREE_TERMS = 16  # contractions over at most this many terms are unrolled; longer ones use dot_general


def _normalise(new_IxBxN):
    """Divide each span's vector by its max (an all-zero span keeps scale 1). Returns (scaled, scale [I, B])."""
    s_IxB = jax.lax.stop_gradient(new_IxBxN.max(-1))
    s_IxB = jnp.where(s_IxB > 0, s_IxB, 1)
    return new_IxBxN / s_IxB[..., None], s_IxB


def _read(x, start: tuple[int, ...], size: tuple[int, ...]):
    return jax.lax.slice(x, start, tuple(a + b for a, b in zip(start, size)))


def _add(x, start: tuple[int, ...], y):
    """x with y added into the box at `start` (in place under XLA)."""
    return jax.lax.dynamic_update_slice(x, _read(x, start, y.shape) + y, start)


def _dot(a, b):
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


_NEG = -1e30  # log scale of widths no nonterminal can span: their split weight exp(_NEG - top) is 0


class _Chart:
    """The scaled inside chart of a batch, plus the outside pass written by hand.

    by_start[i, b, w-1] and by_end[j-1, b, w-1] both hold span [i, j = i + w) of sentence b as [N + 1]:
    beta' [N] and, last, the log scale: inside = beta' * exp(log scale + the span's leaf log scales).
    Children of span [i, i+w) at split d: left [i, i+d) = by_start[i, :, d-1], right [i+d, i+w) =
    by_end[i+w-1, :, w-d-1], so all starts i and splits d0..d1 of one width are two rectangular slices
    [I, B, D, N + 1], batch dims leading.
    """

    def __init__(self, plan: _Plan, consts, leaf_TxBxN):
        T, B, N = leaf_TxBxN.shape
        dtype = leaf_TxBxN.dtype
        self.plan, self.consts, self.T, self.B, self.N = plan, consts, T, B, N
        beta_TxBxN, s_TxB = _normalise(leaf_TxBxN)
        self.scale = {1: s_TxB}  # per width: the normaliser [I, B] of each span
        # Leaves start at log scale 0 and their own scales are kept apart (inside = beta' * exp(chart log
        # scale + sum of the span's leaf log scales)): the chart's log scales then stay small, so float32
        # resolves the split weights exp(lsum - top) to ~1e-7 even in long sentences.
        self.leaf_log_TxB = jnp.log(s_TxB)
        leaf_TxBx1xN1 = jnp.concatenate([beta_TxBxN, jnp.zeros((T, B, 1), dtype)], -1)[:, :, None]
        empty = jnp.concatenate([jnp.zeros((T, B, T - 1, N), dtype), jnp.full((T, B, T - 1, 1), _NEG, dtype)], -1)
        # Two different expressions, so that XLA does not merge them and then copy to update both in place.
        self.by_start = jnp.concatenate([leaf_TxBx1xN1, empty], 2)
        self.by_end = jnp.concatenate([empty, leaf_TxBx1xN1], 2)[:, :, ::-1]
        for w in range(2, T + 1):
            self._width(w)

    def children(self, w: int, spec: _Width):
        """left * f, right [I, B, D, N] (beta') for splits d0..d1, split weights f [I, B, D], and their max
        log scale top [I, B]. (The outside pass reads them again from the final chart: keeping the forward
        slices alive would make XLA copy the whole chart at every later in-place update.)"""
        I, D, B, N = self.T - w + 1, spec.d1 - spec.d0 + 1, self.B, self.N
        left = _read(self.by_start, (0, 0, spec.d0 - 1, 0), (I, B, D, N + 1))
        right = jax.lax.rev(_read(self.by_end, (w - 1, 0, w - spec.d1 - 1, 0), (I, B, D, N + 1)), (2,))
        lsum_IxBxD = left[..., N] + right[..., N]
        top_IxB = lsum_IxBxD.max(-1)
        f_IxBxD = jnp.exp(lsum_IxBxD - top_IxB[..., None])
        # Materialise the two operands contiguously: the outer products below read each many times.
        left, right = jax.lax.optimization_barrier((left[..., :N] * f_IxBxD[..., None], right[..., :N]))
        return left, right, f_IxBxD, top_IxB

    def _width(self, w: int) -> None:
        spec = self.plan.widths.get(w)
        if spec is None:  # no nonterminal spans w words: the zeros (and _NEG log scales) stay
            self.scale[w] = jnp.ones((self.T - w + 1, self.B), self.by_start.dtype)
            return
        I, B, N = self.T - w + 1, self.B, self.N
        left, right, _, top_IxB = self.children(w, spec)
        pairs = []
        for k in spec.blocks:
            outer_IxBxLxR = _tree(jnp.add, [left[:, :, d - spec.d0, k.l0:k.l1, None]
                                            * right[:, :, d - spec.d0, None, k.r0:k.r1]
                                            for d in range(k.d0, k.d1 + 1)])
            pairs.append(outer_IxBxLxR.reshape(I * B, -1))
        pairs_IBxP = pairs[0] if len(pairs) == 1 else jnp.concatenate(pairs, -1)
        new_IxBxN = _dot(pairs_IBxP, self.consts["G"][w]).reshape(I, B, N)
        beta_IxBxN, s_IxB = _normalise(new_IxBxN)
        self.scale[w] = s_IxB
        new_IxBx1xN1 = jnp.concatenate([beta_IxBxN, (top_IxB + jnp.log(s_IxB))[..., None]], -1)[:, :, None]
        self.by_start = jax.lax.dynamic_update_slice(self.by_start, new_IxBx1xN1, (0, 0, w - 1, 0))
        self.by_end = jax.lax.dynamic_update_slice(self.by_end, new_IxBx1xN1, (w - 1, 0, w - 1, 0))

    def prefixes(self):
        """beta' [B, T, N] and log scale [B, T] of the prefix spans [0, k), k = 1..T."""
        return self.by_start[0, :, :, : self.N], self.by_start[0, :, :, self.N]

    def width(self, w: int):
        """beta' [I, B, N] of all spans of width w."""
        return self.by_start[: self.T - w + 1, :, w - 1, : self.N]

    def root_value(self, lengths_B):
        """z [B] (scaled) and log scale [B] with P(x) = z exp(scale + sum of leaf log scales), and the
        one-hot sel [B, T] of length - 1."""
        prefix_BxTxN, log_BxT = self.prefixes()
        sel_BxT = jax.nn.one_hot(lengths_B - 1, self.T, dtype=prefix_BxTxN.dtype)
        z_BxT = _dot(prefix_BxTxN, self.consts["root"])
        return (z_BxT * sel_BxT).sum(-1), (log_BxT * sel_BxT).sum(-1), sel_BxT

    def outside(self, sel_BxT, on_width=None):
        """The outside pass: d z / d beta' for every span, widths T..1 (z = the scaled root value).

        Returns d z / d leaf [T, B, N]; `on_width(w, adj [I, B, N])` sees each width's adjoint.
        """
        T, B, N = self.T, self.B, self.N
        dtype = self.by_start.dtype
        adj_start = jnp.zeros((T, B, T, N), dtype)  # contributions as a left child, by start
        adj_end = jnp.zeros((T + 1, B, T, N), dtype)[1:]  # as a right child, by end (kept apart from the above)
        for w in range(T, 0, -1):
            I = T - w + 1
            adj_IxBxN = adj_start[:I, :, w - 1] + adj_end[w - 1:, :, w - 1]
            adj_IxBxN = adj_IxBxN.at[0].add(sel_BxT[:, w - 1, None] * self.consts["root"])
            if on_width is not None:
                on_width(w, adj_IxBxN)
            if w == 1:
                return adj_IxBxN / self.scale[1][..., None]
            spec = self.plan.widths.get(w)
            if spec is None:
                continue
            h_IxBxP = _dot(adj_IxBxN / self.scale[w][..., None], self.consts["G"][w].T)
            left, right, f_IxBxD, _ = self.children(w, spec)
            p = 0
            for k in spec.blocks:
                L, R, a, b = k.l1 - k.l0, k.r1 - k.r0, k.d0 - spec.d0, k.d1 - spec.d0 + 1
                h_IxBxLxR = h_IxBxP[..., p: p + L * R].reshape(I, B, L, R)
                p += L * R
                rk, lk = right[:, :, a:b, k.r0:k.r1], left[:, :, a:b, k.l0:k.l1]
                if R <= _TREE_TERMS:  # d z / d left[l] = sum_r h[l, r] right[r]
                    h_IxBxRxL = jnp.swapaxes(h_IxBxLxR, 2, 3)
                    gl = _tree(jnp.add, [h_IxBxRxL[:, :, None, r] * rk[..., r, None] for r in range(R)])
                else:
                    gl = jnp.einsum("ibdr,iblr->ibdl", rk, h_IxBxLxR, precision=jax.lax.Precision.HIGHEST)
                if L <= _TREE_TERMS:  # d z / d right[r] = sum_l h[l, r] left[l]
                    gr = _tree(jnp.add, [h_IxBxLxR[:, :, None, l] * lk[..., l, None] for l in range(L)])
                else:
                    gr = jnp.einsum("ibdl,iblr->ibdr", lk, h_IxBxLxR, precision=jax.lax.Precision.HIGHEST)
                adj_start = _add(adj_start, (0, 0, spec.d0 - 1 + a, k.l0), gl * f_IxBxD[:, :, a:b, None])
                adj_end = _add(adj_end, (w - 1, 0, w - spec.d0 - b, k.r0), jax.lax.rev(gr, (2,)))
        raise AssertionError("unreachable")


def _leaves(consts, tokens_BxT):
    return consts["emit_ext"][tokens_BxT.T]  # [T, B, N]


def _kernel_forward(plan: _Plan, consts, tokens_BxT, lengths_B):
    chart = _Chart(plan, consts, _leaves(consts, tokens_BxT))
    z_B, log_B, _ = chart.root_value(lengths_B)
    prefix_BxTxN, prefix_log_BxT = chart.prefixes()
    return {"z": z_B, "log_scale": log_B, "prefix": prefix_BxTxN, "prefix_log_scale": prefix_log_BxT,
            "leaf_log_scale": chart.leaf_log_TxB.T}


def _kernel_conditionals(plan: _Plan, consts, tokens_BxT, lengths_B):
    chart = _Chart(plan, consts, _leaves(consts, tokens_BxT))
    _, _, sel_BxT = chart.root_value(lengths_B)
    # The chart is linear in each leaf: (d z / d leaf[t]) . emit[:, w] = P(x_-t, x_t = w) * (a per-sentence
    # constant, the inverse of all the chart's scales), which the normalisation over w removes.
    g_TxBxN = chart.outside(sel_BxT)
    T = tokens_BxT.shape[1]
    joint_BxTxV = _dot(jnp.swapaxes(g_TxBxN, 0, 1), consts["emit"])
    total_BxT = joint_BxTxV.sum(-1)
    valid_BxT = (total_BxT > 0) & (jnp.arange(T)[None, :] < lengths_B[:, None])
    q_BxTxV = joint_BxTxV / jnp.where(valid_BxT, total_BxT, 1)[..., None]
    return {"q": jnp.where(valid_BxT[..., None], jnp.maximum(q_BxTxV, 0), 0)}


def _kernel_posteriors(plan: _Plan, consts, tokens_BxT, lengths_B):
    chart = _Chart(plan, consts, _leaves(consts, tokens_BxT))
    z_B, _, sel_BxT = chart.root_value(lengths_B)
    T = chart.T
    post = {}

    def on_width(w, adj_IxBxN):  # P(A spans [i, i+w) | x) = beta' * (d z / d beta') / z
        post[w] = jnp.pad(chart.width(w) * adj_IxBxN / z_B[:, None], ((0, w - 1), (0, 0), (0, 0)))

    chart.outside(sel_BxT, on_width)
    post_TxTxBxN = jnp.stack([post[w] for w in range(1, T + 1)])  # [width - 1, start, B, N]
    return {"post": jnp.transpose(post_TxTxBxN, (2, 1, 0, 3))}  # [B, T (start), T (width - 1), N]


def _kernel_lengths(plan: _Plan, consts, leaf_BxTxN):
    chart = _Chart(plan, consts, jnp.swapaxes(leaf_BxTxN, 0, 1))
    prefix_BxTxN, log_BxT = chart.prefixes()
    return prefix_BxTxN @ consts["root"], log_BxT, chart.leaf_log_TxB.T


_KERNELS = {
    "forward": _kernel_forward, "conditionals": _kernel_conditionals,
    "posteriors": _kernel_posteriors, "lengths": _kernel_lengths,
}


# ----------------------------------------------------------------------------------------------------------
# Random grammars
# ----------------------------------------------------------------------------------------------------------


def random_grammar(seed: int, *, num_roots: int = 9, levels: int = 4, symbols_per_level: int = 10,
                   num_words: int = 200, rules_per_symbol: int = 20, leaf_rules: int = 100,
                   middle_words: int = 1, emit_prob: tuple[float, float] = (0.04, 0.32),
                   max_length: int | None = None, **kwargs) -> PCFG:
    """A fresh grammar of the released shape (defaults match `pcfg_rule_deep_mlm.txt`'s statistics).

    Root children S1..S{num_roots} (root probabilities: uniform weights, normalised), each with one rule
    Sk -> A1_i A1_j (distinct pairs); `levels` layers of `symbols_per_level` symbols A{l}_i. A symbol of a
    non-final layer emits `middle_words` words of its own (distinct words, uniform weights) with total
    probability ~ U(emit_prob) and otherwise branches into `rules_per_symbol` pairs drawn with replacement
    from the next layer (uniform weights, duplicates summed); a final-layer symbol emits `leaf_rules` words
    drawn with replacement (uniform weights), and every word is given to some final symbol. Defaults: 49
    nonterminals (50 with the start symbol S of the rules file), 200 words, depth 6, sentences of 2..16
    words (mean ~10.7; the released file's is 10.66).
    `kwargs` go to `PCFG` (max_length, batch_size, bucket_lengths).
    """
    rng = np.random.default_rng(seed)
    K, L, M, V = num_roots, levels, symbols_per_level, num_words
    if min(K, L, M, V, rules_per_symbol, leaf_rules, middle_words) < 1 or K > M * M or (L - 1) * M * middle_words > V:
        raise ValueError("random_grammar needs positive sizes, num_roots <= symbols_per_level**2 and "
                         "(levels - 1) * symbols_per_level * middle_words <= num_words")
    N = K + L * M
    names = [f"S{k + 1}" for k in range(K)] + [f"A{l + 1}_{i}" for l in range(L) for i in range(M)]
    level = lambda l: K + l * M + np.arange(M)  # noqa: E731
    root = rng.uniform(size=K)
    root_N = np.zeros(N)
    root_N[:K] = root / root.sum()
    binary = np.zeros((N, N, N))
    emit = np.zeros((N, V))
    first = level(0)
    for k, p in enumerate(rng.choice(M * M, size=K, replace=False)):
        binary[k, first[p // M], first[p % M]] = 1.0
    own_words = rng.choice(V, size=((L - 1) * M, middle_words), replace=False)
    for l in range(L - 1):
        nxt = level(l + 1)
        for i, A in enumerate(level(l)):
            e = rng.uniform(*emit_prob)
            u = rng.uniform(size=middle_words) if middle_words > 1 else np.ones(1)
            emit[A, own_words[l * M + i]] = e * u / u.sum()
            B = rng.integers(M, size=rules_per_symbol)
            C = rng.integers(M, size=rules_per_symbol)
            wts = rng.uniform(size=rules_per_symbol)
            np.add.at(binary[A], (nxt[B], nxt[C]), (1 - e) * wts / wts.sum())
    last = level(L - 1)
    for A in last:
        w = rng.integers(V, size=leaf_rules)
        np.add.at(emit[A], w, rng.uniform(size=leaf_rules))
    for w in np.flatnonzero(emit[last].sum(0) == 0):
        emit[rng.choice(last), w] = rng.uniform()
    emit[last] /= emit[last].sum(1, keepdims=True)
    words = [f"w{i:0{len(str(V - 1))}d}" for i in range(V)]
    return PCFG(root_N, binary, emit, names, words, max_length=max_length, **kwargs)


def dense_grammar(seed: int, num_nonterminals: int = 50, num_words: int = 200, emit_prob: float = 0.5,
                  max_length: int = 32, **kwargs) -> PCFG:
    """Every rule A -> B C and A -> w has positive probability (uniform weights); recursive, so capped."""
    rng = np.random.default_rng(seed)
    N, V = num_nonterminals, num_words
    binary = rng.uniform(size=(N, N, N))
    emit = rng.uniform(size=(N, V))
    binary *= (1 - emit_prob) / binary.reshape(N, -1).sum(1)[:, None, None]
    emit *= emit_prob / emit.sum(1, keepdims=True)
    root = rng.uniform(size=N)
    return PCFG(root / root.sum(), binary, emit, max_length=max_length, **kwargs)


__all__ = ["PCFG", "TASKS", "dense_grammar", "random_grammar"]
