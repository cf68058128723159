"""Validation and the two call forms (inside shard_map, or global view under jit)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxcomm._src import compat
from jaxcomm._src.moe import dispatch as impl


def _axes(axis_name: Any) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _in_shard_map(axis_name: Any) -> bool:
    return all(compat.axis_exists(a) for a in _axes(axis_name))


def _global_mesh(x: jax.Array, axis_name: Any, op: str):
    """The concrete mesh of the global-view form: jax.set_mesh's, or that of x's sharding.

    Under jit, x's type carries only an abstract mesh, and jaxcomm's lowering needs the
    devices (to map partitions to ranks), hence jax.set_mesh there.
    """
    names = _axes(axis_name)
    candidates = [compat.concrete_mesh()]
    if not isinstance(x, jax.core.Tracer):
        candidates.append(getattr(getattr(x, "sharding", None), "mesh", None))
    for mesh in candidates:
        if mesh is not None and not getattr(mesh, "empty", False) and hasattr(mesh, "devices") \
                and all(a in mesh.axis_names for a in names):
            try:
                mesh.devices
            except ValueError:  # an AbstractMesh
                continue
            return mesh
    raise NameError(f"jaxcomm.moe.{op}: axis {axis_name!r} is not bound by an enclosing shard_map, "
                    f"and no concrete mesh with that axis is in scope: call it inside "
                    f"jax.shard_map, or under `with jax.set_mesh(mesh):` (global view)")


def _group_size_any(axis_name: Any, mesh: Any = None) -> int:
    if mesh is None:
        return impl.group_size(axis_name)
    size = 1
    for a in _axes(axis_name):
        size *= mesh.shape[a]
    return size


def check_inputs(op: str, x: Any, expert_ids: Any, num_experts: int, R: int,
                 capacity: int | None) -> None:
    if x.ndim != 2:
        raise ValueError(f"jaxcomm.moe.{op}: x must be [T, H], got shape {x.shape}")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"jaxcomm.moe.{op}: expert_ids must be [T, K] with T = {x.shape[0]} "
                         f"(x's first dimension), got shape {expert_ids.shape}")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise TypeError(f"jaxcomm.moe.{op}: expert_ids must be integers, got {expert_ids.dtype}")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"jaxcomm.moe.{op}: num_experts must be a positive int, got {num_experts!r}")
    if num_experts % R:
        raise ValueError(f"jaxcomm.moe.{op}: num_experts={num_experts} is not divisible by the "
                         f"{R} ranks of the expert-parallel axis")
    if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool)
                                 or capacity < 1):
        raise ValueError(f"jaxcomm.moe.{op}: capacity must be an int >= 1, got {capacity!r}")


def check_weights(op: str, weights: Any, handle: Any) -> None:
    T, K = handle.layout.T, handle.layout.K
    if weights.ndim != 2 or weights.shape != (T, K):
        raise ValueError(f"jaxcomm.moe.{op}: weights must be [T, K] = [{T}, {K}], got {weights.shape}")


_SCALARS = ("dropped", "invalid", "recv_dropped")


@jax.tree_util.register_pytree_node_class
class Handle:
    """What combine needs from dispatch: routing arrays (pytree leaves) plus static facts.

    Leaves (per rank, inside shard_map; global view: concatenated over ranks on dim 0):
      dropped: i32[] assignments of this rank's tokens dropped for capacity.
      invalid: i32[] expert ids outside [-1, num_experts) (treated as -1).
      recv_dropped: i32[] assignment rows that arrived for this rank's experts past capacity.
      and the transport plan: (dest, pos) slot tables for the fused host transports, or
      (send_tok, slot, offsets, sizes, recv_pos, inv, ...) for the composed one.
    """

    def __init__(self, arrays: dict, axis_name: Any, padded: bool, x_dtype: Any, layout: Any):
        self.arrays = dict(arrays)
        # Static shape facts of the dispatch (impl.Layout): the fused transports' handle
        # has no array whose shape would tell combine the buffer sizes.
        self.layout = layout
        self.axis_name = axis_name
        self.padded = padded
        self.x_dtype = jnp.dtype(x_dtype)

    def __getitem__(self, key: str) -> jax.Array:
        return self.arrays[key]

    @property
    def dropped(self) -> jax.Array:
        return self.arrays["dropped"]

    @property
    def invalid(self) -> jax.Array:
        return self.arrays["invalid"]

    @property
    def recv_dropped(self) -> jax.Array:
        return self.arrays["recv_dropped"]

    def tree_flatten(self):
        keys = tuple(sorted(self.arrays))
        return tuple(self.arrays[k] for k in keys), (keys, self.axis_name, self.padded, self.x_dtype,
                                                       self.layout)

    @classmethod
    def tree_unflatten(cls, aux, children):
        keys, axis_name, padded, x_dtype, layout = aux
        return cls(dict(zip(keys, children)), axis_name, padded, x_dtype, layout)

    def __repr__(self) -> str:
        return f"Handle(axis_name={self.axis_name!r}, padded={self.padded}, keys={sorted(self.arrays)})"


def run_dispatch(op: str, x: Any, expert_ids: Any, num_experts: int, axis_name: Any,
                 capacity: int | None, padded: bool):
    x, expert_ids = jnp.asarray(x), jnp.asarray(expert_ids)
    if _in_shard_map(axis_name):
        R = impl.group_size(axis_name)
        check_inputs(op, x, expert_ids, num_experts, R, capacity)
        T, K = expert_ids.shape
        lay = impl.layout(T, K, num_experts, R, capacity, padded)
        expert_x, sizes, arrays = impl.dispatch(x, expert_ids, lay, axis_name)
        return expert_x, sizes, Handle(arrays, axis_name, padded, x.dtype, lay)
    # Global view: the shard_map form over P(axis_name), every output sharded on dim 0.
    mesh = _global_mesh(x, axis_name, op)
    R = _group_size_any(axis_name, mesh)
    check_inputs(op, x, jnp.asarray(expert_ids), num_experts, R, capacity)
    if x.shape[0] % R:
        raise ValueError(f"jaxcomm.moe.{op}: global x must be [R*T, H] with R = {R}, got {x.shape}")
    spec = P(axis_name)

    def local(a, b):
        ex, sizes, h = run_dispatch(op, a, b, num_experts, axis_name, capacity, padded)
        # Scalars gain a leading dimension so that every handle leaf is sharded on dim 0.
        h.arrays = {k: (v[None] if k in _SCALARS else v) for k, v in h.arrays.items()}
        return ex, sizes, h

    x, expert_ids = _to_spec(mesh, spec, (x, jnp.asarray(expert_ids)))
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=spec)(x, expert_ids)


def _to_spec(mesh: Any, spec: P, tree: Any) -> Any:
    """Shards every leaf on dim 0 over the axis (a no-op for inputs already laid out so)."""
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return jax.tree.map(lambda a: jax.reshard(a, sharding), tree)


def _combine_in_map(op: str, expert_y: jax.Array, handle: Handle, weights: jax.Array) -> jax.Array:
    check_weights(op, weights, handle)
    lay = handle.layout
    rows = lay.rows
    H = expert_y.shape[-1]
    want = (lay.El, rows // lay.El, H) if handle.padded else (rows, H)
    if expert_y.shape != want:
        raise ValueError(f"jaxcomm.moe.{op}: expert_y must have dispatch's expert_x shape {want}, "
                         f"got {expert_y.shape}")
    return impl.combine(expert_y, handle.arrays, weights, lay, handle.axis_name, handle.x_dtype)


def run_combine(op: str, expert_y: Any, handle: Handle, weights: Any) -> jax.Array:
    if not isinstance(handle, Handle):
        raise TypeError(f"jaxcomm.moe.{op}: handle must be the one dispatch returned, got {type(handle)}")
    expert_y, weights = jnp.asarray(expert_y), jnp.asarray(weights)
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(f"jaxcomm.moe.{op}: weights must be floating point, got {weights.dtype}")
    axis_name = handle.axis_name
    if _in_shard_map(axis_name):
        return _combine_in_map(op, expert_y, handle, weights)
    mesh = _global_mesh(expert_y, axis_name, op)
    spec = P(axis_name)

    def local(ey, h, w):
        h.arrays = {k: (v[0] if k in _SCALARS else v) for k, v in h.arrays.items()}
        return _combine_in_map(op, ey, h, w)

    expert_y, handle, weights = _to_spec(mesh, spec, (expert_y, handle, weights))
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(
        expert_y, handle, weights)
