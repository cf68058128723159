"""broadcast: every rank receives the root's value. Handler: ffi/cpu/handlers.cc (Broadcast)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax._src.interpreters import ad

from jaxcomm._src import compat, groups, primitive
from jaxcomm._src.ops import common
from jaxcomm._src.ops.reduce import all_reduce_p

broadcast_p = primitive.define(primitive.CollectiveSpec(
    name="broadcast",
    out_shape=lambda shape, size, **_: shape,
    invariant_result=True,
    ffi_attrs=lambda root, **_: {"root": root},
    aliases=True,
))


def _broadcast_transpose(ct: Any, x: Any, *, root: int, **params: Any):
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    # With check_vma the result is one invariant value: the root alone produced it.
    # Without, each rank's copy is its own value, and the root receives their sum.
    if params["vma_checked"]:
        total = compat.pvary(ct, params["axes"])
    else:
        total = all_reduce_p.bind(ct, op="sum", **params)
    is_root = jax.lax.axis_index(params["axes"]) == root
    return [jnp.where(is_root, total, jnp.zeros_like(total))]


ad.deflinear2(broadcast_p, _broadcast_transpose)


def broadcast(x: jax.Array, axis_name: Any, *, root: int = 0,
              timeout_s: float | None = None) -> jax.Array:
    """Every member of the group receives rank ``root``'s ``x``.

    The result is typed invariant across the group (like ``psum``'s), so ``out_specs``
    may replicate it. The transpose sends the cotangent back to the root.

    Example::

        jaxcomm.broadcast(params, "dp", root=0)
    """
    x = jnp.asarray(x)
    axes = groups.normalize_axes("broadcast", axis_name)
    size = groups.group_size(axes)
    root = common.as_int("broadcast", "root", root)
    if not 0 <= root < size:
        raise ValueError(f"jaxcomm.broadcast: root={root!r} is out of range for a group of {size} "
                         f"ranks over axis {groups.describe(axes)}")
    if common.use_xla("broadcast", x.dtype):
        is_root = jax.lax.axis_index(axis_name) == root
        picked = jnp.where(is_root, x, jnp.zeros_like(x))
        if x.dtype == jnp.bool_:
            return jax.lax.psum(picked, axis_name).astype(jnp.bool_)
        return jax.lax.psum(picked, axis_name)
    x, params = common.prepare("broadcast", x, axis_name, timeout_s)
    return broadcast_p.bind(x, root=root, **params)
