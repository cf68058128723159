"""Everything that differs between the jax versions jaxcomm supports, in one place.

jax 0.10.x keeps an array's varying mesh axes in ``aval.mat.varying``; older releases
had ``aval.vma``. Private jax helpers that jaxcomm relies on are also reached only here,
so a jax upgrade touches one file.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax._src import config as _config
from jax._src import core as _core
from jax._src.interpreters import pxla as _pxla

NamedAxisEffect = _core.NamedAxisEffect


def check_vma_enabled() -> bool:
    """Whether the enclosing shard_map tracks varying axes (``check_vma=True``)."""
    return bool(_config._check_vma.value)


def vma(aval: Any) -> frozenset:
    """The mesh axes over which values of ``aval`` vary."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def with_vma(aval: Any, varying: frozenset) -> Any:
    """``aval`` with its varying axes replaced by ``varying``."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return aval.update(manual_axis_type=mat.update(varying=frozenset(varying)))
    return aval.update(vma=frozenset(varying))


def pvary(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """Cast ``x`` to varying over ``axes`` (no data movement)."""
    axes = tuple(axes)
    if not axes:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # pragma: no cover - older jax


def axis_exists(name: Any) -> bool:
    return _core.get_axis_env().axis_exists(name)


def axis_size(name: Any) -> int:
    return int(_core.get_axis_env().axis_size(name))


def replica_groups(axis_context: Any, axes: tuple) -> tuple[tuple[int, ...], ...]:
    """Partition ids of each group of a collective over ``axes``, in rank order."""
    return tuple(tuple(int(i) for i in g) for g in _pxla.axis_groups(axis_context, axes))


def require_devices_at_lowering(prim: Any) -> None:
    """Makes jax lower programs containing ``prim`` with their device assignment known
    (as it does for callbacks and custom_partitioning)."""
    from jax._src import dispatch as _dispatch
    _dispatch.prim_requires_devices_during_lowering.add(prim)


def device_assignment(sharding: Any) -> tuple:
    """The devices of ``sharding`` in partition order (GSPMDSharding and NamedSharding)."""
    return tuple(sharding._device_assignment)


def concrete_mesh() -> Any:
    """The concrete mesh set by ``jax.set_mesh`` (None or an empty mesh when none is)."""
    from jax._src import mesh as _mesh
    getter = getattr(_mesh, "get_concrete_mesh", None)
    return getter() if getter is not None else None


def mesh_axis_names() -> frozenset:
    """Axis names of the mesh in context (empty outside any mesh)."""
    from jax._src import mesh as _mesh
    return frozenset(_mesh.get_abstract_mesh().axis_names)
