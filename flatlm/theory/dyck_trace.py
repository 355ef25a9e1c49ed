"""Tr(H) of the Section 6 model's squared pre-training loss: an exact trace of our own (HVPs over the basis,
independent of flatlm.flatness), the shared estimators, the Gauss-Newton trace (= Tr(H) at zero loss), the loss
itself and the closed-form minimum over zero-loss solutions (`flattest_trace`). Used by `flatlm.theory.dyck` and
`flatlm.theory.dyck_search`."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from flatlm.flatness import hessian
from flatlm.languages import dyck as lang
from flatlm.models import dyck as model
from flatlm.theory.dyck_train import gauss_newton

Params = model.Params
Batch = lang.Batch




@functools.partial(jax.jit, static_argnames=("chunk",))
def _exact_trace_hvp(params: Params, batch: Batch, chunk: int = 64) -> jax.Array:
    """sum_i e_i^T H e_i: `chunk` basis vectors at a time (vmapped HVPs), the chunks scanned."""
    flat, unravel = ravel_pytree(params)
    grad_fn = jax.grad(model.flat_loss(unravel, batch))
    P = flat.shape[0]
    num_chunks = -(-P // chunk)
    idx_CK = jnp.arange(num_chunks * chunk).reshape(num_chunks, chunk)

    def diag_entry(i):
        e_P = (jnp.arange(P) == i).astype(flat.dtype)  # all zeros for the padding indices i >= P
        return jax.jvp(grad_fn, (flat,), (e_P,))[1] @ e_P

    return jnp.sum(jax.lax.map(jax.vmap(diag_entry), idx_CK))


@jax.jit
def _exact_trace_dense(params: Params, batch: Batch) -> jax.Array:
    flat, unravel = ravel_pytree(params)
    return jnp.trace(jax.hessian(model.flat_loss(unravel, batch))(flat))


def _xyw(batch: Batch) -> Batch:
    """The arrays the loss reads (so jit caches on them alone)."""
    return {k: jnp.asarray(batch[k]) for k in ("x", "y", "w")}


def exact_trace(params: Params, batch: Batch, method: str = "hvp") -> float:
    """Exact Tr of the Hessian of the loss on `batch` w.r.t. all of (Q, K, V, u).

    method "hvp": sum of e_i^T H e_i over the P basis vectors, in chunks (memory: 64 copies of the activations);
    "hessian": trace of the dense jax.hessian (memory: P copies; tiny models only)."""
    if method == "hessian":
        return float(_exact_trace_dense(params, _xyw(batch)))
    return float(_exact_trace_hvp(params, _xyw(batch)))


EXACT_TRACE_BUDGET = 3e8  # P * rows * T * 2T: about 10 s of HVPs on one CPU core (T <= 8 at the default widths)


def exact_affordable(params: Params, batch: Batch) -> bool:
    """Whether `exact_trace` is cheap enough here: P HVPs, each over the whole batch."""
    num_params = ravel_pytree(params)[0].shape[0]
    return num_params * int(np.prod(np.shape(batch["x"]))) <= EXACT_TRACE_BUDGET


def estimator_trace(params: Params, batch: Batch, key: jax.Array, num_probes: int = 64,
                    method: str = "hutchinson"):
    """Tr(H) from the shared flatness estimators (`flatlm.flatness.hessian`): a TraceEstimate (.mean, .stderr).

    method "hutchinson" (Rademacher probes) or "exact" (its jax.hessian path, stderr 0)."""
    b = _xyw(batch)
    if method == "exact":
        return hessian.exact_trace(model.loss, params, batches=[b])
    return hessian.hutchinson_trace(model.loss, params, key, num_probes, batches=[b],
                                    chunk_size=min(16, num_probes))


def pretrain_loss(params: Params, batch: Batch) -> float:
    """The (population, for an enumerated batch) squared loss, jitted."""
    return float(_loss_jit(params, _xyw(batch)))


_loss_jit = jax.jit(model.loss)
_features_jit = jax.jit(model.features)


@jax.jit
def _gauss_newton_jit(params: Params, batch: Batch) -> jax.Array:
    return gauss_newton(params, batch)


def gauss_newton_trace(params: Params, batch: Batch) -> float:
    """2 sum_b w_b ||grad_theta f(x_b)||^2: equals Tr(H) at a zero-loss point (the residual term vanishes)."""
    return float(_gauss_newton_jit(params, _xyw(batch)))


def flattest_trace(T: int, m: int) -> float:
    """The smallest Tr(H) of any zero-loss solution of width m: 4 / (m sqrt(T)) (attained by the transferable one;
    the lower bound of the module docstring, cf. Lemma D.1 in Appendix D.1)."""
    return 4.0 / (m * math.sqrt(T))
