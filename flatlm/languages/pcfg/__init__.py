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

Modules, in import order: `plan` (static chart plan), `chart` (inside/outside kernels), `engine` (compile
cache, length buckets, chunked runs), `rules_file`, `sample`, `tasks` (labels A/B/C), `grammar` (`PCFG`),
`random` (`random_grammar`, `dense_grammar`).
"""

from flatlm.languages.pcfg.grammar import PCFG
from flatlm.languages.pcfg.random import dense_grammar, random_grammar
from flatlm.languages.pcfg.tasks import DEFINITIONS, TASK_PREFIX, TASKS

__all__ = ["DEFINITIONS", "PCFG", "TASKS", "TASK_PREFIX", "dense_grammar", "random_grammar"]
