"""Mesh axis names -> group size and replica groups (pure Python, no I/O).

A collective over axes ``A`` runs one group per combination of the other mesh axes; rank
``r`` of a group is the device whose ``lax.axis_index(A)`` is ``r``. ``axis_index_groups``
(as in jax.lax) splits each such group further: index group ``[i0, i1, ...]`` makes the
devices at axis indices i0, i1, ... one group, ranked in that order.
"""

from __future__ import annotations

import operator
from typing import Any, Hashable, Sequence

import numpy as np

import jax
import jax.numpy as jnp

from jaxcomm._src import compat

AxisName = Hashable | tuple[Hashable, ...]
#: Normalized ``axis_index_groups``: None, or equal-size tuples covering the axis once.
IndexGroups = tuple[tuple[int, ...], ...] | None


def normalize_axes(op: str, axis_name: AxisName) -> tuple:
    """``axis_name`` as a non-empty tuple of names bound by the enclosing shard_map.

    Raises NameError naming the op and the axes in scope when a name is unknown.
    """
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not axes:
        raise ValueError(f"jaxcomm.{op}: axis_name must name at least one mesh axis")
    if len(set(axes)) != len(axes):
        raise ValueError(f"jaxcomm.{op}: axis_name {axes} repeats an axis")
    for name in axes:
        if isinstance(name, int):
            raise TypeError(f"jaxcomm.{op}: axis_name must be mesh axis names, got the integer {name}")
        if not compat.axis_exists(name):
            raise NameError(
                f"jaxcomm.{op}: unknown axis name {name!r}. jaxcomm collectives run inside "
                f"jax.shard_map, over the mesh axes it binds.")
        if name not in compat.mesh_axis_names():
            raise NotImplementedError(
                f"jaxcomm.{op} over the vmap axis {name!r}: jaxcomm collectives run over "
                f"shard_map mesh axes; use the jax.lax collective for a vmap axis_name.")
    return axes


def axis_size(axes: tuple) -> int:
    """Number of devices along ``axes`` (the group size without ``axis_index_groups``)."""
    size = 1
    for name in axes:
        size *= compat.axis_size(name)
    return size


def group_size(axes: tuple, index_groups: IndexGroups = None) -> int:
    """Number of ranks in each group of a collective over ``axes``."""
    return len(index_groups[0]) if index_groups else axis_size(axes)


def normalize_index_groups(op: str, index_groups: Sequence[Sequence[int]] | None,
                           axes: tuple) -> IndexGroups:
    """``axis_index_groups`` as tuples, checked against the size of ``axes``.

    Raises ValueError unless the groups cover the axis indices exactly once (jax.lax's
    rule) and have one size (jaxcomm's handlers serve equal groups only).
    """
    if index_groups is None:
        return None
    try:
        out = tuple(tuple(operator.index(i) for i in g) for g in index_groups)
    except TypeError:
        raise TypeError(f"jaxcomm.{op}: axis_index_groups must be a sequence of sequences of "
                        f"integers, got {index_groups!r}") from None
    n = axis_size(axes)
    if sorted(i for g in out for i in g) != list(range(n)):
        raise ValueError(f"jaxcomm.{op}: axis_index_groups {out} must cover the indices 0..{n - 1} "
                         f"of axis {describe(axes)} exactly once")
    if len({len(g) for g in out}) != 1:
        raise ValueError(f"jaxcomm.{op}: axis_index_groups {out} must all have the same size")
    return out


def rank_in_group(axes: tuple, index_groups: IndexGroups = None) -> jax.Array:
    """This device's rank in its group (``lax.axis_index`` without index groups)."""
    index = compat.jax_lax.axis_index(axes)
    if not index_groups:
        return index
    table = np.zeros(sum(len(g) for g in index_groups), np.int32)
    for g in index_groups:
        table[list(g)] = np.arange(len(g), dtype=np.int32)
    return jnp.asarray(table)[index]


def describe(axes: tuple) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(axes)


def replica_groups(axis_context: Any, axes: tuple,
                   index_groups: IndexGroups = None) -> tuple[tuple[int, ...], ...]:
    """Partition ids of each group, in rank order (split by ``index_groups`` as jax.lax)."""
    whole = compat.replica_groups(axis_context, axes)
    if not index_groups:
        return whole
    return tuple(tuple(g[i] for i in ig) for g in whole for ig in index_groups)


def partition_devices(axis_context: Any, platform: str = "cpu") -> np.ndarray:
    """(process index, device ordinal) of each partition, flattened, as int64.

    Handlers find their rank from the device ordinal XLA gives them, since a
    partition-id instruction is refused in partially manual shard_maps. On CPU that
    ordinal is the device id (2048 for process 1's first device); on GPU it is the local
    device number (-1 here for other processes' devices, which have none locally).
    """
    devices = np.asarray(axis_context.mesh.devices).reshape(-1)
    if platform == "cpu":
        return np.asarray([(d.process_index, d.id) for d in devices], dtype=np.int64).reshape(-1)
    return np.asarray([(d.process_index, -1 if d.local_hardware_id is None else d.local_hardware_id)
                       for d in devices], dtype=np.int64).reshape(-1)


def peer_processes(axis_context: Any, replica_groups: tuple[tuple[int, ...], ...]) -> set[int]:
    """The processes that share a group with one of this process's partitions."""
    devices = np.asarray(axis_context.mesh.devices).reshape(-1)
    me = jax.process_index()
    processes: set[int] = set()
    for group in replica_groups:
        owners = {devices[p].process_index for p in group}
        if me in owners:
            processes |= owners
    processes.discard(me)
    return processes


def is_partially_manual(axis_context: Any) -> bool:
    """Whether the shard_map being lowered leaves some mesh axes to the partitioner."""
    manual = getattr(axis_context, "manual_axes", None)
    if manual is None:
        return False
    return set(manual) != set(axis_context.mesh.axis_names)
