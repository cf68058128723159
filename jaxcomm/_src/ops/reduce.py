"""all_reduce and reduce_scatter: the ops that combine values across the group.

Python primitives here; C++ handlers in ffi/cpu/handlers.cc (AllReduce, ReduceScatter);
the kernels in ffi/cpu/kernels.cc.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from jax._src.interpreters import ad

from jaxcomm._src import compat, groups, primitive
from jaxcomm._src.backends import cpu
from jaxcomm._src.ops import common, gather, table
from jaxcomm._src.ops.gather import all_gather_p

REDUCE_OPS = table.REDUCE_OPS  # {"sum": 0, "prod": 1, "min": 2, "max": 3}
# The dtypes ffi/cpu/kernels.cc reduces; the others go to jax.lax (common.use_xla).
REDUCIBLE_DTYPES = cpu.REDUCIBLE_DTYPES
ALL_REDUCE_OPS = (*REDUCE_OPS, "mean")


def _check_op(name: str, op: str, dtype: np.dtype, allowed: tuple[str, ...]) -> None:
    if op not in allowed:
        raise ValueError(f"jaxcomm.{name}: unknown op {op!r}; expected one of {allowed}")
    if op in ("min", "max") and jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(f"jaxcomm.{name}: op={op!r} is not defined for complex dtype {dtype}")
    if not (jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_):
        raise TypeError(f"jaxcomm.{name}: dtype {dtype} is not supported")
    # Reached with JAXCOMM_BACKEND=jaxcomm (otherwise use_xla hands such a dtype to jax.lax).
    if np.dtype(dtype) not in REDUCIBLE_DTYPES and not common.use_xla(name, dtype):
        raise TypeError(f"jaxcomm.{name}: dtype {np.dtype(dtype).name} has no host reduction kernel; "
                        f"supported: {sorted(d.name for d in REDUCIBLE_DTYPES)} (JAXCOMM_BACKEND="
                        f"jaxcomm refuses to hand it to jax.lax)")


# ------------------------------------------------------------------------------ all_reduce

all_reduce_p = primitive.define(primitive.CollectiveSpec(
    name="all_reduce",
    out_shape=lambda shape, size, **_: shape,
    invariant_result=True,
    ffi_attrs=lambda op, **_: {"reduce_op": table.reduce_code(op)},
    aliases=True,
))


def _all_reduce_jvp(primals: Any, tangents: Any, *, op: str, **params: Any):
    (x,), (t,) = primals, tangents
    y = all_reduce_p.bind(x, op=op, **params)
    if type(t) is ad.Zero:
        return y, ad.Zero.from_primal_value(y)
    if op == "sum":
        return y, all_reduce_p.bind(t, op="sum", **params)
    if op in ("max", "min"):
        # The subgradient that splits the tangent evenly among the ranks that hold the
        # extremum (ties share it), like jnp.max's.
        hit = (x == y).astype(t.dtype)
        num = all_reduce_p.bind(t * hit, op="sum", **params)
        den = all_reduce_p.bind(hit, op="sum", **params)
        return y, num / den
    if op == "prod":
        # d(prod_k x_k) = sum_j t_j * prod_{k != j} x_k, exact also where some x_k == 0.
        gathered = all_gather_p.bind(x[None], **params, axis=0)
        me = groups.rank_in_group(params["axes"], params.get("axis_index_groups"))
        others = jnp.where((jnp.arange(gathered.shape[0]) == me).reshape((-1,) + (1,) * x.ndim),
                           jnp.ones_like(gathered), gathered)
        return y, all_reduce_p.bind(t * jnp.prod(others, axis=0), op="sum", **params)
    raise AssertionError(op)


def _all_reduce_transpose(ct: Any, x: Any, *, op: str, **params: Any):
    if op != "sum":
        raise NotImplementedError(f"jaxcomm.all_reduce(op={op!r}) is not linear; only 'sum' transposes")
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    if params["vma_checked"]:
        # psum with check_vma is variant -> invariant; its transpose is the varying cast,
        # or the reduced cast over axes where the operand was unreduced (as jax.lax's): the
        # cotangent's type, x.aval here, says which.
        partial = compat.reduced(x.aval)
        ct = compat.pvary(ct, tuple(a for a in params["axes"] if a not in partial))
        return [compat.preduced(ct, tuple(a for a in params["axes"] if a in partial))]
    return [all_reduce_p.bind(ct, op="sum", **params)]


ad.primitive_jvps[all_reduce_p] = _all_reduce_jvp
ad.primitive_transposes[all_reduce_p] = _all_reduce_transpose


def all_reduce(x: Any, axis_name: Any, *, op: str = "sum", axis_index_groups: Any = None,
               timeout_s: float | None = None) -> Any:
    """Reduces ``x`` over the group: ``jax.lax.psum``/``pmax``/``pmin``/``pmean`` (and prod).

    Args:
      x: an array of any shape, or a pytree of them (each leaf reduced on its own);
        numeric or bool dtype (bool sums to int32, as in psum).
      axis_name: mesh axis name or tuple of names of the enclosing ``shard_map``.
      op: ``"sum" | "prod" | "min" | "max" | "mean"``.
      axis_index_groups: as in jax.lax: groups of axis indices, each reduced on its own
        (e.g. ``[[0, 1], [2, 3]]`` on an axis of 4); equal sizes, covering the axis once.
      timeout_s: deadline for the ranks to meet (default ``JAXCOMM_TIMEOUT_S``, 300 s).

    Returns:
      Arrays of ``x``'s shapes, equal on every member of the group (``mean`` of an
      integer input is float, as ``x / n`` is). Gradients: ``sum``/``mean`` as jax.lax;
      ``max``/``min`` split the tangent evenly among tied extrema; ``prod`` is exact.
      ``max``/``min`` propagate NaN, as ``jnp.max`` does (``jaxcomm.lax.pmax``/``pmin``
      give jax.lax's answer instead, see :func:`skip_nan`).

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))  # f32[1] per rank
        >>> f = jax.shard_map(lambda v: jaxcomm.all_reduce(v, "x"), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P())
        >>> jax.jit(f)(x)
        Array([28.], dtype=float32)
    """
    leaves, treedef = jax.tree.flatten(x)
    return treedef.unflatten(reduce_leaves(leaves, axis_name, op, axis_index_groups, timeout_s))


#: Leaves of a pytree up to COMBINE_LEAF_BYTES are reduced several per call, concatenated,
#: up to COMBINE_CALL_BYTES a call (as XLA's all-reduce combiner does for jax.lax.psum of a
#: pytree): one meeting of the group instead of one per leaf. Each element is still summed
#: alone, in the same order, so the results are the same bits. With 8 leaves of 32 KiB,
#: 8 devices on 2 loaded cores: 5.1 ms a pmean per leaf, XLA's combined 3.0 ms.
COMBINE_LEAF_BYTES = 256 * 1024
COMBINE_CALL_BYTES = 4 << 20


def operand(x: Any, op: str) -> jax.Array:
    """``x`` as all_reduce reduces it (bool sums as int32); TypeError/ValueError for an op
    or dtype it cannot reduce."""
    x = jnp.asarray(x)
    _check_op("all_reduce", op, x.dtype, ALL_REDUCE_OPS)
    return x.astype(np.int32) if x.dtype == np.bool_ and op in ("sum", "mean") else x


def reduce_leaves(leaves: list, axis_name: Any, op: str, axis_index_groups: Any,
                  timeout_s: float | None) -> list[jax.Array]:
    """:func:`all_reduce` of each of ``leaves``; small ones of one type share a call."""
    arrays = [operand(leaf, op) for leaf in leaves]
    out: list[Any] = [None] * len(arrays)
    for bucket in _buckets(arrays):
        if len(bucket) == 1:
            out[bucket[0]] = _all_reduce(arrays[bucket[0]], axis_name, op, axis_index_groups, timeout_s)
            continue
        flat = jnp.concatenate([arrays[i].reshape(-1) for i in bucket])
        total = _all_reduce(flat, axis_name, op, axis_index_groups, timeout_s)
        start = 0
        for i in bucket:
            out[i] = total[start:start + arrays[i].size].reshape(arrays[i].shape)
            start += arrays[i].size
    return out


def _buckets(arrays: list[jax.Array]) -> list[list[int]]:
    # Leaves share a call when one concatenated operand types like each of them.
    buckets: list[list[int]] = []
    open_: dict[tuple, tuple[list[int], int]] = {}
    for i, a in enumerate(arrays):
        nbytes = a.size * a.dtype.itemsize
        if nbytes == 0 or nbytes > COMBINE_LEAF_BYTES:
            buckets.append([i])
            continue
        aval = jax.typeof(a)
        key = (a.dtype, aval.weak_type, compat.vma(aval), compat.unreduced(aval))
        members, size = open_.get(key, (None, 0))
        if members is None or size + nbytes > COMBINE_CALL_BYTES:
            members, size = [], 0
            buckets.append(members)
        members.append(i)
        open_[key] = (members, size + nbytes)
    return buckets


def _all_reduce(x: jax.Array, axis_name: Any, op: str, axis_index_groups: Any,
                timeout_s: float | None) -> jax.Array:
    if common.use_xla("all_reduce", x.dtype):
        return lax_all_reduce(x, axis_name, op, axis_index_groups)
    x, params = common.prepare("all_reduce", x, axis_name, timeout_s, axis_index_groups,
                               sums=op in ("sum", "mean"))
    y = all_reduce_p.bind(x, op="sum" if op == "mean" else op, **params)
    if op == "mean":
        y = y / groups.group_size(params["axes"], params["axis_index_groups"])
    return y


def skip_nan(x: jax.Array, op: str) -> jax.Array:
    """``x`` with NaN replaced by the identity of ``op`` when it is max or min on the host.

    XLA:CPU's all-reduce (one process) keeps the running extremum unless a value compares
    greater (or less), starting from -inf (+inf): NaN never wins, and a group of NaN only
    gives -inf (+inf). jaxcomm's kernels propagate NaN, as ``jnp.max`` does; applied to the
    operand, this makes them give jax.lax's answer (``jaxcomm.lax.pmax``/``pmin``).
    """
    if op not in ("max", "min") or not jnp.issubdtype(x.dtype, jnp.floating) \
            or jax.default_backend() != "cpu":
        return x
    return jnp.where(jnp.isnan(x), jnp.array(-np.inf if op == "max" else np.inf, x.dtype), x)


def lax_all_reduce(x: jax.Array, axis_name: Any, op: str, axis_index_groups: Any = None) -> jax.Array:
    lax = compat.jax_lax
    if op == "prod" or (axis_index_groups is not None and op in ("sum", "mean")):
        # jax.lax.psum refuses axis_index_groups inside shard_map; a gather does not.
        every = lax.all_gather(x, axis_name, axis_index_groups=axis_index_groups)
        total = jnp.prod(every, axis=0) if op == "prod" else jnp.sum(every, axis=0)
        return total / every.shape[0] if op == "mean" else total
    return {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin,
            "mean": lax.pmean}[op](x, axis_name, axis_index_groups=axis_index_groups)


# -------------------------------------------------------------------------- reduce_scatter

def _reduce_scatter_shape(shape: tuple, size: int, *, scatter_dimension: int, **_: Any) -> tuple:
    out = list(shape)
    out[scatter_dimension] //= size
    return tuple(out)


reduce_scatter_p = primitive.define(primitive.CollectiveSpec(
    name="reduce_scatter",
    out_shape=_reduce_scatter_shape,
    invariant_result=False,
    ffi_attrs=lambda op, scatter_dimension, **_: {"reduce_op": table.reduce_code(op),
                                                   "scatter_dimension": scatter_dimension},
    shift_axes=lambda p: {**p, "scatter_dimension": p["scatter_dimension"] + 1},
    batch_dims=lambda ndim, scatter_dimension, **_: scatter_dimension,
))


def _reduce_scatter_jvp(primals: Any, tangents: Any, *, op: str, **params: Any):
    (x,), (t,) = primals, tangents
    y = reduce_scatter_p.bind(x, op=op, **params)
    if type(t) is ad.Zero:
        return y, ad.Zero.from_primal_value(y)
    if op != "sum":
        raise NotImplementedError(
            f"jaxcomm.reduce_scatter(op={op!r}) has no gradient rule; only op='sum' is differentiable")
    return y, reduce_scatter_p.bind(t, op="sum", **params)


def _reduce_scatter_transpose(ct: Any, x: Any, *, op: str, scatter_dimension: int, **params: Any):
    assert op == "sum"
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    if params["vma_checked"] and compat.reduced(x.aval) & frozenset(params["axes"]):
        # An unreduced operand's cotangent is reduced (jax.lax: all_gather(to="reduced")).
        return [gather.all_gather_reduced(ct, scatter_dimension, params)]
    return [all_gather_p.bind(ct, axis=scatter_dimension, **params)]


ad.primitive_jvps[reduce_scatter_p] = _reduce_scatter_jvp
ad.primitive_transposes[reduce_scatter_p] = _reduce_scatter_transpose


def reduce_scatter(x: Any, axis_name: Any, *, scatter_dimension: int = 0, op: str = "sum",
                   tiled: bool = False, axis_index_groups: Any = None,
                   timeout_s: float | None = None) -> Any:
    """Reduces ``x`` over the group and leaves rank ``i`` the ``i``-th block: ``lax.psum_scatter``.

    Args:
      x: array (or pytree of arrays) with ``x.shape[scatter_dimension]`` equal to the
        group size R (``tiled=False``) or divisible by it (``tiled=True``).
      axis_name: mesh axis name or tuple of names.
      scatter_dimension: the dimension split into R blocks.
      op: ``"sum" | "prod" | "min" | "max"`` (only ``"sum"`` is differentiable).
      tiled: keep the dimension (size divided by R) instead of removing it.
      axis_index_groups: as in :func:`all_reduce`; R is then the size of one group.

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> x = jax.device_put(jnp.ones((64, 3)), NamedSharding(mesh, P("x")))  # f32[8, 3] per rank
        >>> f = jax.shard_map(lambda v: jaxcomm.reduce_scatter(v, "x"), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))       # f32[3] per rank
        >>> np.asarray(jax.jit(f)(x)).reshape(8, 3)[0]
        array([8., 8., 8.], dtype=float32)
    """
    return jax.tree.map(lambda leaf: _reduce_scatter(leaf, axis_name, scatter_dimension, op, tiled,
                                                     axis_index_groups, timeout_s), x)


def _reduce_scatter(x: Any, axis_name: Any, scatter_dimension: int, op: str, tiled: bool,
                    axis_index_groups: Any, timeout_s: float | None) -> jax.Array:
    x = jnp.asarray(x)
    _check_op("reduce_scatter", op, x.dtype, tuple(REDUCE_OPS))
    if x.ndim == 0:
        raise ValueError("jaxcomm.reduce_scatter: the operand must have at least one dimension")
    dim = common.canonical_axis("reduce_scatter", "scatter_dimension", scatter_dimension, x.ndim)
    if x.dtype == np.bool_ and op == "sum":
        x = x.astype(np.int32)
    axes = groups.normalize_axes("reduce_scatter", axis_name)
    index_groups = groups.normalize_index_groups("reduce_scatter", axis_index_groups, axes)
    size = groups.group_size(axes, index_groups)
    n = x.shape[dim]
    if tiled and n % size:
        raise ValueError(f"jaxcomm.reduce_scatter: dimension {dim} of size {n} is not divisible by "
                         f"the group size {size} of axis {groups.describe(axes)}")
    if not tiled and n != size:
        raise ValueError(f"jaxcomm.reduce_scatter: with tiled=False dimension {dim} must equal the "
                         f"group size {size} of axis {groups.describe(axes)}, got {n}")
    if common.use_xla("reduce_scatter", x.dtype):
        if op != "sum":
            y = lax_all_reduce(x, axis_name, op, index_groups)
            blk = n // size
            y = jax.lax.dynamic_slice_in_dim(y, groups.rank_in_group(axes, index_groups) * blk, blk, dim)
            return y if tiled else jnp.squeeze(y, dim)
        return compat.jax_lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=tiled,
                                           axis_index_groups=index_groups)
    x, params = common.prepare("reduce_scatter", x, axis_name, timeout_s, index_groups, sums=op == "sum")
    y = reduce_scatter_p.bind(x, op=op, scatter_dimension=dim, **params)
    return y if tiled else jnp.squeeze(y, dim)
