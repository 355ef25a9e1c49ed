"""The static plan of a PCFG chart of T words (numpy only; built once per chart size and dtype).

A nonterminal is *feasible* at width w if it can derive some w-word string. For each width the plan keeps
the splits that matter and the rules whose children can span complementary widths, grouped into blocks of
child pairs (B, C) read by slicing; `Plan.consts` holds the rule weights of each block and the root, emission
and leaf tables as JAX arrays, the constants the kernels of `flatlm.languages.pcfg.chart` multiply by.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Width:
    """Static plan for spans of width w: the splits that matter and the child blocks they combine."""

    d0: int  # left-child widths d0..d1 cover every split with a usable rule
    d1: int
    blocks: list[Block]


@dataclasses.dataclass
class Block:
    """Rules A -> B C with B in [l0, l1), C in [r0, r1), usable at left-child widths d0..d1."""

    l0: int
    l1: int
    r0: int
    r1: int
    d0: int
    d1: int
    n0: int  # parents n0..n1-1 hold every rule of the block (its rows of G outside them are zero)
    n1: int


class Plan:
    """Everything static about a chart of T words.

    A nonterminal is *feasible* at width w if it can derive some w-word string. For each width the rules
    whose children can span complementary widths are grouped into blocks (connected components of the
    left-child/right-child graph, each widened to contiguous index ranges so that it is read by slicing):
    a layered grammar gets one small dense block per layer, a dense grammar one N x N block.
    Takes the grammar's arrays `root[N]`, `binary[N, N, N]`, `emit[N, V]` (see `PCFG`).

    Widths whose rule tables are equal share one array in `consts` (every width >= 2 of a dense grammar): the
    kernels then read one table from cache instead of a new one per width. The dense N=50 grammar's chart of 32
    words holds 1.1 MB of tables instead of 35 MB, and its conditionals at a batch of 4 ran ~6 % faster (one
    process, alternating, 2-core AMD EPYC: 14.3 -> 13.5 ms and 16.6 -> 15.7 ms; at a batch of 16 ~1 %).
    """

    def __init__(self, root_N, binary_NNN, emit_NV, T: int, dtype):
        self.T, self.dtype = T, np.dtype(dtype)
        N = int(root_N.size)
        rule_NNN = binary_NNN > 0
        feas_TN = np.zeros((T + 1, N), bool)
        feas_TN[1] = emit_NV.sum(1) > 0
        for w in range(2, T + 1):
            for d in range(1, w):
                ok_NN = feas_TN[d][:, None] & feas_TN[w - d][None, :]
                feas_TN[w] |= np.any(rule_NNN & ok_NN[None], axis=(1, 2))
        self.feasible = feas_TN
        self.widths: dict[int, Width] = {}
        consts = {"G": {}, "G_in": {}}
        # The inside pass's product pairs [M, P] x G [P, N] runs faster with N padded by zero columns to a multiple
        # of 16 (XLA:CPU's GEMM tiles): [256, 2500] x [2500, 50] took 0.38-0.59 ms, x [2500, 64] 0.26-0.39 ms.
        N_in = -(-N // 16) * 16 if N > 16 else N
        tables: dict = {}  # (shape, digest) of a width's rule table -> its (G, G_in) arrays
        for w in range(2, T + 1):
            parents = np.flatnonzero(feas_TN[w])
            if parents.size == 0:
                continue
            used_NN = np.any(rule_NNN[parents], axis=0)
            split_DNN = np.stack([used_NN & feas_TN[d][:, None] & feas_TN[w - d][None, :]
                                  for d in range(1, w)])  # pairs usable at split d = 1..w-1
            splits = np.flatnonzero(split_DNN.any((1, 2))) + 1
            pairs_NN = split_DNN.any(0)
            blocks, cols = [], []
            for B_set, C_set in _merge_small(_components(pairs_NN)):
                l0, l1, r0, r1 = B_set.min(), B_set.max() + 1, C_set.min(), C_set.max() + 1
                own_NN = np.zeros((N, N), bool)  # each rule counted in exactly one block
                own_NN[np.ix_(B_set, C_set)] = pairs_NN[np.ix_(B_set, C_set)]
                d_used = np.flatnonzero((split_DNN & own_NN).any((1, 2))) + 1
                G_NLR = np.where(own_NN[None, l0:l1, r0:r1], binary_NNN[:, l0:l1, r0:r1], 0.0)
                G_NLR[~feas_TN[w]] = 0.0
                parents = np.flatnonzero(G_NLR.any((1, 2)))  # sorted; never empty (a block holds used rules)
                blocks.append(Block(int(l0), int(l1), int(r0), int(r1), int(d_used.min()), int(d_used.max()),
                                    int(parents[0]), int(parents[-1]) + 1))
                cols.append(G_NLR.reshape(N, -1).T)
            self.widths[w] = Width(int(splits.min()), int(splits.max()), blocks)
            G_PN = np.concatenate(cols, 0)  # [P = sum of block sizes, N]
            key = (G_PN.shape, hashlib.blake2b(G_PN.tobytes()).digest())
            if key not in tables:  # widths with the same rule table share one array (see the class docstring)
                tables[key] = (jnp.asarray(G_PN, dtype),  # the outside pass's (contracted over N: no padding)
                               jnp.asarray(np.pad(G_PN, ((0, 0), (0, N_in - N))), dtype))  # [P, N_in]
            consts["G"][w], consts["G_in"][w] = tables[key]
        self.N, self.V = N, int(emit_NV.shape[1])
        self.leaf_total = emit_NV.sum(1)
        consts["root"] = jnp.asarray(root_N, dtype)
        emit_ext = np.concatenate([emit_NV.T, np.zeros((1, N)), emit_NV.sum(1)[None]], 0)  # words, pad, mask
        consts["emit_ext"] = jnp.asarray(emit_ext, dtype)
        consts["emit"] = jnp.asarray(emit_NV, dtype)  # [N, V]
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


def _components(pairs_NN: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Connected components (left set, right set) of the bipartite graph with an edge B - C per pair."""
    N = pairs_NN.shape[0]
    parent = list(range(2 * N))  # union-find over left nodes 0..N-1 and right nodes N..2N-1

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for B, C in zip(*np.nonzero(pairs_NN)):
        parent[find(int(B))] = find(int(C) + N)
    groups: dict[int, tuple[list, list]] = {}
    for B in np.flatnonzero(pairs_NN.any(1)):
        groups.setdefault(find(int(B)), ([], []))[0].append(B)
    for C in np.flatnonzero(pairs_NN.any(0)):
        groups.setdefault(find(int(C) + N), ([], []))[1].append(C)
    return [(np.asarray(b), np.asarray(c)) for b, c in groups.values()]
