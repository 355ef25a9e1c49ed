"""Why the L6-H256 step runs faster in microbatches on this CPU: the MLP's pieces alone vs chained.

One pre-LN MLP's shapes at L6-H256, B256 x T32 (N = 8192 rows, D = 256, F = 1024), float32, 2 cores; flatlm is
imported for its allocator settings (as in the train step). Each case over the whole N rows (k = 1) and as
`lax.map` over 4 slices of N / 4 rows (k = 4); medians of 9 interleaved samples of 5 calls.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

import flatlm  # noqa: F401 - glibc malloc settings (flatlm/allocator.py), as in every flatlm process

N, D, F = 8192, 256, 1024
x = jax.random.normal(jax.random.PRNGKey(0), (N, D))
w = jax.random.normal(jax.random.PRNGKey(1), (D, F)) * 0.05
b = jnp.zeros(F)
h = x @ w


def mlp(x):
    """Dense, tanh GELU, dense back (tied): forward and backward, gradients of x and w."""
    def f(x, w):
        return jnp.sum(jnp.tanh(jax.nn.gelu(x @ w + b, approximate=True) @ w.T))
    return jax.grad(f, argnums=(0, 1))(x, w)


def elementwise(h):
    return jax.grad(lambda h: jnp.sum(jax.nn.gelu(h, approximate=True) * jnp.tanh(h)))(h)


def sliced(fn, k):
    return lambda a: jax.lax.map(fn, a.reshape(k, -1, *a.shape[1:]))


cases = {}
for k in (1, 4):
    cases[f"mlp fwd+bwd k={k}"] = (jax.jit(sliced(mlp, k)), x)
    cases[f"elementwise gelu/tanh grad k={k}"] = (jax.jit(sliced(elementwise, k)), h)
    cases[f"matmul [N,{D}]x[{D},{F}] k={k}"] = (jax.jit(sliced(lambda a: a @ w, k)), x)
for fn, arg in cases.values():
    jax.block_until_ready(fn(arg))
res = {name: [] for name in cases}
for _ in range(9):
    for name, (fn, arg) in cases.items():
        t = time.perf_counter()
        for _ in range(5):
            jax.block_until_ready(fn(arg))
        res[name].append((time.perf_counter() - t) / 5 * 1e3)
for name, ms in res.items():
    print(f"{name:40s} median {np.median(ms):7.2f} ms  min {min(ms):7.2f}")
