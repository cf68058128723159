"""Shared machinery for defining a jaxcomm collective as a JAX primitive.

Every op is one primitive with: an abstract eval that types the result's varying mesh
axes as jax.lax does; a batching rule (vmap over anything but the collective's own
axes); a lowering to its XLA FFI handler on platforms jaxcomm serves; and, in the op's
module, a transpose rule written with other jaxcomm primitives.

The op modules under ``ops/`` and ``moe/`` describe each op with a :class:`CollectiveSpec`
(:func:`define`), and the op table's local kernels with a :class:`LocalSpec`
(:func:`define_local`): this module is the only one that builds primitives.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import numpy as np

import jax
from jax._src import core
from jax._src.interpreters import batching, mlir

from jaxcomm._src import backends, compat, globalview, groups, partitioning, program, runtime
from jaxcomm._src.ops import table

#: What :func:`define` and :func:`define_local` return.
Primitive = core.Primitive

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
      invariant_result: True when the results are the same on every member of the group
        (all_reduce, broadcast): their type drops the group's axes from the varying set. A
        function of the op's params where that depends on them.
      reduced_result: the results are also typed ``reduced`` over the group's axes (under
        ``check_vma``): jax.lax.all_gather(..., to="reduced"), whose cotangent is unreduced.
      ffi_attrs: the op's own handler attributes, from the params, the operands' avals
        (``avals_in``; ``x_aval`` is the first) and ``group_size``.
      out_shape: one operand, one result: the result shape from the operand shape, the
        group size and the params.
      out_avals: several operands or results, instead of ``out_shape``: the results'
        avals (shape, dtype) from the operands' avals, ``group_size`` and the params.
      multiple_results: the primitive returns a list (as out_avals gives it).
      shift_axes: the params after a batch dimension is inserted in front (vmap; one
        operand).
      batcher: the op's own vmap rule (a fancy batching rule), or a :class:`PerElementVmap`
        (one call per batch element); the default (one operand) moves the batch dimension
        in front and binds with shift_axes's params.
      aliases: True: the result reuses the operand's buffer when the operand is at most
        ``ALIAS_MAX_BYTES`` (see there); a dict: {operand: result} always.
      batch_dims: how many leading dimensions XLA may split over auto mesh axes (in a
        partially manual shard_map): those the op treats independently; None: none.
      handler: the op whose FFI handler it lowers to (the op table's entry); default
        ``name``. Two primitives may share a handler and differ in typing.
      public_name: the name in messages (``jaxcomm.<public_name>``); default ``name``.
      global_view: for a primitive that also runs outside shard_map, on global arrays under
        jit (jaxcomm.moe's global view, globalview.py); None: inside shard_map only.
        Its params carry ``shards``, ``dim0`` and ``mesh`` (0, () and None inside
        shard_map). A call with ``shards`` > 0 binds no axis (its out_avals get
        ``group_size=None``) and lowers to the same primitive on each of the ``shards``
        dim-0 blocks of its operands (split over the mesh axes ``dim0``), every axis bound
        there; ``global_view(params, shards)`` gives a block's params from the global
        call's (e.g. a global row count divided).

    Every spec's primitive lowers on the platforms of the backends the op table lists for
    its handler (ffi/core/op_table.h).
    """

    name: str
    invariant_result: bool | Callable[..., bool]
    ffi_attrs: Callable[..., dict[str, Any]]
    out_shape: Callable[..., tuple[int, ...]] | None = None
    out_avals: Callable[..., Sequence[core.ShapedArray]] | None = None
    multiple_results: bool = False
    shift_axes: Callable[[dict[str, Any]], dict[str, Any]] = lambda params: params
    batcher: Callable[..., Any] | PerElementVmap | None = None
    aliases: bool | dict[int, int] = False
    batch_dims: Callable[..., int] | None = lambda ndim, **_: ndim
    handler: str = ""
    public_name: str = ""
    global_view: Callable[[dict[str, Any], int], dict[str, Any]] | None = None
    reduced_result: bool = False


@dataclasses.dataclass(frozen=True)
class PerElementVmap:
    """A vmap rule for a primitive of any number of operands: one call per batch element,
    in batch order on every rank (for ops that have no dimension a call could treat
    independently, such as jaxcomm.moe's: the routing spans all rows).

    Attributes:
      axis_error: the NotImplementedError's message when the vmap axis is one of the
        op's own axes.
    """

    axis_error: str


