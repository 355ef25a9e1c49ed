"""Exact inference multiplies at full float32 precision: every dot in the HMM's and the PCFG's kernels (their
gradients' too) and in the OPT teacher (sampler and conditionals) asks for Precision.HIGHEST. XLA:CPU computes
float32 dots in full either way, so the CPU cannot show the error; XLA:GPU runs a default-precision float32 dot on
TF32, and on an H200 (2026-11-29) the HMM's conditionals then summed to 1 +- 3.2e-4 (3.1e-6 at HIGHEST;
benchmarks/RESULTS.md). A dot written without it fails here."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from flatlm.languages import hmm as hmm_lib
from flatlm.languages.base import exact_dot
from flatlm.languages.pcfg import dense_grammar, random_grammar
from flatlm.languages.pcfg.kernels import KERNELS, LAYOUTS

HIGHEST = jax.lax.Precision.HIGHEST


def _dot_precisions(jaxpr) -> list:
    """The precision of every dot_general in a jaxpr and the jaxprs nested in its equations (jit, scan, ...)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _dot_precisions(inner)
    return found


def _all_highest(closed) -> int:
    precisions = _dot_precisions(closed.jaxpr)
    bad = [p for p in precisions if p is None or any(x != HIGHEST for x in p)]
    assert not bad, f"{len(bad)} of {len(precisions)} dots below HIGHEST: {bad[:3]}"
    return len(precisions)


def test_the_walk_sees_a_default_precision_dot():  # the check itself can fail
    a = np.ones((3, 3), np.float32)
    with pytest.raises(AssertionError, match="1 of 2 dots below HIGHEST"):
        _all_highest(jax.make_jaxpr(lambda x: exact_dot(x, x) @ x)(a))
    assert _all_highest(jax.make_jaxpr(jax.jit(lambda x: exact_dot(exact_dot(x, x), x)))(a)) == 2


@pytest.mark.parametrize("kernel", ["_conditionals_fn", "_posteriors_fn", "_log_prob_fn"])
def test_hmm_kernels_multiply_at_highest(kernel):
    hmm = hmm_lib.random_hmm(0, length=6)
    c = hmm.sample(8, seed=1)
    closed = jax.make_jaxpr(getattr(hmm_lib, kernel))(*hmm._params(), c.tokens, c.lengths)
    assert _all_highest(closed) >= 5  # one transition product per position at least


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dense", [False, True])
def test_pcfg_kernels_multiply_at_highest(layout, dense):
    g = dense_grammar(0, max_length=6, batch_size=4) if dense else random_grammar(0, batch_size=4)
    plan = g._engine.plan(6)
    tok, lens = np.zeros((4, 6), np.int32), np.full(4, 6, np.int32)
    for kind in ("forward", "conditionals", "posteriors"):
        fn = functools.partial(KERNELS[kind], plan, layout=layout)
        assert _all_highest(jax.make_jaxpr(fn)(plan.consts, tok, lens)) >= 1, kind
    leaf = np.broadcast_to(np.asarray(plan.consts["leaf_total"]), (1, 6, plan.N))
    fn = functools.partial(KERNELS["lengths"], plan, layout=layout)
    assert _all_highest(jax.make_jaxpr(fn)(plan.consts, leaf)) >= 1


@pytest.mark.parametrize("projection", [False, True])
def test_the_opt_teacher_multiplies_at_highest(projection):
    """The OPT language's sampler (cached decode, one cache row per sentence) and its conditionals' decode (one
    prefix shared by the batch), with and without the 350M layout's projections."""
    import jax.numpy as jnp

    from flatlm.languages.opt import OPT, OPTConfig, init_cache, random_params
    from flatlm.languages.opt.language import _ancestral

    cfg = OPTConfig.named("tiny", **(dict(word_embed_proj_dim=16, do_layer_norm_before=False) if projection else {}))
    model, params, head = OPT(cfg), random_params(cfg, seed=0, std=0.15), jnp.asarray([5, 9, 17], jnp.int32)
    sampler = jax.make_jaxpr(lambda p, k: _ancestral(model, p, k, 2, 3, head))(params, jax.random.key(0))
    assert _all_highest(sampler) >= 6
    shared = init_cache(cfg, 1, 4)._replace(length=jnp.int32(2))  # C = 1: one prefix for the 3 rows
    decode = lambda p, t: model.apply({"params": p}, t, cache=shared, head_ids=head, method=OPT.decode)  # noqa: E731
    assert _all_highest(jax.make_jaxpr(decode)(params, jnp.zeros((3, 2), jnp.int32))) >= 6
