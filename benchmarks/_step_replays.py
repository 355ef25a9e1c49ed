"""Replays that explain a train step's time (`train_step.py`): every dot_general of the step run alone, and the
optimizer update alone; the rest of the step is elementwise work and copies."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax


def _dot_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _dot_eqns(sub)


def dot_replay(step_fn, state, batch):
    """(call, flops, count): every dot_general of one step (same shapes, dimension numbers, precision) run alone
    in one jitted program; and the step's matmul FLOPs (2 * output size * contracted size). Each dot gets its own
    smaller operand (so XLA cannot merge dots) and shares the larger one with the dots of its shape."""
    closed = jax.make_jaxpr(step_fn)(state, batch)
    eqns = list(_dot_eqns(closed.jaxpr))
    rng = np.random.default_rng(0)
    new = lambda aval: jnp.asarray(rng.standard_normal(aval.shape).astype(aval.dtype))
    shared, operands, dims, flops = {}, [], [], 0.0
    for e in eqns:
        lhs, rhs = (v.aval for v in e.invars)
        small = 0 if math.prod(lhs.shape) <= math.prod(rhs.shape) else 1
        big = (lhs, rhs)[1 - small]
        pair = [None, None]
        pair[small] = new((lhs, rhs)[small])
        key = (big.shape, str(big.dtype))
        if key not in shared:
            shared[key] = new(big)
        pair[1 - small] = shared[key]
        operands.append(tuple(pair))
        dims.append((e.params["dimension_numbers"], e.params.get("precision"), e.params.get("preferred_element_type")))
        (lc, _), _ = e.params["dimension_numbers"]
        flops += 2.0 * math.prod(e.outvars[0].aval.shape) * math.prod(lhs.shape[d] for d in lc)

    @jax.jit
    def run(operands):
        return [jax.lax.dot_general(a, b, dn, precision=p, preferred_element_type=t)
                for (a, b), (dn, p, t) in zip(operands, dims)]

    jax.block_until_ready(run(operands))
    return (lambda: jax.block_until_ready(run(operands))), flops, len(eqns)


def optimizer_replay(optimizer, params):
    """call: the AdamW update + apply_updates alone on a params-shaped gradient, state donated."""
    params = jax.tree.map(jnp.copy, params)  # ours to donate
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    holder = {"s": (params, optimizer.init(params))}

    @functools.partial(jax.jit, donate_argnums=0)
    def update(s, g):
        p, o = s
        u, o = optimizer.update(g, o, p)
        return optax.apply_updates(p, u), o

    def call():
        holder["s"] = update(holder["s"], grads)
        jax.block_until_ready(holder["s"])

    call()
    return call