@dataclasses.dataclass(frozen=True)
class LocalSpec:
    """A kernel on one device's data, outside any group (the op table's local ops): no
    axes and no call attributes. It lowers to the kernel of each backend the op table
    lists for it, where that backend is available in this process, and to ``reference``
    everywhere else.

    Attributes:
      name: the primitive is ``jaxcomm_<name>``; ``name`` is its op table entry.
      out_avals: the results' avals from the operands' avals.
      reference: the same computation in jax.numpy: the lowering where no kernel serves,
        and the eager implementation.
      batcher: its vmap rule (a plain batching rule: (values, dims) -> (outs, dims)).
      multiple_results: the primitive returns a list.
    """

    name: str
    out_avals: Callable[..., Any]
    reference: Callable[..., Any]
    batcher: Callable[..., Any]
    multiple_results: bool = False


def _outside_shard_map(name: str) -> Callable[..., Any]:
    def impl(*args: Any, **params: Any) -> Any:
        raise NameError(f"jaxcomm.{name} must be called inside jax.shard_map over its axis_name")
    return impl


def define(spec: CollectiveSpec) -> core.Primitive:
    """Creates and registers the primitive described by ``spec``."""
    prim = core.Primitive(f"jaxcomm_{spec.name}")
    prim.multiple_results = spec.multiple_results
    prim.def_impl(_outside_shard_map(spec.public_name or spec.name))

    def abstract_eval(*avals: core.ShapedArray, **params: Any):
        axes = params["axes"]
        on_blocks = _is_global_call(spec, params)
        size = None if on_blocks else groups.group_size(axes, params.get("axis_index_groups"))
        if spec.out_avals is None:
            (x,) = avals
            outs = [x.update(shape=tuple(spec.out_shape(x.shape, size, **_own(params))), weak_type=False)]
        else:
            outs = [o.update(weak_type=False) for o in spec.out_avals(*avals, group_size=size, **_own(params))]
        if on_blocks:  # no axis is bound here: the lowering binds them on each block
            return (outs if spec.multiple_results else outs[0]), set()
        if params["vma_checked"]:
            # Over its axes a result is invariant (the same on every member) or varying;
            # an operand unreduced there (partial sums) is summed, so the result is not.
            invariant = spec.invariant_result
            if callable(invariant):
                invariant = invariant(**_own(params))
            vma = frozenset().union(*(compat.vma(a) for a in avals))
            varying = vma - frozenset(axes) if invariant else vma | frozenset(axes)
            outs = [compat.with_vma(compat.without_unreduced(o, axes), varying) for o in outs]
            if spec.reduced_result:
                outs = [compat.with_reduced(o, axes) for o in outs]
        return (outs if spec.multiple_results else outs[0]), {compat.NamedAxisEffect(a) for a in axes}

    prim.def_effectful_abstract_eval(abstract_eval)
    _register_lowerings(prim, _ffi_lowering(spec, prim), table.op(spec.handler or spec.name).backends)
    if spec.global_view is not None:
        # The global view's lowering hands the devices to custom_partitioning; jax gives a
        # lowering the program's devices only when one of its primitives asks.
        compat.require_devices_at_lowering(prim)
    if isinstance(spec.batcher, PerElementVmap):
        batcher = _per_element_batcher(spec.batcher, prim)
    else:
        batcher = spec.batcher or _batcher(spec, prim)
    batching.fancy_primitive_batchers[prim] = batcher
    return prim


def define_local(spec: LocalSpec) -> core.Primitive:
    """Creates and registers the local-kernel primitive described by ``spec``."""
    prim = core.Primitive(f"jaxcomm_{spec.name}")
    prim.multiple_results = spec.multiple_results
    prim.def_impl(spec.reference)
    prim.def_abstract_eval(spec.out_avals)
    reference = mlir.lower_fun(spec.reference, multiple_results=spec.multiple_results)
    mlir.register_lowering(prim, reference)
    entry = table.op(spec.name)
    for platform in backends.lowering_platforms(entry.backends):
        mlir.register_lowering(prim, functools.partial(_lower_local, entry.target, platform, reference),
                               platform=platform)
    batching.primitive_batchers[prim] = spec.batcher
    return prim


def _lower_local(target: str, platform: str, reference: Callable[..., Any],
                 ctx: mlir.LoweringRuleContext, *args: Any) -> Any:
    # The backend's kernel where this process has the backend; the reference elsewhere.
    backend = backends.for_platform(platform)
    if not backend.available():
        return reference(ctx, *args)
    backend.register()
    return jax.ffi.ffi_lowering(target)(ctx, *args)


