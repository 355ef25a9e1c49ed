"""Batched inside / outside in JAX: the scaled inside chart of a batch and its hand-written outside pass, with
each span's nonterminals as the minor axis (`Chart`: the layout of grammars with wide blocks, the dense ones;
`flatlm.languages.pcfg.chart_small` holds the batch-minor layout of grammars of small blocks, and
`flatlm.languages.pcfg.kernels` the kernels built on either).

Each span keeps its inside vector divided by its maximum, with the log of that scale beside it, so float32
is exact to rounding and the grammar's exact zeros stay exact zeros. The chart is linear in each position's
leaf vector, so the derivative of the root value with respect to the leaf vectors -- the outside pass, the
mirror image of the inside pass -- gives P(x_-t, x_t = w) / P(x) for every t and w at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flatlm.languages.base import exact_dot, exact_einsum
from flatlm.languages.pcfg.plan import Plan, Width


def _sum_slices(x, axis: int):
    """x summed over `axis` (dropped) as a pairwise tree of its slices: one fused elementwise loop, where XLA:CPU's
    reduce over a major axis ran ~5x slower (RESULTS.md, 2026-11-29 afternoon). The charts form each block's outer
    products whole and sum them by this, not a product per slice: a third fewer jaxpr equations, XLA's compile
    5-15 % shorter and the chunk no slower, the same bits (RESULTS.md, 2026-11-29 evening)."""
    xs = [jax.lax.slice_in_dim(x, i, i + 1, axis=axis) for i in range(x.shape[axis])]
    while len(xs) > 1:  # neighbours added pairwise, level by level
        xs = [jax.lax.add(xs[i], xs[i + 1]) if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return jax.lax.squeeze(xs[0], (axis,))


_TREE_TERMS = 16  # contractions over at most this many terms are unrolled; longer ones use dot_general
_DENSE_BLOCK = 16  # inside-pass blocks whose children both have more symbols: outer products summed by dot_general


def _wide(k) -> bool:
    """Whether an inside-pass block sums its outer products by batched matmuls (both children > _DENSE_BLOCK)."""
    return min(k.l1 - k.l0, k.r1 - k.r0) > _DENSE_BLOCK


def has_wide_blocks(plan: Plan) -> bool:
    """Whether any width of `plan` has a block on the batched-matmul path (dense grammars; the released-shape ones
    have blocks of at most 10 symbols)."""
    return any(_wide(k) for spec in plan.widths.values() for k in spec.blocks)


def _normalise(new_IBN):
    """Divide each span's vector by its max (an all-zero span keeps scale 1). Returns (scaled, scale [I, B], mass
    [I, B]: 1 where the span has any, else 0)."""
    s_IB = jax.lax.stop_gradient(new_IBN.max(-1))
    mass_IB = (s_IB > 0).astype(new_IBN.dtype)
    s_IB = jnp.where(s_IB > 0, s_IB, 1)
    return new_IBN / s_IB[..., None], s_IB, mass_IB


def _read(x, start: tuple[int, ...], size: tuple[int, ...]):
    return jax.lax.slice(x, start, tuple(a + b for a, b in zip(start, size)))


def _add(x, start: tuple[int, ...], y):
    """x with y added into the box at `start` (in place under XLA)."""
    return jax.lax.dynamic_update_slice(x, _read(x, start, y.shape) + y, start)


_NEG = -1e30  # log scale of widths no nonterminal can span: their split weight exp(_NEG - top) is 0
_MAX_UP = 60.0  # cap on a split weight's log above the reference: exp stays finite in float32 (< e^88)


class ChartBase:
    """What both chart layouts share (`Chart` here, `chart_small.SmallBlockChart`): the root value read from the
    prefix spans, and the width loop. A subclass sets plan, consts, T, B, scale and by_start and defines
    `prefixes`, `children` and `_fill`."""

    def root_value(self, lengths_B):
        """z [B] (scaled) and log scale [B] with P(x) = z exp(scale + sum of leaf log scales), and the
        one-hot sel [B, T] of length - 1."""
        prefix_BTN, log_BT = self.prefixes()
        sel_BT = jax.nn.one_hot(lengths_B - 1, self.T, dtype=prefix_BTN.dtype)
        z_BT = exact_dot(prefix_BTN, self.consts["root"])
        return (z_BT * sel_BT).sum(-1), (log_BT * sel_BT).sum(-1), sel_BT

    def _width(self, w: int) -> None:
        """Spans of width w: none where no nonterminal spans w words (the chart's zeros and _NEG log scales stay,
        scale 1), else `_fill` from their children."""
        spec = self.plan.widths.get(w)
        if spec is None:
            self.scale[w] = jnp.ones((self.T - w + 1, self.B), self.by_start.dtype)
            return
        left, right, _, top_IB = self.children(w, spec)
        self._fill(w, spec, left, right, top_IB)


class Chart(ChartBase):
    """The scaled inside chart of a batch, plus the outside pass written by hand.

    by_start[i, b, w-1] and by_end[j-1, b, w-1] both hold span [i, j = i + w) of sentence b as [N + 2]:
    beta' [N], the log scale (inside = beta' * exp(log scale + the span's leaf log scales)) and, last, 1 if the
    span has mass, else 0.
    Children of span [i, i+w) at split d: left [i, i+d) = by_start[i, :, d-1], right [i+d, i+w) =
    by_end[i+w-1, :, w-d-1], so all starts i and splits d0..d1 of one width are two rectangular slices
    [I, B, D, N + 2], batch dims leading.

    Shape letters: T words, B sentences, N nonterminals, I starts of spans of one width, D splits, L and R
    a block's left and right children, P child pairs (summed over blocks), E = N + 2 (beta', the log
    scale and the mass flag), M = I * B rows.
    """

    def __init__(self, plan: Plan, consts, leaf_TBN):
        T, B, N = leaf_TBN.shape
        dtype = leaf_TBN.dtype
        self.plan, self.consts, self.T, self.B, self.N = plan, consts, T, B, N
        beta_TBN, s_TB, mass_TB = _normalise(leaf_TBN)
        self.scale = {1: s_TB}  # per width: the normaliser [I, B] of each span
        # Leaves start at log scale 0 and their own scales are kept apart (inside = beta' * exp(chart log
        # scale + sum of the span's leaf log scales)): the chart's log scales then stay small, so float32
        # resolves the split weights exp(lsum - top) to ~1e-7 even in long sentences.
        self.leaf_log_TB = jnp.log(s_TB)
        leaf_TB1E = jnp.concatenate([beta_TBN, jnp.zeros((T, B, 1), dtype), mass_TB[..., None]], -1)[:, :, None]
        empty = jnp.concatenate([jnp.zeros((T, B, T - 1, N), dtype), jnp.full((T, B, T - 1, 1), _NEG, dtype),
                                 jnp.zeros((T, B, T - 1, 1), dtype)], -1)
        # Two different expressions, so that XLA does not merge them and then copy to update both in place.
        self.by_start = jnp.concatenate([leaf_TB1E, empty], 2)
        self.by_end = jnp.concatenate([empty, leaf_TB1E], 2)[:, :, ::-1]
        for w in range(2, T + 1):
            self._width(w)

    def children(self, w: int, spec: Width):
        """left * f, right [I, B, D, N] (beta') for splits d0..d1, split weights f [I, B, D], and their max
        log scale top [I, B]. (The outside pass reads them again from the final chart: keeping the forward
        slices alive would make XLA copy the whole chart at every later in-place update.)"""
        I, D, B, N = self.T - w + 1, spec.d1 - spec.d0 + 1, self.B, self.N
        left = _read(self.by_start, (0, 0, spec.d0 - 1, 0), (I, B, D, N + 2))
        right = jax.lax.rev(_read(self.by_end, (w - 1, 0, w - spec.d1 - 1, 0), (I, B, D, N + 2)), (2,))
        lsum_IBD = left[..., N] + right[..., N]
        # The reference scale comes from the splits whose two children both have mass. A span of zero mass keeps
        # normaliser 1, so its log scale (its own top) sits above those of real spans, which shrink by log s at
        # every width; as a reference it underflowed the real splits' weights in float32 (a derivable sentence
        # of 16 words with rules of probability 1e-3 got P(x) = 0). Splits with an empty child still carry the
        # outside pass's derivative (a word that would give the child mass), capped at e^_MAX_UP above it.
        live_IBD = left[..., N + 1] * right[..., N + 1] > 0
        top_IB = jnp.where(live_IBD.any(-1), jnp.where(live_IBD, lsum_IBD, -jnp.inf).max(-1), lsum_IBD.max(-1))
        f_IBD = jnp.exp(jnp.minimum(lsum_IBD - top_IB[..., None], _MAX_UP))
        # Materialise the two operands contiguously: the outer products below read each many times.
        left, right = jax.lax.optimization_barrier((left[..., :N] * f_IBD[..., None], right[..., :N]))
        return left, right, f_IBD, top_IB

    def _fill(self, w: int, spec: Width, left, right, top_IB) -> None:
        """Spans of width w from their children (`children`), written into by_start and by_end."""
        I, B, N = self.T - w + 1, self.B, self.N
        pairs = []
        for k in spec.blocks:
            if _wide(k):  # sum over splits of outer products: batched matmuls
                a, b = k.d0 - spec.d0, k.d1 - spec.d0 + 1
                # left as [I, B, L, D], materialised (else XLA folds the transpose back into the dot): a row-major
                # [L, D] x [D, R] per row runs 1.7x faster than [D, L]^T x [D, R] ([256, 16, 50] operands).
                left_IBLD = jax.lax.optimization_barrier(jnp.swapaxes(left[:, :, a:b, k.l0:k.l1], 2, 3))
                outer_IBLR = exact_einsum("ibld,ibdr->iblr", left_IBLD, right[:, :, a:b, k.r0:k.r1])
            else:  # small blocks: one fused elementwise loop
                a, b = k.d0 - spec.d0, k.d1 - spec.d0 + 1
                outer_IBLR = _sum_slices(left[:, :, a:b, k.l0:k.l1, None] * right[:, :, a:b, None, k.r0:k.r1], 2)
            pairs.append(outer_IBLR.reshape(I * B, -1))
        pairs_MP = pairs[0] if len(pairs) == 1 else jnp.concatenate(pairs, -1)
        new_IBN = exact_dot(pairs_MP, self.consts["G_in"][w])[:, :N].reshape(I, B, N)
        beta_IBN, s_IB, mass_IB = _normalise(new_IBN)
        self.scale[w] = s_IB
        new_IB1E = jnp.concatenate([beta_IBN, (top_IB + jnp.log(s_IB))[..., None], mass_IB[..., None]],
                                   -1)[:, :, None]
        self.by_start = jax.lax.dynamic_update_slice(self.by_start, new_IB1E, (0, 0, w - 1, 0))
        self.by_end = jax.lax.dynamic_update_slice(self.by_end, new_IB1E, (w - 1, 0, w - 1, 0))

    def prefixes(self):
        """beta' [B, T, N] and log scale [B, T] of the prefix spans [0, k), k = 1..T."""
        return self.by_start[0, :, :, : self.N], self.by_start[0, :, :, self.N]

    def width(self, w: int):
        """beta' [I, B, N] of all spans of width w."""
        return self.by_start[: self.T - w + 1, :, w - 1, : self.N]

    def outside(self, sel_BT, on_width=None):
        """The outside pass: d z / d beta' for every span, widths T..1 (z = the scaled root value).

        Returns d z / d leaf [T, B, N]; `on_width(w, adj [I, B, N])` sees each width's adjoint.
        """
        T, B, N = self.T, self.B, self.N
        dtype = self.by_start.dtype
        adj_start = jnp.zeros((T, B, T, N), dtype)  # contributions as a left child, by start
        adj_end = jnp.zeros((T + 1, B, T, N), dtype)[1:]  # as a right child, by end (kept apart from the above)
        for w in range(T, 0, -1):
            I = T - w + 1
            adj_IBN = adj_start[:I, :, w - 1] + adj_end[w - 1:, :, w - 1]
            adj_IBN = adj_IBN.at[0].add(sel_BT[:, w - 1, None] * self.consts["root"])
            if on_width is not None:
                on_width(w, adj_IBN)
            if w == 1:
                return adj_IBN / self.scale[1][..., None]
            spec = self.plan.widths.get(w)
            if spec is None:
                continue
            h_IBP = exact_dot(adj_IBN / self.scale[w][..., None], self.consts["G"][w].T)
            left, right, f_IBD, _ = self.children(w, spec)
            p = 0
            for k in spec.blocks:
                L, R, a, b = k.l1 - k.l0, k.r1 - k.r0, k.d0 - spec.d0, k.d1 - spec.d0 + 1
                h_IBLR = h_IBP[..., p: p + L * R].reshape(I, B, L, R)
                p += L * R
                rk, lk = right[:, :, a:b, k.r0:k.r1], left[:, :, a:b, k.l0:k.l1]
                if R <= _TREE_TERMS:  # d z / d left[l] = sum_r h[l, r] right[r]
                    gl = _sum_slices(jnp.swapaxes(h_IBLR, 2, 3)[:, :, None] * rk[..., None], 3)  # [I, B, D, R, L]
                else:
                    gl = exact_einsum("ibdr,iblr->ibdl", rk, h_IBLR)
                if L <= _TREE_TERMS:  # d z / d right[r] = sum_l h[l, r] left[l]
                    gr = _sum_slices(h_IBLR[:, :, None] * lk[..., None], 3)  # [I, B, D, L, R] summed over L
                else:
                    gr = exact_einsum("ibdl,iblr->ibdr", lk, h_IBLR)
                adj_start = _add(adj_start, (0, 0, spec.d0 - 1 + a, k.l0), gl * f_IBD[:, :, a:b, None])
                adj_end = _add(adj_end, (w - 1, 0, w - spec.d0 - b, k.r0), jax.lax.rev(gr, (2,)))
        raise AssertionError("unreachable")

