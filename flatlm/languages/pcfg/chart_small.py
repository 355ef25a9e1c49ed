"""The scaled inside chart and its outside pass with the batch as the minor axis, for grammars of small blocks.

`flatlm.languages.pcfg.chart.Chart` keeps each span's nonterminals minor ([..., B, N]): right for the dense grammars,
whose blocks are batched matmuls over N x N child pairs. A grammar of small blocks (the released shape: layers of
9-10 symbols) spends its time instead in elementwise outer products whose minor axis there is a block's 9-10
symbols. Here the starts and sentences of one width are minor ([..., I, B], flattened to M = I * B columns), so each
product and sum runs over long contiguous rows, and a rule contraction is a plain [N, P] x [P, M] matmul. The outside
pass multiplies each block by its own parents only (`Block.n0`..`n1`: a layered grammar's block feeds the ~10
symbols of the layer above, a fifth of the 49 rows); doing the same in the inside pass ran ~13 % faster and took
~40 % longer to compile (a matmul and a fusion more per block), so the inside keeps one matmul per width.

Same maths as `Chart` (see its docstring for the scaling and the mass flag); only the memory order and the parent
rows differ. Speed: benchmarks/RESULTS.md (2026-11-29, afternoon).

Shape letters: as in `chart`, plus E = N + 2 (beta', log scale, mass flag), W a width index (width - 1), M = I * B.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flatlm.languages.base import exact_dot
from flatlm.languages.pcfg.chart import _MAX_UP, _NEG, ChartBase, _add, _read, _sum_slices
from flatlm.languages.pcfg.plan import Plan, Width


def _normalise(new_NM):
    """Divide each column by its max (an all-zero column keeps scale 1): (scaled, scale [M], mass [M])."""
    s_M = jax.lax.stop_gradient(new_NM.max(0))
    mass_M = (s_M > 0).astype(new_NM.dtype)
    s_M = jnp.where(s_M > 0, s_M, 1)
    return new_NM / s_M, s_M, mass_M


class SmallBlockChart(ChartBase):
    """The inside chart of a batch, batch minor: by_start[W, E, i, b] holds span [i, i + W + 1) of sentence b and
    by_end[W, E, j - 1, b] span [j - W - 1, j), each as beta' [N], its log scale and its mass flag (`Chart`).

    The interface (`prefixes`, `width`, `root_value` from `ChartBase`, `outside`, `scale`, `leaf_log_TB`) and its
    shapes are `Chart`'s, so the kernels of `flatlm.languages.pcfg.kernels` run on either.
    """

    def __init__(self, plan: Plan, consts, leaf_TBN):
        T, B, N = leaf_TBN.shape
        dtype = leaf_TBN.dtype
        self.plan, self.consts, self.T, self.B, self.N = plan, consts, T, B, N
        leaf_NTB = jnp.transpose(leaf_TBN, (2, 0, 1))
        beta_NM, s_M, mass_M = _normalise(leaf_NTB.reshape(N, T * B))
        s_TB = s_M.reshape(T, B)
        self.scale = {1: s_TB}
        self.leaf_log_TB = jnp.log(s_TB)  # kept apart from the chart's log scales, as in `Chart`
        leaf_1ETB = jnp.concatenate([beta_NM.reshape(N, T, B), jnp.zeros((1, T, B), dtype),
                                     mass_M.reshape(1, T, B)], 0)[None]
        fill_E = jnp.concatenate([jnp.zeros(N, dtype), jnp.asarray([_NEG, 0], dtype)])
        # by_end has one end row more than by_start has starts: two arrays of different shapes are never merged
        # into one by XLA, which would then copy it for the two chains of in-place updates.
        self.by_start, self.by_end = (
            jax.lax.dynamic_update_slice(jnp.broadcast_to(fill_E[None, :, None, None], (T, N + 2, rows, B)),
                                         leaf_1ETB, (0, 0, 0, 0)) for rows in (T, T + 1))
        for w in range(2, T + 1):
            self._width(w)

    def children(self, w: int, spec: Width):
        """left * f, right [D, N, I, B] (beta') for splits d0..d1, split weights f [D, I, B] and their max log
        scale top [I, B]: `Chart.children`, batch minor."""
        I, D, B, N = self.T - w + 1, spec.d1 - spec.d0 + 1, self.B, self.N
        left = _read(self.by_start, (spec.d0 - 1, 0, 0, 0), (D, N + 2, I, B))
        right = jax.lax.rev(_read(self.by_end, (w - spec.d1 - 1, 0, w - 1, 0), (D, N + 2, I, B)), (0,))
        lsum_DIB = left[:, N] + right[:, N]
        live_DIB = left[:, N + 1] * right[:, N + 1] > 0  # see `Chart.children` for the reference scale
        top_IB = jnp.where(live_DIB.any(0), jnp.where(live_DIB, lsum_DIB, -jnp.inf).max(0), lsum_DIB.max(0))
        f_DIB = jnp.exp(jnp.minimum(lsum_DIB - top_IB, _MAX_UP))
        left, right = jax.lax.optimization_barrier((left[:, :N] * f_DIB[:, None], right[:, :N]))
        return left, right, f_DIB, top_IB

    def _fill(self, w: int, spec: Width, left, right, top_IB) -> None:
        """Spans of width w from their children (`children`), written into by_start and by_end."""
        I, B, N = self.T - w + 1, self.B, self.N
        pairs = []
        for k in spec.blocks:  # outer products summed over splits, one elementwise loop over [L, R, I, B]
            a, b = k.d0 - spec.d0, k.d1 - spec.d0 + 1  # the sum over splits d of left[d, l] * right[d, r]
            outer_LRIB = _sum_slices(left[a:b, k.l0:k.l1, None] * right[a:b, None, k.r0:k.r1], 0)
            pairs.append(outer_LRIB.reshape(-1, I * B))
        pairs_PM = pairs[0] if len(pairs) == 1 else jnp.concatenate(pairs, 0)
        # One matmul, G [P, N] contracted over P as it is stored (one per block: ~13 % faster, 40 % more compile).
        new_NM = jax.lax.dot_general(self.consts["G"][w], pairs_PM, (((0,), (0,)), ((), ())),
                                     precision=jax.lax.Precision.HIGHEST)
        beta_NM, s_M, mass_M = _normalise(new_NM)
        s_IB = s_M.reshape(I, B)
        self.scale[w] = s_IB
        new_1EIB = jnp.concatenate([beta_NM.reshape(N, I, B), (top_IB + jnp.log(s_IB))[None],
                                    mass_M.reshape(1, I, B)], 0)[None]
        self.by_start = jax.lax.dynamic_update_slice(self.by_start, new_1EIB, (w - 1, 0, 0, 0))
        self.by_end = jax.lax.dynamic_update_slice(self.by_end, new_1EIB, (w - 1, 0, w - 1, 0))

    def prefixes(self):
        """beta' [B, T, N] and log scale [B, T] of the prefix spans [0, k), k = 1..T."""
        first_WEB = self.by_start[:, :, 0]
        return jnp.transpose(first_WEB[:, : self.N], (2, 0, 1)), first_WEB[:, self.N].T

    def width(self, w: int):
        """beta' [I, B, N] of all spans of width w."""
        return jnp.transpose(self.by_start[w - 1, : self.N, : self.T - w + 1], (1, 2, 0))

    def outside(self, sel_BT, on_width=None):
        """`Chart.outside`: d z / d leaf [T, B, N]; `on_width(w, adj [I, B, N])` sees each width's adjoint."""
        T, B, N = self.T, self.B, self.N
        dtype = self.by_start.dtype
        adj_start = jnp.zeros((T, N, T, B), dtype)  # as a left child: [width - 1, n, start, b]
        adj_end = jnp.zeros((T, N, T + 1, B), dtype)  # as a right child: [width - 1, n, end - 1, b]
        for w in range(T, 0, -1):
            I = T - w + 1
            adj_NIB = adj_start[w - 1, :, :I] + adj_end[w - 1, :, w - 1: T]
            adj_NIB = adj_NIB.at[:, 0].add(self.consts["root"][:, None] * sel_BT[:, w - 1])
            if on_width is not None:
                on_width(w, jnp.transpose(adj_NIB, (1, 2, 0)))
            if w == 1:
                return jnp.transpose(adj_NIB / self.scale[1], (1, 2, 0))
            spec = self.plan.widths.get(w)
            if spec is None:
                continue
            adj_NM = (adj_NIB / self.scale[w]).reshape(N, I * B)
            left, right, f_DIB, _ = self.children(w, spec)
            G_PN, p = self.consts["G"][w], 0
            for k in spec.blocks:
                L, R, a, b = k.l1 - k.l0, k.r1 - k.r0, k.d0 - spec.d0, k.d1 - spec.d0 + 1
                h_LRIB = exact_dot(G_PN[p: p + L * R, k.n0:k.n1], adj_NM[k.n0:k.n1]).reshape(L, R, I, B)  # its parents
                p += L * R
                rk, lk = right[a:b, k.r0:k.r1], left[a:b, k.l0:k.l1]  # [D, R, I, B], [D, L, I, B]
                # d z / d left [D, L, I, B] = sum_r h[l, r] rk[d, r], d z / d right [D, R, I, B] likewise over l
                gl = _sum_slices(h_LRIB[None] * rk[:, None], 2)
                gr = _sum_slices(h_LRIB[None] * lk[:, :, None], 1)
                adj_start = _add(adj_start, (spec.d0 - 1 + a, k.l0, 0, 0), gl * f_DIB[a:b, None])
                adj_end = _add(adj_end, (w - spec.d0 - b, k.r0, w - 1, 0), jax.lax.rev(gr, (0,)))
        raise AssertionError("unreachable")
