"""What tests/test_pcfg.py and tests/test_pcfg_grammar.py share: the grammars of their `dense` and `layered` fixtures,
and the independent references, float64 recursions over parse trees, one sentence at a time in numpy (no chart, no
JAX)."""

import functools

import numpy as np

from flatlm.languages.pcfg import PCFG, dense_grammar, random_grammar


def dense_pcfg() -> PCFG:
    """The `dense` fixture: N=3, V=4, every rule positive: every string is a sentence (recursive, capped at 6 words)."""
    return dense_grammar(0, num_nonterminals=3, num_words=4, emit_prob=0.4, max_length=6, batch_size=16,
                         bucket_lengths=False)


def layered_pcfg() -> PCFG:
    """The `layered` fixture: the released shape in miniature. S1..S3 -> A1 A1, three layers of 3 symbols, 8 words,
    sentences of 2..8 words, and many exact zeros (each middle symbol emits a single word). Batches of 16 sentences
    at the full width, so that every test reuses the same few compiled kernels."""
    return random_grammar(1, num_roots=3, levels=3, symbols_per_level=3, num_words=8, rules_per_symbol=4,
                          leaf_rules=4, batch_size=16, bucket_lengths=False)


def ref_inside(g: PCFG, words) -> dict:
    """inside[(i, j)][A] = P(A =>* words[i:j]) as the sum over all parse trees (word None: any word)."""

    @functools.cache
    def inside(i: int, j: int) -> np.ndarray:
        if j == i + 1:
            return g.emit.sum(1) if words[i] is None else g.emit[:, words[i]].copy()
        total = np.zeros(g.num_nonterminals)
        for k in range(i + 1, j):
            total += np.einsum("abc,b,c->a", g.binary, inside(i, k), inside(k, j))
        return total

    return {(i, j): inside(i, j) for i in range(len(words)) for j in range(i + 1, len(words) + 1)}


def ref_prob(g: PCFG, words) -> float:
    return float(g.root @ ref_inside(g, words)[(0, len(words))]) if len(words) else 0.0


def ref_conditionals(g: PCFG, words) -> np.ndarray:
    """[L, V]: P(x_t = w | x_-t) from P(x)-ratios over the V candidate words (zeros if all are 0)."""
    out = np.zeros((len(words), g.vocab_size))
    for t in range(len(words)):
        p = np.array([ref_prob(g, [*words[:t], w, *words[t + 1:]]) for w in range(g.vocab_size)])
        out[t] = p / p.sum() if p.sum() > 0 else 0.0
    return out


def ref_span_joint(g: PCFG, words, A: int, i0: int, j0: int) -> float:
    """P(x, some tree has node A over [i0, j0)): an inside pass restricted to trees containing that node."""
    inside = ref_inside(g, words)
    n = len(words)

    @functools.cache
    def constrained(i: int, j: int) -> np.ndarray:
        if (i, j) == (i0, j0):
            return np.eye(g.num_nonterminals)[A] * inside[(i, j)][A]
        if not (i <= i0 and j0 <= j) or j - i <= j0 - i0:
            return np.zeros(g.num_nonterminals)
        total = np.zeros(g.num_nonterminals)
        for k in range(i + 1, j):  # the node sits in exactly one of the two subtrees
            if k <= i0:
                total += np.einsum("abc,b,c->a", g.binary, inside[(i, k)], constrained(k, j))
            elif k >= j0:
                total += np.einsum("abc,b,c->a", g.binary, constrained(i, k), inside[(k, j)])
        return total

    return float(g.root @ constrained(0, n))


def ref_length_distribution(g: PCFG, L: int) -> np.ndarray:
    """P(length = l), l = 0..L, by the all-ones-leaf inside recursion in numpy."""
    beta = {1: g.emit.sum(1)}
    for w in range(2, L + 1):
        beta[w] = sum(np.einsum("abc,b,c->a", g.binary, beta[d], beta[w - d]) for d in range(1, w))
    return np.array([0.0] + [g.root @ beta[w] for w in range(1, L + 1)])


def sentences_of(tokens, lengths, V):
    return [[int(w) if w < V else None for w in tokens[b, :n]] for b, n in enumerate(lengths)]


def garbage_padded(rng, tokens, lengths, V):
    """Random word ids or pad beyond each length: inference must ignore them."""
    garbage = rng.integers(0, V + 1, size=tokens.shape)
    return np.where(np.arange(tokens.shape[1]) < lengths[:, None], tokens, garbage).astype(np.int32)
