"""Mesh axis names -> group size and replica groups (pure Python, no I/O)."""

from __future__ import annotations

from typing import Any, Hashable

import numpy as np

import jax

from jaxcomm._src import compat

AxisName = Hashable | tuple[Hashable, ...]


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


def group_size(axes: tuple) -> int:
    """Number of ranks in each group of a collective over ``axes``."""
    size = 1
    for name in axes:
        size *= compat.axis_size(name)
    return size


def describe(axes: tuple) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(axes)


def replica_groups(axis_context: Any, axes: tuple) -> tuple[tuple[int, ...], ...]:
    return compat.replica_groups(axis_context, axes)


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
