"""Validation and the two call forms (inside shard_map, or global view under jit)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxcomm._src import compat, globalview
from jaxcomm._src.moe import dispatch as impl
from jaxcomm._src.moe import fp8 as fp8_format
from jaxcomm._src.moe import fused


@dataclasses.dataclass(frozen=True)
class DispatchSpec:
    """What a dispatch call asks for, besides its arrays (static: hashable).

    op: the public function's name, for messages. layout: "packed", "padded" or
    "low_latency". capacity: rows (packed) or rows per expert (padded). max_tokens: the
    low-latency layout's declared tokens per rank. fp8: None, "dequantize" or "raw".
    check_ids: raise on an expert id outside [-1, num_experts) instead of counting it.
    """

    op: str
    num_experts: int
    layout: str = "packed"
    capacity: int | None = None
    max_tokens: int | None = None
    fp8: str | None = None
    check_ids: bool = False

    @property
    def padded(self) -> bool:
        return self.layout != "packed"


def _axes(axis_name: Any) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def in_shard_map(axis_name: Any) -> bool:
    return all(compat.axis_exists(a) for a in _axes(axis_name))


def _global_mesh(x: jax.Array, axis_name: Any, op: str):
    """The concrete mesh of the composed transport's global view: jax.set_mesh's, or that
    of x's sharding (eager calls).

    Under jit, x's type carries only an abstract mesh, and the shard_map of the composed
    transport lowers only with the devices, hence jax.set_mesh there. (The fused transports'
    global view takes the devices from the partitioner instead: globalview.py.)
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


def _positive_int(op: str, name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"jaxcomm.moe.{op}: {name} must be an int >= 1, got {value!r}")


def check_inputs(spec: DispatchSpec, x: Any, expert_ids: Any, R: int, T: int) -> None:
    """Trace-time checks of a dispatch's arguments; T: tokens per rank."""
    op, num_experts = spec.op, spec.num_experts
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
    _positive_int(op, "capacity", spec.capacity)
    if spec.layout == "low_latency":
        _positive_int(op, "max_tokens", spec.max_tokens)
        if T > spec.max_tokens:
            raise ValueError(f"jaxcomm.moe.{op}: {T} tokens per rank is more than the declared "
                             f"max_tokens={spec.max_tokens}")
    if spec.fp8 not in impl.FP8_MODES:
        raise ValueError(f"jaxcomm.moe.{op}: fp8 must be None, 'dequantize' or 'raw', got {spec.fp8!r}")
    if spec.fp8 is not None and jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in fp8_format.FP8_DTYPES]:
        raise TypeError(f"jaxcomm.moe.{op}: FP8 dispatch quantizes float32, bfloat16 or float16 "
                        f"tokens, got {x.dtype}")
    # Tokens are combined as weighted sums in x's dtype: a float one.
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"jaxcomm.moe.{op}: x (the tokens) must be floating point, got {x.dtype}")


def make_layout(spec: DispatchSpec, T: int, K: int, R: int) -> impl.Layout:
    return impl.layout(T, K, spec.num_experts, R, spec.capacity, spec.padded,
                       spec.max_tokens if spec.layout == "low_latency" else None)


_SCALARS = fused.COUNTERS


@jax.tree_util.register_pytree_node_class
class Handle:
    """What combine needs from dispatch: routing arrays (pytree leaves) plus static facts.

    Leaves (per rank, inside shard_map; global view: concatenated over ranks on dim 0):
      dropped: i32[] assignments of this rank's tokens dropped for capacity.
      invalid: i32[] expert ids outside [-1, num_experts) (treated as -1).
      recv_dropped: i32[] assignment rows that arrived for this rank's experts past capacity.
      and the transport plan: (dest, pos) slot tables for the fused transports, or
      (send_tok, slot, offsets, sizes, recv_pos, inv, ...) for the composed one.
    """

    def __init__(self, arrays: dict, axis_name: Any, padded: bool, x_dtype: Any, layout: Any,
                 view: tuple | None = None):
        self.arrays = dict(arrays)
        # Global view on the fused transports: (dim-0 blocks, their mesh axes, the mesh); None inside
        # shard_map (and for the composed transport's global view, a shard_map itself).
        self.view = view
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
                                                       self.layout, self.view)

    @classmethod
    def tree_unflatten(cls, aux, children):
        keys, axis_name, padded, x_dtype, layout, view = aux
        return cls(dict(zip(keys, children)), axis_name, padded, x_dtype, layout, view)

    def __repr__(self) -> str:
        return f"Handle(axis_name={self.axis_name!r}, padded={self.padded}, keys={sorted(self.arrays)})"


