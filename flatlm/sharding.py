"""Device mesh and logical-axis rules: the same model code runs data-, FSDP- or tensor-parallel by config.

Mesh axes are ("data", "model"). Model code names its axes ("batch", "length", "vocab", "embed",
"heads", "kv", "mlp"); `axis_rules(parallelism)` maps them onto mesh axes:
  dp:   batch -> data; parameters replicated.
  fsdp: batch -> data; parameters sharded over data along "embed" (ZeRO-3 style), gathered per use by XLA.
  tp:   batch -> data; "heads" and "mlp" -> model (Megatron-style); activations sharded to match.
A parameter dimension that the mesh axis does not divide stays replicated, so odd shapes never fail.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flatlm.config import check_choice
from flatlm.errors import UserError

Rules = tuple[tuple[str, str | None], ...]
PARALLELISM = ("dp", "fsdp", "tp")


@contextlib.contextmanager
def activated(mesh: Mesh, rules: Rules):
    """`mesh` as JAX's current mesh (`jax.set_mesh`) and `rules` as Flax's logical axis rules: what makes the model's
    `nn.with_logical_constraint`s real sharding constraints. The deprecated `with mesh:` sets no abstract mesh, and
    Flax (0.12) then drops every activation constraint silently (tests/test_train.py checks they reach the program)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def mesh_shape(config, num_devices: int) -> tuple[int, int]:
    """(data, model) sizes of the config's mesh; -1 on one axis takes the remaining devices."""
    data, model = int(config.mesh.data), int(config.mesh.model)
    if model <= 0 and data <= 0:
        raise UserError("config.mesh.data and config.mesh.model cannot both be -1")
    if model <= 0:
        model = max(1, num_devices // data)
    if data <= 0:
        data = max(1, num_devices // model)
    return data, model


def validate_config(config, num_devices: int) -> None:
    """Check the `mesh` section against the devices and the batch sizes it must divide (data axis)."""
    check_choice(config.mesh.parallelism, PARALLELISM, "mesh.parallelism")
    data, model = mesh_shape(config, num_devices)
    if data * model > num_devices:
        raise UserError(f"mesh {data}x{model} needs {data * model} devices but only {num_devices} are available; "
                        "lower --config.mesh.data / --config.mesh.model")
    for field, size in batch_sizes(config).items():
        if size % data:
            raise UserError(f"config.{field}={size} is not divisible by the data axis ({data}); "
                            f"use a multiple of {data}")


def batch_sizes(config) -> dict:
    """{config field: size} of the batches the data axis must divide."""
    sizes = {"data.batch_size": config.data.batch_size}
    adv = config.train.adversarial
    if adv.lam > 0 or adv.monitor:
        sizes.update({"train.adversarial.d1_size": adv.d1_size, "train.adversarial.d2_size": adv.d2_size})
    return sizes


def fit_mesh(config, num_devices: int):
    """The config with a mesh that fits `num_devices`, for evaluating a run on other devices than it was trained on
    (a run trained on 8 devices, evaluated on 1): the config itself when its mesh fits, else a copy whose model axis
    is the largest divisor of its own that divides `num_devices`, and whose data axis is the largest that fits the
    rest and divides the batch sizes. Training never does this: it needs its mesh (`validate_config`)."""
    data, model = mesh_shape(config, num_devices)
    sizes = batch_sizes(config).values()
    if data * model <= num_devices and all(s % data == 0 for s in sizes):
        return config
    model = max(m for m in range(1, model + 1) if model % m == 0 and num_devices % m == 0)
    data = max(d for d in range(1, num_devices // model + 1) if all(s % d == 0 for s in sizes))
    config = config.copy_and_resolve_references()
    config.mesh.update(data=data, model=model)
    return config


def axis_rules(parallelism: str) -> Rules:
    """Logical-to-mesh axis rules for "dp", "fsdp" or "tp" (see the module docstring)."""
    base = (("batch", "data"), ("length", None), ("vocab", None), ("kv", None), ("embed_out", None))
    if parallelism == "dp":
        return base + (("embed", None), ("heads", None), ("mlp", None))
    if parallelism == "fsdp":
        return base + (("embed", "data"), ("heads", None), ("mlp", None))
    if parallelism == "tp":
        return base + (("embed", None), ("heads", "model"), ("mlp", "model"))
    raise ValueError(f"unknown parallelism {parallelism!r}")


def make_mesh(config, devices=None) -> Mesh:
    """The ("data", "model") mesh of the config over `devices` (default: all)."""
    devices = list(devices if devices is not None else jax.devices())
    data, model = mesh_shape(config, len(devices))
    grid = np.asarray(devices[: data * model]).reshape(data, model)
    return Mesh(grid, ("data", "model"))


def _fit(spec: PartitionSpec, shape, mesh: Mesh) -> PartitionSpec:
    """Drop mesh axes that do not divide their dimension (that dimension is then replicated)."""
    out = []
    for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = (axis,) if isinstance(axis, str) else tuple(axis or ())
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        out.append(axis if axes and dim % size == 0 else None)
    return PartitionSpec(*out)


def unbox_abstract(boxed_abstract_params):
    """The tree without its `nn.Partitioned` boxes and without a sharding constraint (`nn.unbox` would constrain
    the abstract shapes themselves under an active mesh, which fails: they carry no sharding)."""
    return jax.tree.map(lambda b: b.unbox(apply_constraint=False) if isinstance(b, nn.Partitioned) else b,
                        boxed_abstract_params, is_leaf=lambda b: isinstance(b, nn.Partitioned))


def param_shardings(boxed_abstract_params, mesh: Mesh, rules: Rules):
    """NamedShardings for a (boxed, abstract) parameter tree from its logical axis names."""
    logical = nn.get_partition_spec(boxed_abstract_params)
    mesh_specs = nn.logical_to_mesh(logical, rules)
    shapes = unbox_abstract(boxed_abstract_params)
    return jax.tree.map(
        lambda spec, x: NamedSharding(mesh, _fit(spec, x.shape, mesh)),
        mesh_specs, shapes, is_leaf=lambda s: isinstance(s, PartitionSpec),
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension over the data axis, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec("data"))


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated over the mesh."""
    return NamedSharding(mesh, PartitionSpec())


def global_batch(local_batch: dict, mesh: Mesh) -> dict:
    """Assemble each process's slice of the batch into global arrays sharded over the data axis."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}


def _on_mesh(x) -> bool:
    return isinstance(getattr(x, "sharding", None), NamedSharding)


def mesh_of(tree) -> Mesh | None:
    """The mesh the first mesh-placed leaf of `tree` lives on (restored checkpoints' parameters do), or None."""
    return next((x.sharding.mesh for x in jax.tree.leaves(tree) if _on_mesh(x)), None)


def stacked_spec(spec: PartitionSpec, shape, mesh: Mesh) -> PartitionSpec:
    """The layout of a stack [K, *shape] of copies of a parameter laid out by `spec`: the leading axis unsharded,
    the parameter's own axes kept, and the mesh axes `spec` leaves unused (all of them for a data-parallel,
    replicated parameter) over its largest other dimension they divide. A stack of K copies then costs each device
    K / D copies, not K / (the parameter's own split); a leaf no dimension of which they divide keeps `spec`."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries for a in ((e,) if isinstance(e, str) else (e or ()))}
    free = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
    size = int(np.prod([mesh.shape[a] for a in free])) if free else 1
    dims = [d for d, e in enumerate(entries) if e is None and shape[d] % size == 0 and shape[d] >= size]
    if free and dims:
        d = max(dims, key=lambda d: shape[d])
        entries[d] = free if len(free) > 1 else free[0]
    return PartitionSpec(None, *entries)


def stacked_shardings(params):
    """NamedShardings (a tree like `params`) for stacks [K, *shape] of copies of `params` (`stacked_spec`), or None
    when `params` are off a mesh."""
    mesh = mesh_of(params)
    if mesh is None:
        return None
    return jax.tree.map(lambda p: NamedSharding(mesh, stacked_spec(p.sharding.spec if _on_mesh(p) else PartitionSpec(),
                                                                  p.shape, mesh)), params)


def place_like(params, tree, stacked: bool = False):
    """`tree` (shaped like `params`; with `stacked`, each leaf [K, *shape of the params leaf]: probe stacks) placed as
    `params` is, or for stacks as `stacked_spec` lays them out (each device holds its part of every copy, and the
    mesh axes a parameter does not use split the copies further). A leaf already there stays (no copy), one elsewhere
    (a jitted output XLA laid out its own way) moves there, so a function fed such trees compiles once. Off a mesh,
    `tree` itself; on a mesh spanning several processes only leaves already on its devices move (a reshard of a
    global array), others stay (placing host data there assumes every process holds the same values)."""
    mesh = mesh_of(params)
    if mesh is None:
        return tree
    wants = stacked_shardings(params) if stacked else jax.tree.map(
        lambda p: NamedSharding(mesh, p.sharding.spec) if _on_mesh(p) else replicated(mesh), params)
    return jax.tree.map(move_to, tree, wants)


def move_to(x, want: NamedSharding):
    """`x` in the layout `want`: itself when already there (no copy), else moved there (`jax.device_put`). On a mesh
    spanning several processes only an array already on its devices moves (a reshard of a global array); host data
    stays where it is (placing it there assumes every process holds the same values)."""
    if getattr(x, "sharding", None) == want:
        return x
    if want.mesh.is_multi_process and not (_on_mesh(x) and x.sharding.device_set == want.device_set):
        return x
    return jax.device_put(x, want)


def one_at_a_time(x):
    """`x` (a jitted program's output), waited for when JAX runs on the CPU backend with several devices (simulated
    ones included) or several processes, else as it is (dispatch stays asynchronous on one CPU device, a GPU or a TPU).
    Call it once per iteration of a loop that dispatches programs with collectives. Two ways such loops deadlocked:
    - XLA:CPU (jaxlib 0.10) runs every device's part of a program on one pool of max(cores, devices) threads and lets
      at most 32 computations per device be in flight. A loop that ran ahead filled a device's slots; a program with
      collectives then held the other devices' threads at its rendezvous while its launch on the full device waited
      for a slot only those threads could free, and XLA aborted the process after its 40 s rendezvous timeout
      (`flatlm flatness --preconditioned` on 8 simulated devices: 3 of 8 runs; 40+ independent psums: every run).
    - With several processes, independent programs with cross-process collectives in flight at once (the per-batch
      products of one matvec) ran in another order in each process (2 processes x 4 CPU devices: 4 of 4 runs)."""
    if jax.default_backend() == "cpu" and (jax.process_count() > 1 or jax.local_device_count() > 1):
        return jax.block_until_ready(x)
    return x


def layout(tree) -> tuple | None:
    """The shardings of `tree`'s leaves as a hashable static argument of a jitted function ((treedef, shardings)),
    or None when a leaf is off a mesh; `keep_layout` applies it."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves or not all(_on_mesh(x) for x in leaves):
        return None
    return treedef, tuple(x.sharding for x in leaves)


def keep_layout(tree, layout_: tuple | None):
    """`tree` constrained, inside a jit, to `layout_` (from `layout`; None: unchanged). A function fed back its own
    outputs (an epoch over a carried state) then gets the layout it was compiled for: on a multi-device mesh XLA's
    propagation may pick another for unconstrained outputs, and the second call compiles again."""
    if layout_ is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, jax.tree.unflatten(*layout_))


def replicate_like(params, tree):
    """`tree` with each leaf that is not on a mesh replicated over the mesh of `params` (`tree` itself when `params`
    are on none). A jitted function's outputs carry its inputs' mesh, so a fresh array made off it (a probe, a
    classifier head, an optimizer state) fed back in beside them compiled the function twice, once per layout
    (seconds of every first call on CPU: fine-tuning's epoch, the trace estimators' products). A mesh spanning
    several processes is left alone (placing host data there assumes every process holds the same values)."""
    mesh = mesh_of(params)
    if mesh is None or mesh.is_multi_process:
        return tree
    return jax.tree.map(lambda x: x if _on_mesh(x) else jax.device_put(x, replicated(mesh)), tree)
