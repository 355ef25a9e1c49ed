"""The released rules format of Liu et al. 2023 (`pcfg_rule_deep_mlm.txt`, Section 3.2 / Appendix A.1): one rule
per line, `LHS RHS1 [RHS2] PROB`; the first line's LHS is the start symbol, whose unary rules `S -> Sk` become
`root`. `read_rules` parses a file into the arrays `PCFG` takes, `write_rules` writes them back.
"""

from __future__ import annotations

import math
import os

import numpy as np

from flatlm.errors import UserError


def read_rules(path, sort_words: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], list[str]]:
    """Read the released `LHS RHS1 [RHS2] PROB` format: (root[N], binary[N, N, N], emit[N, V], nonterminals, words).

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
    binary_NNN = np.zeros((N, N, N))
    emit_NV = np.zeros((N, V))
    for _, lhs, rhs, prob in entries:
        if fold and lhs == start:
            root_N[nt_index[rhs[0]]] += prob
        elif len(rhs) == 2:
            binary_NNN[nt_index[lhs], nt_index[rhs[0]], nt_index[rhs[1]]] += prob
        else:
            emit_NV[nt_index[lhs], w_index[rhs[0]]] += prob
    if not fold:
        root_N[nt_index[start]] = 1.0
    total_N = binary_NNN.reshape(N, -1).sum(1) + emit_NV.sum(1)
    for A in range(N):
        if total_N[A] <= 0:
            raise UserError(f"{path}: the rules of {nonterminals[A]!r} have total probability 0")
    if root_N.sum() <= 0:
        raise UserError(f"{path}: the start symbol's rules have total probability 0")
    binary_NNN /= total_N[:, None, None]
    emit_NV /= total_N[:, None]
    return root_N / root_N.sum(), binary_NNN, emit_NV, nonterminals, words


def write_rules(path, root_N, binary_NNN, emit_NV, nonterminals: list[str], words: list[str]) -> None:
    """Write the released format: `S A p` root lines, then `A B C p` and `A w p` (exact float repr).

    The start symbol is named S (with `_` appended while it clashes with a symbol). Raises ValueError for
    names that would not read back: empty, with white space, starting with `#`, or a word with a
    nonterminal's name.
    """
    names = set(nonterminals) | set(words)
    for s in names:
        if not s or any(c.isspace() for c in s) or s.startswith("#"):
            raise ValueError(f"symbol name {s!r} cannot be written to a rules file")
    if set(nonterminals) & set(words):
        raise ValueError("a word has the same name as a nonterminal; rename before writing")
    start = "S"
    while start in names:
        start += "_"
    lines = [f"{start} {nonterminals[A]} {float(root_N[A])!r}" for A in np.flatnonzero(root_N)]
    for A, name in enumerate(nonterminals):
        for B, C in zip(*np.nonzero(binary_NNN[A])):
            lines.append(f"{name} {nonterminals[B]} {nonterminals[C]} {float(binary_NNN[A, B, C])!r}")
        for w in np.flatnonzero(emit_NV[A]):
            lines.append(f"{name} {words[w]} {float(emit_NV[A, w])!r}")
    with open(os.fspath(path), "w") as f:
        f.write("\n".join(lines) + "\n")
