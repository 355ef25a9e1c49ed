"""The four chart kernels (`KERNELS`): forward (P(x) and prefix inside values), conditionals (Appendix A.2's true
conditionals P(x_t = w | x_-t) for every position and word), span posteriors, and length masses.

A kernel takes a `Plan` (static, bound with functools.partial before jit), its `consts` and the batch, and builds
the chart in one of two layouts (`new_chart`): nonterminals minor (`chart.Chart`) or batch minor
(`chart_small.SmallBlockChart`, for grammars of small blocks on the CPU; `default_layout`). `layout` forces one;
both give the same numbers (tests/test_pcfg_layouts.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flatlm.languages.base import exact_dot
from flatlm.languages.pcfg.chart import Chart, has_wide_blocks
from flatlm.languages.pcfg.chart_small import SmallBlockChart
from flatlm.languages.pcfg.plan import Plan

LAYOUTS = {"symbol_minor": Chart, "batch_minor": SmallBlockChart}


def default_layout(plan: Plan) -> str:
    """Batch minor for a plan of small blocks on the CPU backend (where it was measured faster: RESULTS.md,
    2026-11-29 afternoon), else symbol minor: dense grammars, and accelerators. On an H200 (2026-11-29) batch minor
    ran the released grammar 1.19-1.29x faster but compiled in 46 s instead of 28-34 s, more than it saves on the
    paper's 10^6 validation sentences (~1 s at 177k-212k sentences/s)."""
    return "batch_minor" if not has_wide_blocks(plan) and jax.default_backend() == "cpu" else "symbol_minor"


def new_chart(plan: Plan, consts, leaf_TBN, layout: str | None = None):
    """The inside chart of leaves [T, B, N] in `layout` (a key of LAYOUTS; None: `default_layout`)."""
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"unknown chart layout {layout!r}: use one of {sorted(LAYOUTS)} or None (the default)")
    return LAYOUTS[layout or default_layout(plan)](plan, consts, leaf_TBN)


def _leaves(consts, tokens_BT):
    """Leaf vectors [T, B, N]: emit[:, w] per word, zeros for pad (id V), emit.sum(1) for mask (id V + 1)."""
    return consts["emit_ext"][tokens_BT.T]  # [T, B, N]


def _kernel_forward(plan: Plan, consts, tokens_BT, lengths_B, layout: str | None = None):
    """The inside pass: scaled P(x) and the prefix spans' inside vectors, with their log scales."""
    chart = new_chart(plan, consts, _leaves(consts, tokens_BT), layout)
    z_B, log_B, _ = chart.root_value(lengths_B)
    prefix_BTN, prefix_log_BT = chart.prefixes()
    return {"z": z_B, "log_scale": log_B, "prefix": prefix_BTN, "prefix_log_scale": prefix_log_BT,
            "leaf_log_scale": chart.leaf_log_TB.T}


def _kernel_conditionals(plan: Plan, consts, tokens_BT, lengths_B, layout: str | None = None):
    """q [B, T, V] = P(x_t = w | x_-t) (Appendix A.2), zero beyond each length and where no sentence fits."""
    chart = new_chart(plan, consts, _leaves(consts, tokens_BT), layout)
    _, _, sel_BT = chart.root_value(lengths_B)
    # The chart is linear in each leaf: (d z / d leaf[t]) . emit[:, w] = P(x_-t, x_t = w) * (a per-sentence
    # constant, the inverse of all the chart's scales), which the normalisation over w removes.
    g_TBN = chart.outside(sel_BT)
    T = tokens_BT.shape[1]
    joint_BTV = exact_dot(jnp.swapaxes(g_TBN, 0, 1), consts["emit"])
    total_BT = joint_BTV.sum(-1)
    valid_BT = (total_BT > 0) & (jnp.arange(T)[None, :] < lengths_B[:, None])
    q_BTV = joint_BTV / jnp.where(valid_BT, total_BT, 1)[..., None]
    return {"q": jnp.where(valid_BT[..., None], jnp.maximum(q_BTV, 0), 0)}


def _kernel_posteriors(plan: Plan, consts, tokens_BT, lengths_B, layout: str | None = None):
    """P(A spans [i, i + w) | x) by inside-outside, as post [B, start, width - 1, N]."""
    chart = new_chart(plan, consts, _leaves(consts, tokens_BT), layout)
    z_B, _, sel_BT = chart.root_value(lengths_B)
    T = chart.T
    post = {}

    def on_width(w, adj_IBN):  # P(A spans [i, i+w) | x) = beta' * (d z / d beta') / z
        post[w] = jnp.pad(chart.width(w) * adj_IBN / z_B[:, None], ((0, w - 1), (0, 0), (0, 0)))

    chart.outside(sel_BT, on_width)
    post_TTBN = jnp.stack([post[w] for w in range(1, T + 1)])  # [width - 1, start, B, N]
    return {"post": jnp.transpose(post_TTBN, (2, 1, 0, 3))}  # [B, T (start), T (width - 1), N]


def _kernel_lengths(plan: Plan, consts, leaf_BTN, layout: str | None = None):
    """Scaled root value, its log scale and the leaf log scales [B, T] of every prefix of the given leaves."""
    chart = new_chart(plan, consts, jnp.swapaxes(leaf_BTN, 0, 1), layout)
    prefix_BTN, log_BT = chart.prefixes()
    return exact_dot(prefix_BTN, consts["root"]), log_BT, chart.leaf_log_TB.T


KERNELS = {  # kind -> kernel(plan, consts, ...); bound to a plan and jitted by `flatlm.languages.pcfg.engine`
    "forward": _kernel_forward, "conditionals": _kernel_conditionals,
    "posteriors": _kernel_posteriors, "lengths": _kernel_lengths,
}


# Per kernel output, its axes of the chart's size T (chunks of different T are zero-padded to the largest).
TIME_AXES = {"q": (1,), "prefix": (1,), "prefix_log_scale": (1,), "leaf_log_scale": (1,), "post": (1, 2)}
