"""Shared machinery for defining a jaxcomm collective as a JAX primitive.

Every op is one primitive with: an abstract eval that types the result's varying mesh
axes as jax.lax does; a batching rule (vmap over anything but the collective's own
axes); a lowering to its XLA FFI handler on platforms jaxcomm serves; and, in the op's
module, a transpose rule written with other jaxcomm primitives.

The op modules under ``ops/`` describe each op with a :class:`CollectiveSpec`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

import jax
from jax._src import core
from jax._src.interpreters import batching, mlir

from jaxcomm._src import compat, groups, partitioning, runtime, transport

# Params every collective primitive carries, besides the op's own. ``axis_index_groups``
# (None, or groups.IndexGroups) may be absent where a primitive's params are built by hand.
COMMON_PARAMS = ("axes", "axis_index_groups", "call_site", "timeout_ms", "vma_checked")


# A result that reuses its operand's buffer makes XLA copy the operand first whenever the
# operand stays live or is a jit argument that was not donated. For small operands the
# reuse wins: a fori_loop carries the result in place instead of copying it back each
# iteration. For large ones the copy dominates (16 MiB all_reduce across 2 processes:
# 2.3 ms with the copy, 1.7 ms without), and a separate result costs only memory, as
# jax.lax.psum's does. The lowering sees only the operand's type (jax lowers each
# primitive once per type, in a function of its own), so the size decides.
ALIAS_MAX_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class CollectiveSpec:
    """What distinguishes one collective primitive from another.

    Attributes:
      name: the primitive's name is ``jaxcomm_<name>``.
      out_shape: the result shape from the operand shape, the group size and the params.
      invariant_result: True when the result is the same on every member of the group
        (all_reduce, broadcast): its type drops the group's axes from the varying set. A
        function of the op's params where that depends on them.
      ffi_attrs: the op's own handler attributes, from the params.
      shift_axes: the params after a batch dimension is inserted in front (vmap).
      aliases: whether the result reuses the operand's buffer when the operand is at most
        ``ALIAS_MAX_BYTES`` (see there).
      batch_dims: how many leading dimensions XLA may split over auto mesh axes (in a
        partially manual shard_map): those the op treats independently.
      handler: the op whose FFI handler it lowers to (target ``jaxcomm_<handler>``);
        default ``name``. Two primitives may share a handler and differ in typing.
    """

    name: str
    out_shape: Callable[..., tuple[int, ...]]
    invariant_result: bool | Callable[..., bool]
    ffi_attrs: Callable[..., dict[str, Any]]
    shift_axes: Callable[[dict[str, Any]], dict[str, Any]] = lambda params: params
    aliases: bool = False
    batch_dims: Callable[..., int] = lambda ndim, **_: ndim
    handler: str = ""


def _outside_shard_map(name: str) -> Callable[..., Any]:
    def impl(*args: Any, **params: Any) -> Any:
        raise NameError(f"jaxcomm.{name} must be called inside jax.shard_map over its axis_name")
    return impl


def define(spec: CollectiveSpec) -> core.Primitive:
    """Creates and registers the primitive described by ``spec``."""
    prim = core.Primitive(f"jaxcomm_{spec.name}")
    prim.def_impl(_outside_shard_map(spec.name))

    def abstract_eval(x: core.ShapedArray, **params: Any):
        axes = params["axes"]
        size = groups.group_size(axes, params.get("axis_index_groups"))
        shape = spec.out_shape(x.shape, size, **_own(params))
        out = x.update(shape=tuple(shape), weak_type=False)
        if params["vma_checked"]:
            # Over its axes the result is invariant (the same on every member) or varying;
            # an operand unreduced there (partial sums) is summed, so the result is not.
            invariant = spec.invariant_result
            if callable(invariant):
                invariant = invariant(**_own(params))
            varying = compat.vma(x) - frozenset(axes) if invariant else compat.vma(x) | frozenset(axes)
            out = compat.with_vma(compat.without_unreduced(out, axes), varying)
        return out, {compat.NamedAxisEffect(a) for a in axes}

    prim.def_effectful_abstract_eval(abstract_eval)
    register_lowerings(prim, _ffi_lowering(spec))
    batching.fancy_primitive_batchers[prim] = _batcher(spec, prim)
    return prim


def register_lowerings(prim: core.Primitive, lowering: Callable[..., Any]) -> None:
    """Lowers ``prim`` to jaxcomm's custom call on every platform jaxcomm has handlers for.

    The CUDA lowering is registered unconditionally: where the CUDA handlers are absent,
    ``ops.common.use_xla`` routes the op to jax.lax before the primitive is ever bound.
    """
    for platform in ("cpu", "cuda"):
        mlir.register_lowering(prim, lowering, platform=platform)


def _own(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k not in COMMON_PARAMS}


def lower_collective(ctx: mlir.LoweringRuleContext, op: str, operands: Sequence[Any],
                     params: dict[str, Any], attrs: dict[str, Any],
                     aliases: dict[int, int] | None = None,
                     batch_dims: int | None = None) -> Any:
    """Emits the custom call of jaxcomm op ``op`` with the attributes every handler binds.

    The handler receives ``operands``, then the common attributes (call_site, axis,
    timeout_ms, groups, group_size, partition_devices) and the op's own ``attrs``; it
    finds its rank from its device ordinal. See ffi/cpu/launch.h for the C++ side.

    In a shard_map that is manual over only some mesh axes, XLA partitions the call over
    the other (auto) axes along its first ``batch_dims`` dimensions (see DESIGN.md).
    """
    platforms = tuple(ctx.module_context.platforms)
    runtime.ensure_registered_for(platforms)
    axis_context = ctx.module_context.axis_context
    axes = params["axes"]
    replica_groups = groups.replica_groups(axis_context, axes, params.get("axis_index_groups"))
    if "cpu" in platforms:
        peers = groups.peer_processes(axis_context, replica_groups)
        if peers:
            transport.ensure_linked(peers)
    partition_devices = groups.partition_devices(axis_context, platforms[0])
    if "cuda" in platforms:
        # The groups' routes across processes, and every partition's local ordinal as all
        # processes name it (ffi/cuda/routes.h).
        from jaxcomm._src import cuda_runtime
        cuda_devices = cuda_runtime.prepare_lowering(op, replica_groups, axis_context, params["timeout_ms"])
        if platforms[0] == "cuda":
            partition_devices = cuda_devices
    extra = None
    if batch_dims is not None and groups.is_partially_manual(axis_context):
        extra = partitioning.batch_partitioning_attributes(ctx, batch_dims)
    lower = jax.ffi.ffi_lowering(runtime.target_name(op), operand_output_aliases=aliases,
                                 extra_attributes=extra)
    return lower(
        ctx, *operands,
        call_site=params["call_site"],
        axis=groups.describe(axes),
        timeout_ms=int(params["timeout_ms"]),
        groups=np.asarray(replica_groups, dtype=np.int64).reshape(-1),
        group_size=len(replica_groups[0]),
        partition_devices=partition_devices,
        **attrs,
    )


def _ffi_lowering(spec: CollectiveSpec) -> Callable[..., Any]:
    def lowering(ctx: mlir.LoweringRuleContext, x: Any, **params: Any) -> Any:
        size = len(groups.replica_groups(ctx.module_context.axis_context, params["axes"],
                                         params.get("axis_index_groups"))[0])
        x_aval = ctx.avals_in[0]
        attrs = spec.ffi_attrs(x_aval=x_aval, group_size=size, **_own(params))
        in_place = spec.aliases and x_aval.size * x_aval.dtype.itemsize <= ALIAS_MAX_BYTES
        return lower_collective(ctx, spec.handler or spec.name, [x], params, attrs,
                                aliases={0: 0} if in_place else None,
                                batch_dims=spec.batch_dims(ctx.avals_in[0].ndim, **_own(params)))
    return lowering


def _batcher(spec: CollectiveSpec, prim: core.Primitive) -> Callable[..., Any]:
    def batcher(axis_data: Any, vals_in: Any, dims_in: Any, **params: Any):
        (x,), (d,) = vals_in, dims_in
        if axis_data.name in params["axes"]:
            raise NotImplementedError(
                f"jaxcomm.{spec.name} over the vmap axis {axis_data.name!r}: jaxcomm collectives "
                f"run over shard_map mesh axes; use the jax.lax collective for a vmap axis_name.")
        if d is None or d is getattr(batching, "not_mapped", None):
            return prim.bind(x, **params), getattr(batching, "not_mapped", None)
        x = jax.numpy.moveaxis(x, d, 0)
        return prim.bind(x, **spec.shift_axes(params)), 0
    return batcher