def run_dispatch(spec: DispatchSpec, x: Any, expert_ids: Any, axis_name: Any):
    x, expert_ids = jnp.asarray(x), jnp.asarray(expert_ids)
    if in_shard_map(axis_name):
        R = impl.group_size(axis_name)
        check_inputs(spec, x, expert_ids, R, x.shape[0])
        lay = make_layout(spec, x.shape[0], expert_ids.shape[1], R)
        expert_x, sizes, arrays = impl.dispatch(x, expert_ids, lay, axis_name, fp8=spec.fp8,
                                                check_ids=spec.check_ids)
        return expert_x, sizes, Handle(arrays, axis_name, spec.padded, x.dtype, lay)
    if not isinstance(x, jax.core.Tracer) and not isinstance(expert_ids, jax.core.Tracer):
        # Eager call on global arrays: the global view is a program of its own.
        return _jit_dispatch(spec, x, expert_ids, axis_name)
    if impl.use_fused(x.dtype):
        return _global_dispatch(spec, x, expert_ids, axis_name)
    return _global_dispatch_shard_map(spec, x, expert_ids, axis_name)


_jit_dispatch = jax.jit(lambda *a: run_dispatch(*a), static_argnums=(0, 3))


def global_layout(spec: DispatchSpec, x: jax.Array, expert_ids: jax.Array, axis_name: Any
                  ) -> tuple[impl.Layout, tuple]:
    """(the per-rank layout, the global view (blocks, dim-0 axes, mesh)) of a dispatch on
    global arrays, the mesh (and dim0, when x's type says) taken from x's sharding (see
    globalview.py); checks the arguments."""
    mesh, dim0, n = globalview.mesh_of(x, _axes(axis_name), spec.op)
    R = _group_size_any(axis_name, mesh)
    check_inputs(spec, x, expert_ids, R, x.shape[0] // n)
    if x.shape[0] % n:
        raise ValueError(f"jaxcomm.moe.{spec.op}: global x must be [{n}*T, H] (dim 0 split over mesh "
                         f"axes {dim0}), got {x.shape}")
    return make_layout(spec, x.shape[0] // n, expert_ids.shape[1], R), (n, dim0, mesh)


def _global_dispatch(spec: DispatchSpec, x: jax.Array, expert_ids: jax.Array, axis_name: Any):
    """The global view on the fused transports: the shard_map form over P(dim0)."""
    lay, view = global_layout(spec, x, expert_ids, axis_name)
    n, dim0, mesh = view
    if impl.use_host_dispatch(x.dtype, lay.R):
        outs = impl.host_dispatch(x, expert_ids, lay, axis_name, fp8=spec.fp8, check_ids=spec.check_ids,
                                  view=view)
        expert_x, sizes, arrays = impl.host_outputs(x, outs, lay, axis_name, fp8=spec.fp8, view=view)
    else:
        expert_x, sizes, arrays = _global_dispatch_planned(spec, x, expert_ids, axis_name, lay, view)
    return (impl.shape_expert_x(expert_x, lay, n), sizes,
            Handle(arrays, axis_name, spec.padded, x.dtype, lay, view=view))


def planned_routing(spec: DispatchSpec, expert_ids: jax.Array, axis_name: Any, lay: impl.Layout,
                    view: tuple | None) -> tuple[dict, jax.Array]:
    """(handle arrays, sizes) of a dispatch on the fused transports whose routing is planned
    in XLA (CUDA): inside shard_map (``view`` None), or on the global view's shards."""
    def plan(ids):
        if spec.check_ids:
            ids = impl.checked_ids(ids, lay.E, axis_name)
        return impl.plan(ids, lay, axis_name, fused=True)

    if view is None:
        return plan(expert_ids)
    n, dim0, mesh = view

    def local(ids):
        h, sizes = plan(ids)
        # Scalars gain a leading dimension so that every handle leaf is sharded on dim 0.
        return [h["dest"], h["pos"], *(h[k][None] for k in _SCALARS), sizes]

    i32 = jnp.int32
    T, K = lay.T, lay.K
    shapes = ([jax.ShapeDtypeStruct((n * T, K), i32)] * 2 + [jax.ShapeDtypeStruct((n,), i32)] * 3
              + [jax.ShapeDtypeStruct((n * lay.El,), i32)])
    dest, pos, *scalars, sizes = globalview.sharded_call(local, [expert_ids], shapes, n, dim0, mesh)
    return dict(dest=dest, pos=pos, **dict(zip(_SCALARS, scalars))), sizes


def _global_dispatch_planned(spec: DispatchSpec, x: jax.Array, expert_ids: jax.Array, axis_name: Any,
                             lay: impl.Layout, view: tuple):
    """The fused transports' global view where the routing is planned in XLA (CUDA)."""
    arrays, sizes = planned_routing(spec, expert_ids, axis_name, lay, view)
    dest, pos = arrays["dest"], arrays["pos"]
    n, dim0, mesh = view
    common = dict(rows=n * lay.rows, shards=n, dim0=dim0, mesh=mesh)
    move = lambda v: fused.transport(impl.gather_mode(lay), v, dest, pos, axis_name, **common)  # noqa: E731
    if spec.fp8 is None:
        return move(x), sizes, arrays
    deliver = lambda q, s: fused.transport(impl.gather_mode(lay, fp8=True), q, dest, pos,  # noqa: E731
                                           axis_name, g=s, out_dtype=x.dtype, **common)
    return impl.fp8_rows(x, spec.fp8, move, deliver=deliver, local=on_shards(view)), sizes, arrays


def on_shards(view: tuple | None) -> Callable:
    """``local(f, *arrays)``: the per-rank function f applied to each dim-0 shard's rows of
    global arrays (the global view ``view``), or to the arrays themselves (shard_map)."""
    if view is None:
        return lambda f, *arrays: f(*arrays)
    n, dim0, mesh = view

    def local(f, *arrays):
        outs = jax.eval_shape(f, *(jax.ShapeDtypeStruct((a.shape[0] // n, *a.shape[1:]), a.dtype)
                                   for a in arrays))
        shapes = [jax.ShapeDtypeStruct((o.shape[0] * n, *o.shape[1:]), o.dtype) for o in outs]
        return tuple(globalview.sharded_call(lambda *a: list(f(*a)), list(arrays), shapes, n, dim0, mesh))
    return local


def _global_dispatch_shard_map(spec: DispatchSpec, x: jax.Array, expert_ids: jax.Array, axis_name: Any):
    """The global view on the composed transport (jax.lax collectives or ragged_all_to_all):
    a shard_map over P(axis_name), which needs a concrete mesh (jax.set_mesh)."""
    mesh = _global_mesh(x, axis_name, spec.op)
    R = _group_size_any(axis_name, mesh)
    check_inputs(spec, x, expert_ids, R, x.shape[0] // R)
    if x.shape[0] % R:
        raise ValueError(f"jaxcomm.moe.{spec.op}: global x must be [R*T, H] with R = {R}, got {x.shape}")
    pspec = P(axis_name)

    def local(a, b):
        ex, sizes, h = run_dispatch(spec, a, b, axis_name)
        h.arrays = {k: (v[None] if k in _SCALARS else v) for k, v in h.arrays.items()}
        return ex, sizes, h

    x, expert_ids = _to_spec(mesh, pspec, (x, expert_ids))
    return jax.shard_map(local, mesh=mesh, in_specs=(pspec, pspec), out_specs=pspec)(x, expert_ids)


def _to_spec(mesh: Any, spec: P, tree: Any) -> Any:
    """Shards every leaf on dim 0 over the axis (a no-op for inputs already laid out so)."""
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return jax.tree.map(lambda a: jax.reshard(a, sharding), tree)


def check_combine_shapes(op: str, expert_y: jax.Array, weights: jax.Array, handle: Handle,
                         n: int = 1) -> None:
    """weights [n*T, K] and expert_y shaped as dispatch's expert_x (n: global-view blocks)."""
    lay = handle.layout
    if weights.ndim != 2 or weights.shape != (n * lay.T, lay.K):
        raise ValueError(f"jaxcomm.moe.{op}: weights must be [T, K] = [{n * lay.T}, {lay.K}], "
                         f"got {weights.shape}")
    H = expert_y.shape[-1]
    want = (n * lay.El, lay.slab, H) if handle.padded else (n * lay.rows, H)
    if expert_y.shape != want:
        raise ValueError(f"jaxcomm.moe.{op}: expert_y must have dispatch's expert_x shape {want}, "
                         f"got {expert_y.shape}")


def _combine_in_map(op: str, expert_y: jax.Array, handle: Handle, weights: jax.Array) -> jax.Array:
    check_combine_shapes(op, expert_y, weights, handle)
    lay = handle.layout
    return impl.combine(expert_y, handle.arrays, weights, lay, handle.axis_name, handle.x_dtype)


def check_combine_args(op: str, expert_y: Any, handle: Any, weights: Any) -> tuple[jax.Array, jax.Array]:
    if not isinstance(handle, Handle):
        raise TypeError(f"jaxcomm.moe.{op}: handle must be the one dispatch returned, got {type(handle)}")
    expert_y, weights = jnp.asarray(expert_y), jnp.asarray(weights)
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(f"jaxcomm.moe.{op}: weights must be floating point, got {weights.dtype}")
    return expert_y, weights


def run_combine(op: str, expert_y: Any, handle: Handle, weights: Any) -> jax.Array:
    expert_y, weights = check_combine_args(op, expert_y, handle, weights)
    axis_name = handle.axis_name
    if in_shard_map(axis_name):
        return _combine_in_map(op, expert_y, handle, weights)
    if handle.view is not None:
        return _global_combine(op, expert_y, handle, weights)
    mesh = _global_mesh(expert_y, axis_name, op)
    spec = P(axis_name)

    def local(ey, h, w):
        h.arrays = {k: (v[0] if k in _SCALARS else v) for k, v in h.arrays.items()}
        return _combine_in_map(op, ey, h, w)

    expert_y, handle, weights = _to_spec(mesh, spec, (expert_y, handle, weights))
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(
        expert_y, handle, weights)


def _global_combine(op: str, expert_y: jax.Array, handle: Handle, weights: jax.Array) -> jax.Array:
    n, dim0, mesh = handle.view
    lay = handle.layout
    check_combine_shapes(op, expert_y, weights, handle, n)
    ey = expert_y.reshape(n * lay.rows, expert_y.shape[-1])
    return fused.transport(fused.REDUCE, ey, handle["dest"], handle["pos"], handle.axis_name,
                           w=weights, out_dtype=handle.x_dtype, shards=n, dim0=dim0, mesh=mesh)
