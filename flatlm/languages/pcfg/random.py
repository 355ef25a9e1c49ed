"""Random grammars: `random_grammar`, of the released grammar's layered shape (Appendix A.1: 50 symbols,
200 words, depth <= 6), and `dense_grammar`, where every rule has positive probability (a recursive worst
case for the chart's cost, used by tests and benchmarks).
"""

from __future__ import annotations

import numpy as np

from flatlm.languages.pcfg.grammar import PCFG


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
    """Every rule A -> B C and A -> w has positive probability (uniform weights); recursive, so capped.

    Inference chunks default to 16 sentences (`batch_size`): a dense chart is T^2 N floats a sentence (200 kB
    at N=50, T=32), so small chunks stay in cache, while the inside pass's split sums (batched dots since its
    50-symbol blocks go through dot_general) want rows. Conditionals at T=32, B256 on 2 cores, one process,
    chunks timed round-robin: 16 -> 310 sentences/s, 12 -> 296, 8 -> 282, 24 and 32 slower (the sparse grammars'
    64 gave 183 with the older elementwise split sums)."""
    kwargs.setdefault("batch_size", 16)
    rng = np.random.default_rng(seed)
    N, V = num_nonterminals, num_words
    binary = rng.uniform(size=(N, N, N))
    emit = rng.uniform(size=(N, V))
    binary *= (1 - emit_prob) / binary.reshape(N, -1).sum(1)[:, None, None]
    emit *= emit_prob / emit.sum(1, keepdims=True)
    root = rng.uniform(size=N)
    return PCFG(root / root.sum(), binary, emit, max_length=max_length, **kwargs)