def _register_lowerings(prim: core.Primitive, lowering: Callable[..., Any],
                       served_by: Sequence[str] | None = None) -> None:
    """Lowers ``prim`` to jaxcomm's custom call on the platform of every backend in
    ``served_by`` (default: every backend).

    Registered whether or not the backend is available here: where it is not,
    ``ops.common.use_xla`` routes the op to jax.lax before the primitive is ever bound.
    """
    for platform in backends.lowering_platforms(served_by):
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
    the other (auto) axes along its first ``batch_dims`` dimensions (see docs/design.md,
    "Partially manual shard_map").
    """
    entry = table.check_attrs(op, len(operands), attrs)
    serving = [backends.for_platform(p) for p in ctx.module_context.platforms]
    for backend in serving:
        backend.register()
    axis_context = ctx.module_context.axis_context
    axes = params["axes"]
    replica_groups = groups.replica_groups(axis_context, axes, params.get("axis_index_groups"))
    # Each backend readies the groups (links, ids) and numbers the partitions' devices
    # as its handlers do; the call carries the first platform's numbering.
    partition_devices = [b.prepare_lowering(op, replica_groups, axis_context, params["timeout_ms"])
                         for b in serving][0]
    extra = None
    if batch_dims is not None and groups.is_partially_manual(axis_context):
        extra = partitioning.batch_partitioning_attributes(ctx, batch_dims)
    lower = jax.ffi.ffi_lowering(runtime.target_name(entry.name), operand_output_aliases=aliases,
                                 extra_attributes=extra)
    return lower(
        ctx, *operands,
        call_site=program.call_site_attribute(ctx.module_context, params["call_site"]),
        axis=groups.describe(axes),
        timeout_ms=int(params["timeout_ms"]),
        groups=np.asarray(replica_groups, dtype=np.int64).reshape(-1),
        group_size=len(replica_groups[0]),
        partition_devices=partition_devices,
        **attrs,
    )


def _is_global_call(spec: CollectiveSpec, params: dict[str, Any]) -> bool:
    """Whether a call runs on global arrays (CollectiveSpec.global_view)."""
    return spec.global_view is not None and params["shards"] > 0


def _ffi_lowering(spec: CollectiveSpec, prim: core.Primitive) -> Callable[..., Any]:
    def lowering(ctx: mlir.LoweringRuleContext, *args: Any, **params: Any) -> Any:
        if _is_global_call(spec, params):
            return _lower_global_view(spec, prim, ctx, args, params)
        size = len(groups.replica_groups(ctx.module_context.axis_context, params["axes"],
                                         params.get("axis_index_groups"))[0])
        x_aval = ctx.avals_in[0]
        attrs = spec.ffi_attrs(x_aval=x_aval, avals_in=ctx.avals_in, group_size=size, **_own(params))
        if isinstance(spec.aliases, dict):
            aliases = spec.aliases
        else:
            in_place = spec.aliases and x_aval.size * x_aval.dtype.itemsize <= ALIAS_MAX_BYTES
            aliases = {0: 0} if in_place else None
        batch_dims = None if spec.batch_dims is None else spec.batch_dims(x_aval.ndim, **_own(params))
        return lower_collective(ctx, spec.handler or spec.name, list(args), params, attrs,
                                aliases=aliases, batch_dims=batch_dims)
    return lowering


def _lower_global_view(spec: CollectiveSpec, prim: core.Primitive, ctx: mlir.LoweringRuleContext,
                       args: Sequence[Any], params: dict[str, Any]) -> Any:
    """A global call (``params["shards"]`` > 0 dim-0 blocks over the mesh axes
    ``params["dim0"]``): the same primitive on each block, with its axes bound."""
    shards = params["shards"]
    block_params = spec.global_view(dict(params, shards=0, dim0=(), mesh=None), shards)

    def on_block(*blocks: Any) -> list[Any]:
        out = prim.bind(*blocks, **block_params)
        return list(out) if spec.multiple_results else [out]

    def run(*xs: Any) -> Any:
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.avals_out]
        out = globalview.sharded_call(on_block, xs, shapes, shards, params["dim0"], params["mesh"])
        return out if spec.multiple_results else out[0]
    return mlir.lower_fun(run, multiple_results=spec.multiple_results)(ctx, *args)


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


def _per_element_batcher(rule: PerElementVmap, prim: core.Primitive) -> Callable[..., Any]:
    def batcher(axis_data: Any, vals_in: Any, dims_in: Any, **params: Any):
        if axis_data.name in params["axes"]:
            raise NotImplementedError(rule.axis_error)
        # One collective per batch element, in batch order on every rank.
        size = axis_data.size
        vals = [batching.bdim_at_front(v, d, size) for v, d in zip(vals_in, dims_in)]
        outs = [prim.bind(*(v[b] for v in vals), **params) for b in range(size)]
        if prim.multiple_results:
            return [jax.numpy.stack(o) for o in zip(*outs)], [0] * len(outs[0])
        return jax.numpy.stack(outs), 0
    return batcher
