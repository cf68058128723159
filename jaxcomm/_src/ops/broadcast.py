"""broadcast: every rank receives the root's value. Handler: ffi/cpu/handlers.cc (Broadcast)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax._src.interpreters import ad

from jaxcomm._src import compat, groups, primitive
from jaxcomm._src.ops import common
from jaxcomm._src.ops.reduce import lax_all_reduce, all_reduce_p

# ``invariant``: the result is typed invariant over the group (jaxcomm.broadcast, like
# psum's) or varying (jax.lax.pbroadcast's typing, for jaxcomm.lax).
broadcast_p = primitive.define(primitive.CollectiveSpec(
    name="broadcast",
    out_shape=lambda shape, size, **_: shape,
    invariant_result=lambda invariant, **_: invariant,
    ffi_attrs=lambda root, **_: {"root": root},
    aliases=True,
))


def _broadcast_transpose(ct: Any, x: Any, *, root: int, invariant: bool, **params: Any):
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    # Typed invariant (under check_vma) the result is one value: the root alone produced
    # it. Otherwise each rank's copy is its own value, and the root receives their sum.
    if params["vma_checked"] and invariant:
        total = compat.pvary(ct, params["axes"])
    else:
        total = all_reduce_p.bind(ct, op="sum", **params)
    is_root = groups.rank_in_group(params["axes"], params.get("axis_index_groups")) == root
    return [jnp.where(is_root, total, jnp.zeros_like(total))]


ad.deflinear2(broadcast_p, _broadcast_transpose)


def broadcast(x: Any, axis_name: Any, *, root: int = 0, axis_index_groups: Any = None,
              timeout_s: float | None = None) -> Any:
    """Every member of the group receives rank ``root``'s ``x``.

    The result is typed invariant across the group (like ``psum``'s), so ``out_specs``
    may replicate it. The transpose sends the cotangent back to the root.

    Args:
      x: array, or pytree of arrays (each leaf broadcast on its own).
      axis_name: mesh axis name or tuple of names.
      root: the sending rank, in ``[0, R)``.
      axis_index_groups: groups of axis indices, as in :func:`all_reduce`; each group
        receives its own rank ``root``'s value.

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
        >>> f = jax.shard_map(lambda v: jaxcomm.broadcast(v, "x", root=3), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P())
        >>> jax.jit(f)(x)
        Array([3.], dtype=float32)
    """
    axes = groups.normalize_axes("broadcast", axis_name)
    index_groups = groups.normalize_index_groups("broadcast", axis_index_groups, axes)
    size = groups.group_size(axes, index_groups)
    root = common.as_int("broadcast", "root", root)
    if not 0 <= root < size:
        raise ValueError(f"jaxcomm.broadcast: root={root!r} is out of range for a group of {size} "
                         f"ranks over axis {groups.describe(axes)}")
    return jax.tree.map(lambda leaf: broadcast_leaf(leaf, axes, root, index_groups, timeout_s), x)


def broadcast_leaf(x: Any, axes: tuple, root: int, index_groups: groups.IndexGroups,
                   timeout_s: float | None, *, invariant: bool = True) -> jax.Array:
    """:func:`broadcast` of one array over validated ``axes`` and ``root``; ``invariant=False``
    types the result varying over the group, as ``jax.lax.pbroadcast`` does."""
    x = jnp.asarray(x)
    if common.use_xla("broadcast", x.dtype):
        is_root = groups.rank_in_group(axes, index_groups) == root
        picked = jnp.where(is_root, x, jnp.zeros_like(x))
        total = lax_all_reduce(picked.astype(jnp.int32) if x.dtype == jnp.bool_ else picked,
                               axes, "sum", index_groups).astype(x.dtype)
        if not invariant and compat.check_vma_enabled():
            total = compat.pvary(total, axes)
        return total
    x, params = common.prepare("broadcast", x, axes, timeout_s, index_groups)
    return broadcast_p.bind(x, root=root, invariant=invariant, **params)
