"""A parameter pytree as one vector, for the methods that keep many of them: Lanczos's basis and the trace
estimators' probe stacks (`spectrum`, `trace_estimators`). Vectors are [N] and stacks of them rows [K, N].

On a device mesh they are split along N over every device of the mesh the parameters live on, whatever the
parallelism (data-parallel replicates the parameters, not these): a basis of K copies costs each device K / D
model copies instead of K (paper scale: Lanczos's 25 rows of an 85M-parameter BERT are 8.5 GB of float32 on every
device replicated, 1.1 GB each over 8 devices). A jax.Array's shards are equal, so N is padded with zeros to a
multiple of D (`Space.size`); the padding stays zero through every product (`ravel` writes zeros there), sum,
projection and QR, so dot products, norms and Gram matrices are those of the unpadded vectors. Off a mesh (plain or
single-device arrays) nothing is padded or placed: `size == n`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flatlm.sharding import keep_layout, layout, mesh_of, move_to

Params = Any


@dataclasses.dataclass(frozen=True)
class Space:
    """The raveled vector space of one parameter structure (hashable: a static jit argument and a cache key).

    `shapes`: ((dtype, shape), ...) per leaf; `layout`: `flatlm.sharding.layout` of the parameters (what `unravel`
    gives back; None off a mesh); `mesh`: the mesh vectors are split over (None: unsplit)."""

    treedef: Any
    shapes: tuple
    layout: tuple | None
    mesh: Mesh | None

    @property
    def n(self) -> int:
        """Number of parameters (the operator's dimension)."""
        return int(sum(math.prod(s) for _, s in self.shapes))

    @property
    def size(self) -> int:
        """n padded to a multiple of the mesh's device count (the vectors' length)."""
        d = self.mesh.size if self.mesh is not None else 1
        return -(-self.n // d) * d

    @property
    def dtype(self):
        """The vectors' dtype: the parameters' common one, at least float32."""
        return jnp.result_type(*(jnp.promote_types(d, jnp.float32) for d, _ in self.shapes))

    def sharding(self, stacked: bool = False) -> NamedSharding | None:
        """Vectors [size] (stacked: [K, size]) split along size over every mesh axis; None off a mesh."""
        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, PartitionSpec(*((None,) if stacked else ()), self.mesh.axis_names))


def space(params: Params) -> Space:
    """The `Space` of `params` (arrays, or shape-dtype structs off a mesh)."""
    leaves, treedef = jax.tree.flatten(params)
    shapes = tuple((jnp.dtype(x.dtype), tuple(np.shape(x))) for x in leaves)
    return Space(treedef, shapes, layout(params), mesh_of(params))


def constrain(sp: Space, x: jax.Array, stacked: bool = False) -> jax.Array:
    """`x` ([size] or [K, size]) constrained to the space's layout inside a jit (unchanged off a mesh)."""
    s = sp.sharding(stacked)
    return x if s is None else jax.lax.with_sharding_constraint(x, s)


def ravel(sp: Space, tree: Params) -> jax.Array:
    """[size]: the leaves flattened in order, cast to `sp.dtype`, zero-padded and split (traceable)."""
    flat = jnp.concatenate([jnp.ravel(x).astype(sp.dtype) for x in jax.tree.leaves(tree)])
    return constrain(sp, jnp.pad(flat, (0, sp.size - sp.n)))


def unravel(sp: Space, x: jax.Array) -> Params:
    """The pytree of a [size] vector, each leaf in its dtype and, on a mesh, its parameter's layout (traceable)."""
    offsets = np.cumsum([0, *(math.prod(s) for _, s in sp.shapes)])
    leaves = [x[a:b].reshape(s).astype(d) for (d, s), a, b in zip(sp.shapes, offsets, offsets[1:])]
    return keep_layout(sp.treedef.unflatten(leaves), sp.layout)


@functools.lru_cache(maxsize=32)
def ravellers(sp: Space) -> tuple:
    """Jitted (ravel, unravel) of the space: one dispatch each per vector, compiled once per structure."""
    return jax.jit(functools.partial(ravel, sp)), jax.jit(functools.partial(unravel, sp))


@functools.partial(jax.jit, static_argnames=("sp", "m", "kind"))
def draw(key: jax.Array, sp: Space, m: int, kind: str = "rademacher") -> jax.Array:
    """[m, size] random rows, zero in the padding: "rademacher" (+-1) or "normal" (N(0, 1)). The first n columns
    are jax.random's [m, n] draw from `key` whatever the mesh (threefry is partitionable), and each device makes
    only its own columns."""
    sample = jax.random.rademacher if kind == "rademacher" else jax.random.normal
    X_MN = sample(key, (m, sp.n), sp.dtype)
    return constrain(sp, jnp.pad(X_MN, ((0, 0), (0, sp.size - sp.n))), stacked=True)


def put(sp: Space, X: jax.Array) -> jax.Array:
    """A stack [K, n] or [K, size] made elsewhere (a test's, a caller's), zero-padded and placed in the space's
    layout (`flatlm.sharding.move_to`: one already there is returned as it is; on a mesh spanning several processes
    host data stays where it is)."""
    X = jnp.asarray(X)
    if X.shape[-1] == sp.n and sp.size != sp.n:
        X = jnp.pad(X, ((0, 0), (0, sp.size - sp.n)))
    want = sp.sharding(stacked=True)
    return X if want is None else move_to(X, want)


@functools.partial(jax.jit, static_argnames="sp")
def qr_rows(Y_MN: jax.Array, sp: Space) -> tuple[jax.Array, jax.Array]:
    """Y^T = Q R as (Q^T [m, size], orthonormal rows in Y's layout; R [m, m] upper triangular), m <= n.

    On a mesh, a one-level TSQR (Demmel, Grigori, Hoemmen & Langou, "Communication-optimal parallel and sequential
    QR and LU factorizations", SIAM J. Sci. Comput. 2012): each device QRs its own block of columns, the D small
    R factors are gathered (D x m x m numbers) and QR'd once more, and each block is multiplied by its rows of that
    second Q. As stable as one Householder QR (it is one, of a reordered product), and the stack stays split:
    XLA's QR of the whole [size, m] matrix gathers it onto every device first, a full stack per device.
    Off a mesh: `jnp.linalg.qr`. R's rows may differ in sign between the two (Q's columns with them)."""
    if sp.mesh is None:
        Q_NM, R_MM = jnp.linalg.qr(Y_MN.T)
        return Q_NM.T, R_MM
    axes = sp.mesh.axis_names

    def local(y_MB):  # y: this device's columns [m, size / D]
        q_BK, r_KM = jnp.linalg.qr(y_MB.T)
        r_all = jax.lax.all_gather(r_KM, axes, tiled=True)  # [D * K, m], block d from device d
        q2, R_MM = jnp.linalg.qr(r_all)
        k = r_KM.shape[0]
        q2_KM = jax.lax.dynamic_slice_in_dim(q2, jax.lax.axis_index(axes) * k, k, 0)
        return (q_BK @ q2_KM).T, R_MM

    return jax.shard_map(local, mesh=sp.mesh, in_specs=PartitionSpec(None, axes),
                         out_specs=(PartitionSpec(None, axes), PartitionSpec()), check_vma=False)(Y_MN)
