"""jax.lax's collectives with jax.lax's signatures and results, computed by jaxcomm.

Each function takes exactly the parameters of its jax.lax namesake (jax 0.10.2 to 0.11;
``tests/test_lax.py`` checks the signatures against the installed jax) and follows its steps
in the same order: which axes count, the constant case of ``psum``, the checks and their
exception types. Each leaf of a pytree then goes through :func:`route.run`: jaxcomm's
collective where it serves the case, jax.lax's otherwise (see route.py for the rules).

Where jax.lax's result depends on how XLA computes (NaN through pmax/pmin, float16 sums,
ppermute numbering over axes out of mesh order), the code below says how jaxcomm gets the
same answer; docs/lax.md lists the cases.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

import jax
import jax.numpy as jnp

from jaxcomm._src import compat, groups
from jaxcomm._src.dropin import route
from jaxcomm._src.ops import alltoall, broadcast, gather, permute, ragged, reduce

lax = compat.jax_lax


def _per_leaf(api: str, x: Any, ours: Callable[[Any], jax.Array], theirs: Callable[[Any], Any],
              keeps_weak: bool = True) -> Any:
    """Each leaf of ``x`` through :func:`route.run`: ``ours(leaf)`` typed weak where jax.lax's
    result is (its result type is its operand's: ``keeps_weak``), else ``theirs(leaf)``."""
    def one(leaf: Any) -> Any:
        return route.run(api, lambda: route.like_lax_weak_type(ours(leaf), leaf, keeps_weak),
                         lambda: theirs(leaf))
    return jax.tree.map(one, x)


def _float16_sum(x: Any) -> None:
    # XLA:CPU's all-reduce adds float16 values in float16, rounding after each addition;
    # jaxcomm's kernel accumulates in float32 and rounds once (bfloat16 sums agree).
    if jnp.asarray(x).dtype == np.float16 and jax.default_backend() == "cpu":
        raise route.Fallback("float16 sums (XLA:CPU rounds after every addition, jaxcomm once)")


# ------------------------------------------------------------------------------ reductions

def psum(x: Any, axis_name: Any, *, axis_index_groups: Any = None) -> Any:
    """``jax.lax.psum``: the sum of ``x`` (a pytree of arrays) over the group.

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
        >>> f = jax.shard_map(lambda v: jaxcomm.lax.psum(v, "x"), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P())
        >>> jax.jit(f)(x)
        Array([28.], dtype=float32)
    """
    axes = compat.skip_size_one_axes(route.axes_of(axis_name))
    if not axes:
        return x
    if not any(compat.is_tracer(leaf) for leaf in jax.tree.leaves(x)):
        # Constants (psum(1, axis) is the axis size): jax.lax scales them, no communication.
        return lax.psum(x, axis_name, axis_index_groups=axis_index_groups)
    return _reduce("psum", "sum", x, axes, axis_index_groups)


def pmean(x: Any, axis_name: Any, *, axis_index_groups: Any = None) -> Any:
    """``jax.lax.pmean``: :func:`psum` divided by the group size, as jax.lax divides."""
    total = psum(x, axis_name, axis_index_groups=axis_index_groups)
    n = lax.psum(1, axis_name, axis_index_groups=axis_index_groups)
    return jax.tree.map(lambda v: v / n, total)


def pmax(x: Any, axis_name: Any, *, axis_index_groups: Any = None) -> Any:
    """``jax.lax.pmax``; NaN is skipped as XLA:CPU skips it (see ``reduce.skip_nan``)."""
    return _reduce("pmax", "max", x, route.axes_of(axis_name), axis_index_groups)


def pmin(x: Any, axis_name: Any, *, axis_index_groups: Any = None) -> Any:
    """``jax.lax.pmin``; NaN is skipped as XLA:CPU skips it (see ``reduce.skip_nan``)."""
    return _reduce("pmin", "min", x, route.axes_of(axis_name), axis_index_groups)


def _reduce(api: str, op: str, x: Any, axes: tuple, index_groups: Any) -> Any:
    # Each leaf is checked on its own (route.run); those jaxcomm serves are then reduced
    # together, small ones sharing calls (reduce.reduce_leaves).
    def ours(leaf: Any) -> route.Served:
        route.check_served(leaf, axes, index_groups, reduction=True, sums=op == "sum")
        if op == "sum":
            _float16_sum(leaf)
        x = reduce.operand(leaf, op)
        groups.normalize_index_groups(f"lax.{api}", index_groups, groups.normalize_axes(f"lax.{api}", axes))
        return route.Served(reduce.skip_nan(x, op))

    leaves, treedef = jax.tree.flatten(x)
    out = [route.run(api, lambda leaf=leaf: ours(leaf),
                     lambda leaf=leaf: getattr(lax, api)(leaf, axes, axis_index_groups=index_groups))
           for leaf in leaves]
    served = [i for i, y in enumerate(out) if isinstance(y, route.Served)]
    reduced = reduce.reduce_leaves([out[i].operand for i in served], axes, op, index_groups, None)
    for i, y in zip(served, reduced):
        # Under check_vma jax.lax's reductions keep the operand's type, weak or not.
        out[i] = route.like_lax_weak_type(y, leaves[i], compat.check_vma_enabled())
    return treedef.unflatten(out)


def psum_scatter(x: Any, axis_name: Any, *, scatter_dimension: int = 0, axis_index_groups: Any = None,
                 tiled: bool = False) -> Any:
    """``jax.lax.psum_scatter``: rank i keeps block i of the sum over the group.

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> x = jax.device_put(jnp.ones((64, 3)), NamedSharding(mesh, P("x")))  # f32[8, 3] per rank
        >>> f = jax.shard_map(lambda v: jaxcomm.lax.psum_scatter(v, "x"), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))       # f32[3] per rank
        >>> np.asarray(jax.jit(f)(x)).reshape(8, 3)[0]
        array([8., 8., 8.], dtype=float32)
    """
    axes = compat.skip_size_one_axes((axis_name,) if not isinstance(axis_name, tuple) else axis_name)
    if not axes:
        return x

    def ours(leaf: Any) -> jax.Array:
        route.check_served(leaf, axes, axis_index_groups, reduction=True, sums=True)
        if jnp.asarray(leaf).dtype == np.bool_:  # jax.lax refuses when lowering
            raise route.definite(TypeError(
                "jaxcomm.lax.psum_scatter: cannot sum bool values (jax.lax.psum_scatter "
                "does not convert them as psum does; cast to an integer type first)"))
        _float16_sum(leaf)
        return reduce.reduce_scatter(leaf, axes, scatter_dimension=scatter_dimension, tiled=tiled,
                                     axis_index_groups=axis_index_groups)

    return _per_leaf("psum_scatter", x, ours, lambda leaf: lax.psum_scatter(
        leaf, axes, scatter_dimension=scatter_dimension, axis_index_groups=axis_index_groups, tiled=tiled))


# ---------------------------------------------------------------------------- data movement

def all_gather(x: Any, axis_name: Any, *, axis_index_groups: Any = None, axis: int = 0,
               tiled: bool = False, to: str = "varying") -> Any:
    """``jax.lax.all_gather``: every rank's ``x`` stacked (or, tiled, concatenated) on ``axis``.

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("x")))  # f32[2] per rank
        >>> f = jax.shard_map(lambda v: jaxcomm.lax.all_gather(v, "x"), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))       # f32[8, 2] per rank
        >>> np.asarray(jax.jit(f)(x)).reshape(8, 8, 2)[5, 3]  # rank 5's row 3
        array([6., 7.], dtype=float32)
    """
    if to not in gather.RESULT_TYPES:
        raise ValueError(f"jaxcomm.lax.all_gather: to={to!r} is not one of {gather.RESULT_TYPES}, "
                         f"the result types jax.lax.all_gather knows")
    axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not axes:
        return x

    def ours(leaf: Any) -> jax.Array:
        if to != "varying" and (axis_index_groups is not None or not compat.check_vma_enabled()):
            # jax.lax refuses these (NotImplementedError; ValueError for "reduced" without
            # check_vma) or, for "invarying" without check_vma, has no type to give.
            raise route.Fallback(f"to={to!r} with axis_index_groups or without check_vma")
        route.check_served(leaf, axes, axis_index_groups)
        return gather.all_gather(leaf, axes, axis=axis, tiled=tiled, axis_index_groups=axis_index_groups,
                                 to=to)

    return _per_leaf("all_gather", x, ours, lambda leaf: lax.all_gather(
        leaf, axis_name, axis_index_groups=axis_index_groups, axis=axis, tiled=tiled, to=to))


def all_to_all(x: Any, axis_name: Any, split_axis: int, concat_axis: int, *,
               axis_index_groups: Any = None, tiled: bool = False) -> Any:
    """``jax.lax.all_to_all``: block j of ``split_axis`` goes to rank j, arriving on ``concat_axis``.

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> x = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("x")))  # f32[8] per rank
        >>> f = jax.shard_map(lambda v: jaxcomm.lax.all_to_all(v, "x", 0, 0, tiled=True),
        ...                   mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        >>> np.asarray(jax.jit(f)(x)).reshape(8, 8)[1]  # what rank 1 received
        array([ 1.,  9., 17., 25., 33., 41., 49., 57.], dtype=float32)
    """
    def ours(leaf: Any) -> jax.Array:
        route.check_served(leaf, route.axes_of(axis_name), axis_index_groups)
        return alltoall.all_to_all(leaf, axis_name, split_axis, concat_axis, tiled=tiled,
                                   axis_index_groups=axis_index_groups)

    # jax.lax's all_to_all drops a weak type.
    return _per_leaf("all_to_all", x, ours, lambda leaf: lax.all_to_all(
        leaf, axis_name, split_axis, concat_axis, axis_index_groups=axis_index_groups, tiled=tiled),
        keeps_weak=False)


def pswapaxes(x: Any, axis_name: Any, axis: int, *, axis_index_groups: Any = None) -> Any:
    """``jax.lax.pswapaxes``: ``all_to_all(x, axis_name, axis, axis)``."""
    return all_to_all(x, axis_name, axis, axis, axis_index_groups=axis_index_groups)


def ppermute(x: Any, axis_name: Any, perm: Sequence[Sequence[int]]) -> Any:
    """``jax.lax.ppermute``: for each ``(source, destination)`` pair, source's ``x`` goes to
    destination; ranks no pair sends to receive zeros.

    Ranks are numbered as jax.lax numbers them: over a tuple of axes given in an order
    other than the mesh's, jax.lax counts each group's devices in mesh order (not in
    ``axis_index`` order); jaxcomm.lax renumbers ``perm`` to match (or raises where the
    installed jax raises for that, ``jax_raise_on_ppermute_sort_diff``).

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
        >>> ring = [(i, (i + 1) % 8) for i in range(8)]         # rank i sends to rank i + 1
        >>> f = jax.shard_map(lambda v: jaxcomm.lax.ppermute(v, "x", ring), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))
        >>> jax.jit(f)(x)
        Array([7., 0., 1., 2., 3., 4., 5., 6.], dtype=float32)
    """
    axes = route.axes_of(axis_name)

    def ours(leaf: Any) -> jax.Array:
        route.check_served(leaf, axes)
        pairs = lax_numbered_perm(perm, groups.normalize_axes("lax.ppermute", axes))
        return permute.ppermute(leaf, axes, pairs)

    return _per_leaf("ppermute", x, ours, lambda leaf: lax.ppermute(leaf, axis_name, perm))


def lax_numbered_perm(perm: Sequence[Sequence[int]], axes: tuple) -> tuple[tuple[int, int], ...]:
    """``perm`` in jax.lax.ppermute's numbering, as jaxcomm ranks (``axis_index`` order).

    Mirrors jax.lax's lowering: indices in ``[-R, R)`` (negative ones count from the end),
    no two pairs with one source or one destination (after wrapping); each group's devices
    counted in mesh order.
    """
    size = groups.axis_size(axes)
    pairs = tuple(tuple(p) for p in perm)
    srcs = [s % size for s, _ in pairs]
    dsts = [d % size for _, d in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise route.definite(ValueError(
            f"jaxcomm.lax.ppermute: perm {pairs} sends from one rank twice or to one rank twice "
            f"(indices taken modulo the group size {size} of axis {groups.describe(axes)})"))
    table = mesh_order_numbering(axes)
    if table is not None and compat.ppermute_rejects_unsorted_groups():
        raise route.definite(RuntimeError(
            f"jaxcomm.lax.ppermute over axes {axes}, in an order other than the mesh's "
            f"{compat.mesh_axis_order()}: the installed jax refuses this "
            f"(jax_raise_on_ppermute_sort_diff); name the axes in mesh order"))
    for s, d in pairs:
        if not (-size <= s < size and -size <= d < size):
            raise route.definite(IndexError(
                f"jaxcomm.lax.ppermute: perm pair ({s}, {d}) is out of range for a group of "
                f"{size} ranks over axis {groups.describe(axes)}"))
    pairs = tuple((s % size, d % size) for s, d in pairs)
    if table is None:
        return pairs
    return tuple((int(table[s]), int(table[d])) for s, d in pairs)


def mesh_order_numbering(axes: tuple) -> np.ndarray | None:
    """For a collective over ``axes``: the ``axis_index`` of the device that jax.lax.ppermute
    numbers j (it sorts each group's device ids, i.e. counts in mesh-axis order), or None
    where the two agree."""
    order = [a for a in compat.mesh_axis_order() if a in axes]
    sizes = [compat.axis_size(a) for a in axes]
    table = np.arange(int(np.prod(sizes))).reshape(sizes).transpose(
        [axes.index(a) for a in order]).reshape(-1)
    return None if (table == np.arange(table.size)).all() else table


def pshuffle(x: Any, axis_name: Any, perm: Sequence[int]) -> Any:
    """``jax.lax.pshuffle``: rank i receives rank ``perm[i]``'s ``x``."""
    if set(perm) != set(range(len(perm))):
        raise ValueError(f"jaxcomm.lax.pshuffle: perm {list(perm)} is not a permutation of "
                         f"0..{len(perm) - 1}")
    return ppermute(x, axis_name, list(zip(perm, range(len(perm)))))


def pbroadcast(x: Any, axis_name: Any, source: int) -> Any:
    """``jax.lax.pbroadcast``: every rank receives rank ``source``'s ``x`` (typed varying).

    jax.lax lowers it on GPU only; this computes it on every platform jaxcomm serves.
    """
    def ours(leaf: Any) -> jax.Array:
        route.check_served(leaf, route.axes_of(axis_name))
        axes = groups.normalize_axes("lax.pbroadcast", route.axes_of(axis_name))
        size = groups.axis_size(axes)
        root = int(source)
        if not -size <= root < size:  # jax.lax indexes the group with source
            raise route.definite(IndexError(
                f"jaxcomm.lax.pbroadcast: source={source} is out of range for a group of "
                f"{size} ranks over axis {groups.describe(axes)}"))
        return broadcast.broadcast_leaf(leaf, axes, root % size, None, None, invariant=False)

    return _per_leaf("pbroadcast", x, ours, lambda leaf: lax.pbroadcast(leaf, axis_name, source))


def ragged_all_to_all(operand: Any, output: Any, input_offsets: Any, send_sizes: Any,
                      output_offsets: Any, recv_sizes: Any, *, axis_name: Any,
                      axis_index_groups: Any = None) -> jax.Array:
    """``jax.lax.ragged_all_to_all`` (see ``jaxcomm.ragged_all_to_all`` for the semantics).

    jax.lax has no CPU implementation; this computes it on every platform jaxcomm serves.
    """
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)

    def ours() -> jax.Array:
        route.check_served(operand, route.axes_of(axis_name), axis_index_groups)
        # jax.lax's own checks, in its order; what jaxcomm checks beyond them jax.lax
        # leaves to the compiler, so asking jax.lax would not tell the mistake.
        ragged.check_indices([jnp.asarray(a) for a in args[2:]])
        groups.normalize_axes("lax.ragged_all_to_all", route.axes_of(axis_name))
        try:
            return ragged.ragged_all_to_all(*args, axis_name=axis_name,
                                            axis_index_groups=axis_index_groups)
        except ValueError as err:
            raise route.definite(err)

    return route.run("ragged_all_to_all", ours, lambda: lax.ragged_all_to_all(
        *args, axis_name=axis_name, axis_index_groups=axis_index_groups))


axis_index = lax.axis_index
axis_size = lax.axis_size

#: The names jaxcomm.lax defines in place of jax.lax's (use_for_lax rebinds these).
COLLECTIVES = compat.LAX_COLLECTIVES
