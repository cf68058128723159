"""ppermute: point-to-point send/recv pairs. Handler: ffi/cpu/handlers.cc (Permute)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax._src.interpreters import ad

from jaxcomm._src import compat, groups, primitive
from jaxcomm._src.ops import common


def _sources(perm: tuple, size: int) -> list[int]:
    src = [-1] * size
    for s, d in perm:
        src[d] = s
    return src


ppermute_p = primitive.define(primitive.CollectiveSpec(
    name="ppermute",
    out_shape=lambda shape, size, **_: shape,
    invariant_result=False,
    ffi_attrs=lambda perm, group_size, **_: {
        "sources": np.asarray(_sources(perm, group_size), dtype=np.int64)},
))


def _ppermute_transpose(ct: Any, x: Any, *, perm: tuple, **params: Any):
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    return [ppermute_p.bind(ct, perm=tuple((d, s) for s, d in perm), **params)]


ad.deflinear2(ppermute_p, _ppermute_transpose)


def validate_perm(op: str, perm: Sequence[Sequence[int]], size: int) -> tuple[tuple[int, int], ...]:
    """``perm`` as a tuple of (source, destination) pairs, checked against the group size."""
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise TypeError(f"jaxcomm.{op}: perm must be a sequence of (source, destination) pairs, "
                        f"got {perm!r}") from None
    for s, d in pairs:
        if not (0 <= s < size and 0 <= d < size):
            raise ValueError(f"jaxcomm.{op}: perm pair ({s}, {d}) is out of range for a group of "
                             f"{size} ranks")
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"jaxcomm.{op}: perm {pairs} is not a permutation: a rank appears twice as "
                         f"a source or twice as a destination")
    return pairs


def ppermute(x: Any, axis_name: Any, perm: Sequence[Sequence[int]], *,
             axis_index_groups: Any = None, timeout_s: float | None = None) -> Any:
    """Sends ``x`` from rank ``s`` to rank ``d`` for each pair in ``perm``: ``jax.lax.ppermute``.

    Ranks that no pair sends to receive zeros. Ranks are numbered as ``lax.axis_index``
    numbers them (over a tuple of axes, the first axis is the major one).

    Args:
      x: array, or pytree of arrays (each leaf sent on its own).
      axis_name: mesh axis name or tuple of names.
      perm: (source, destination) pairs of ranks in ``[0, R)``.
      axis_index_groups: groups of axis indices (equal sizes, covering the axis once);
        ``perm`` then applies within each group, in its ranks (jax.lax has no such
        parameter for ppermute; this is the same ``perm`` expanded over the groups).

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
        >>> ring = [(i, (i + 1) % 8) for i in range(8)]         # rank i sends to rank i + 1
        >>> f = jax.shard_map(lambda v: jaxcomm.ppermute(v, "x", ring), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))
        >>> jax.jit(f)(x)
        Array([7., 0., 1., 2., 3., 4., 5., 6.], dtype=float32)
    """
    axes = groups.normalize_axes("ppermute", axis_name)
    index_groups = groups.normalize_index_groups("ppermute", axis_index_groups, axes)
    pairs = validate_perm("ppermute", perm, groups.group_size(axes, index_groups))
    if index_groups:
        pairs = tuple((g[s], g[d]) for g in index_groups for s, d in pairs)
    return jax.tree.map(lambda leaf: _ppermute(leaf, axis_name, pairs, timeout_s), x)


def _ppermute(x: Any, axis_name: Any, pairs: tuple[tuple[int, int], ...],
              timeout_s: float | None) -> jax.Array:
    x = jnp.asarray(x)
    if common.use_xla("ppermute", x.dtype):
        return compat.jax_lax.ppermute(x, axis_name, pairs)
    x, params = common.prepare("ppermute", x, axis_name, timeout_s)
    return ppermute_p.bind(x, perm=pairs, **params)
