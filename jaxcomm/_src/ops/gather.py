"""all_gather: every rank receives every rank's block. Handler: ffi/cpu/handlers.cc (AllGather)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.interpreters import ad

from jaxcomm._src import compat, groups, primitive
from jaxcomm._src.ops import common


def _gather_shape(shape: tuple, size: int, *, axis: int, **_: Any) -> tuple:
    out = list(shape)
    out[axis] *= size
    return tuple(out)


# The primitive always gathers "tiled" along an existing dimension; the untiled form
# inserts a size-1 dimension first, which has the same memory layout.
ALL_GATHER = primitive.CollectiveSpec(
    name="all_gather",
    out_shape=_gather_shape,
    invariant_result=False,
    ffi_attrs=lambda axis, **_: {"axis_index": axis},
    shift_axes=lambda p: {**p, "axis": p["axis"] + 1},
    batch_dims=lambda ndim, axis, **_: axis,
)
all_gather_p = primitive.define(ALL_GATHER)


def _all_gather_transpose(ct: Any, x: Any, *, axis: int, **params: Any):
    from jaxcomm._src.ops.reduce import reduce_scatter_p  # the two transpose into each other
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    return [reduce_scatter_p.bind(ct, op="sum", scatter_dimension=axis, **params)]


ad.deflinear2(all_gather_p, _all_gather_transpose)

# The same gather typed invariant over the group's axes (every member holds the whole
# result): jax.lax.all_gather(..., to="invarying"). Its transpose takes this rank's block of
# the (invariant) cotangent: no communication.
all_gather_invariant_p = primitive.define(dataclasses.replace(
    ALL_GATHER, name="all_gather_invariant", handler="all_gather", invariant_result=True))


def _all_gather_invariant_transpose(ct: Any, x: Any, *, axis: int, **params: Any):
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    block = x.aval.shape[axis]
    rank = groups.rank_in_group(params["axes"], params.get("axis_index_groups"))
    return [jax.lax.dynamic_slice_in_dim(ct, rank * block, block, axis)]


ad.deflinear2(all_gather_invariant_p, _all_gather_invariant_transpose)


# The gather typed reduced over the group's axes: jax.lax.all_gather(..., to="reduced").
# Its cotangent is unreduced there (partial sums), and may be unreduced over other axes too
# (an operand already reduced over them: FSDP's parameters), so its transpose is a
# reduce-scatter of the partial sums, as jax.lax's (unreduced_psum_scatter), not a slice of
# an all-reduced cotangent (jax has no unreduced rule for dynamic_slice).
all_gather_reduced_p = primitive.define(dataclasses.replace(
    ALL_GATHER, name="all_gather_reduced", handler="all_gather", invariant_result=True,
    reduced_result=True))
ad.deflinear2(all_gather_reduced_p, _all_gather_transpose)


def all_gather_reduced(x: jax.Array, axis: int, params: dict[str, Any]) -> jax.Array:
    """all_gather(to="reduced") of a prepared operand (tiled along ``axis``)."""
    if not params["vma_checked"]:  # no types to give: every member holds the whole result
        return all_gather_invariant_p.bind(x, axis=axis, **params)
    return all_gather_reduced_p.bind(x, axis=axis, **params)


#: all_gather's ``to``: the result's type over the group's axes, as in jax.lax.
RESULT_TYPES = ("varying", "invarying", "reduced")


def all_gather(x: Any, axis_name: Any, *, axis: int = 0, tiled: bool = False,
               axis_index_groups: Any = None, to: str = "varying",
               timeout_s: float | None = None) -> Any:
    """Gathers ``x`` from every rank of the group: ``jax.lax.all_gather``.

    Args:
      x: array of any shape and dtype (scalars only with ``tiled=False``), or a pytree
        of them (each leaf gathered on its own).
      axis_name: mesh axis name or tuple of names.
      axis: where the group dimension goes (``tiled=False``: a new dimension of size R
        inserted at ``axis``; ``tiled=True``: dimension ``axis`` grows R-fold).
      axis_index_groups: as in jax.lax: groups of axis indices, each gathered on its own,
        in the order listed (equal sizes, covering the axis once).
      to: the result's type over the group's axes (under ``check_vma``), as in jax.lax:
        ``"varying"`` (transposes to reduce_scatter), ``"invarying"`` (every member holds
        one value; transposes to taking this rank's block) or ``"reduced"``.

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("x")))  # f32[2] per rank
        >>> f = jax.shard_map(lambda v: jaxcomm.all_gather(v, "x"), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))       # f32[8, 2] per rank
        >>> np.asarray(jax.jit(f)(x)).reshape(8, 8, 2)[5, 3]  # rank 5's row 3
        array([6., 7.], dtype=float32)
    """
    if to not in RESULT_TYPES:
        raise ValueError(f"jaxcomm.all_gather: to={to!r} is not one of {RESULT_TYPES}")
    return jax.tree.map(lambda leaf: _all_gather(leaf, axis_name, axis, tiled, axis_index_groups,
                                                 to, timeout_s), x)


def _all_gather(x: Any, axis_name: Any, axis: int, tiled: bool, axis_index_groups: Any, to: str,
                timeout_s: float | None) -> jax.Array:
    x = jnp.asarray(x)
    if tiled:
        if x.ndim == 0:
            raise ValueError("jaxcomm.all_gather: tiled=True needs an operand with a dimension")
        dim = common.canonical_axis("all_gather", "axis", axis, x.ndim)
    else:
        dim = common.canonical_axis("all_gather", "axis", axis, x.ndim + 1, rank=x.ndim)
    if common.use_xla("all_gather", x.dtype):
        axes = groups.normalize_axes("all_gather", axis_name)
        return compat.jax_lax.all_gather(x, axis_name, axis=dim, tiled=tiled, to=to, axis_index_groups=
                                         groups.normalize_index_groups("all_gather", axis_index_groups, axes))
    x, params = common.prepare("all_gather", x, axis_name, timeout_s, axis_index_groups)
    if not tiled:
        x = jnp.expand_dims(x, dim)
    if to == "reduced":
        return all_gather_reduced(x, dim, params)
    return (all_gather_p if to == "varying" else all_gather_invariant_p).bind(x, axis=dim, **params)
