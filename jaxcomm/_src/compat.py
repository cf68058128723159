"""Everything that differs between the jax versions jaxcomm supports, in one place.

jax 0.10.x keeps an array's varying mesh axes in ``aval.mat.varying``; older releases
had ``aval.vma``. Private jax helpers that jaxcomm relies on are also reached only here,
so a jax upgrade touches one file.
"""

from __future__ import annotations

import types
from typing import Any, Sequence

import jax
from jax._src import config as _config
from jax._src import core as _core
from jax._src.interpreters import pxla as _pxla
from jax._src.lax import parallel as _parallel

NamedAxisEffect = _core.NamedAxisEffect

#: The collectives jax.lax defines, as the installed jax defines them. jaxcomm's own
#: fallbacks call these, never ``jax.lax.<name>``: ``jaxcomm.use_for_lax()`` rebinds the
#: names in ``jax.lax`` to jaxcomm, and a fallback through them would come back here.
LAX_COLLECTIVES = ("psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all",
                   "pswapaxes", "ppermute", "pshuffle", "pbroadcast", "ragged_all_to_all")
jax_lax = types.SimpleNamespace(
    **{name: getattr(_parallel, name) for name in LAX_COLLECTIVES},
    axis_index=_parallel.axis_index, axis_size=_parallel.axis_size)


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


def unreduced(aval: Any) -> frozenset:
    """The mesh axes over which ``aval`` holds partial sums still to be added up
    (explicit sharding's ``unreduced``; empty on jax versions without it)."""
    return frozenset(getattr(getattr(aval, "mat", None), "unreduced", ()))


def reduced(aval: Any) -> frozenset:
    """The mesh axes over which ``aval`` is typed ``reduced`` (the cotangent type of an
    operand that was unreduced there)."""
    return frozenset(getattr(getattr(aval, "mat", None), "reduced", ()))


def without_unreduced(aval: Any, axes: Sequence[Any]) -> Any:
    """``aval`` no longer unreduced over ``axes`` (a collective summed them)."""
    left = unreduced(aval) - frozenset(axes)
    if left == unreduced(aval):
        return aval
    return aval.update(manual_axis_type=aval.mat.update(unreduced=left))


def with_reduced(aval: Any, axes: Sequence[Any]) -> Any:
    """``aval`` typed ``reduced`` over ``axes`` too (as jax.lax's all_gather(to="reduced")
    result)."""
    return aval.update(manual_axis_type=aval.mat.update(reduced=reduced(aval) | frozenset(axes)))


def preduced(x: jax.Array, axes: Sequence[Any]) -> jax.Array:
    """Cast an invariant ``x`` to ``reduced`` over ``axes`` (no data movement): the
    cotangent type of an operand that was ``unreduced`` there."""
    axes = tuple(axes)
    return _parallel.pcast(x, axes, to="reduced") if axes else x


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


def skip_size_one_axes(axes: tuple) -> tuple:
    """``axes`` without the size-1 mesh axes where jax drops them from types (a jax flag)."""
    skip = getattr(_parallel, "_maybe_skip_one_sized_axes", None)
    return tuple(skip(axes)) if skip is not None else axes


def axes_state(aval: Any, axes: tuple) -> set[str]:
    """How ``aval`` relates to each axis: {"varying", "unreduced", "reduced", "invarying"}.

    jax.lax picks a collective's typing from this (``_get_from``); a mixture is an error
    there. Without explicit-sharding types every axis is "varying" or "invarying".
    """
    out = set()
    for a in axes:
        if a in vma(aval):
            out.add("varying")
        elif a in unreduced(aval):
            out.add("unreduced")
        elif a in reduced(aval):
            out.add("reduced")
        else:
            out.add("invarying")
    return out


def ppermute_rejects_unsorted_groups() -> bool:
    """Whether jax.lax.ppermute raises over axes in an order other than the mesh's (newer
    jax, ``jax_raise_on_ppermute_sort_diff``) instead of numbering each group sorted."""
    flag = getattr(_config, "raise_on_ppermute_sort_diff", None)
    return bool(flag.value) if flag is not None else False


def mesh_axis_order() -> tuple:
    """Axis names of the mesh in context, in the mesh's order."""
    from jax._src import mesh as _mesh
    return tuple(_mesh.get_abstract_mesh().axis_names)


def is_tracer(x: Any) -> bool:
    return isinstance(x, _core.Tracer)


def with_weak_type(x: jax.Array) -> jax.Array:
    """``x`` typed weak (as a Python scalar is), with no computation."""
    from jax._src.lax import lax as _lax_internal
    return _lax_internal._convert_element_type(x, x.dtype, weak_type=True)
