"""all_to_all: rank i's j-th block goes to rank j. Handler: ffi/cpu/handlers.cc (AllToAll)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax._src.interpreters import ad

from jaxcomm._src import compat, groups, primitive
from jaxcomm._src.ops import common


def _a2a_shape(shape: tuple, size: int, *, split_axis: int, concat_axis: int, **_: Any) -> tuple:
    out = list(shape)
    out[split_axis] //= size
    out[concat_axis] *= size
    return tuple(out)


# The primitive is the tiled form; the untiled one reshapes around it as jax.lax does.
all_to_all_p = primitive.define(primitive.CollectiveSpec(
    name="all_to_all",
    out_shape=_a2a_shape,
    invariant_result=False,
    ffi_attrs=lambda split_axis, concat_axis, **_: {"split_axis": split_axis,
                                                     "concat_axis": concat_axis},
    shift_axes=lambda p: {**p, "split_axis": p["split_axis"] + 1,
                          "concat_axis": p["concat_axis"] + 1},
    batch_dims=lambda ndim, split_axis, concat_axis, **_: min(split_axis, concat_axis),
))


def _all_to_all_transpose(ct: Any, x: Any, *, split_axis: int, concat_axis: int, **params: Any):
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    return [all_to_all_p.bind(ct, split_axis=concat_axis, concat_axis=split_axis, **params)]


ad.deflinear2(all_to_all_p, _all_to_all_transpose)


def all_to_all(x: Any, axis_name: Any, split_axis: int, concat_axis: int, *,
               tiled: bool = False, axis_index_groups: Any = None,
               timeout_s: float | None = None) -> Any:
    """Splits ``x`` into R blocks along ``split_axis``, sends block j to rank j, and
    concatenates the received blocks along ``concat_axis``: ``jax.lax.all_to_all``.

    Args:
      x: array (or pytree of arrays); ``x.shape[split_axis]`` equals R (``tiled=False``)
        or is divisible by R.
      split_axis, concat_axis: as in jax.lax (with ``tiled=False`` the split dimension is
        removed and a new dimension of size R appears at ``concat_axis``).
      axis_index_groups: as in jax.lax; R is then the size of one group.

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> x = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("x")))  # f32[8] per rank
        >>> f = jax.shard_map(lambda v: jaxcomm.all_to_all(v, "x", 0, 0, tiled=True), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))  # element j goes to rank j
        >>> np.asarray(jax.jit(f)(x)).reshape(8, 8)[1]  # what rank 1 received
        array([ 1.,  9., 17., 25., 33., 41., 49., 57.], dtype=float32)
    """
    return jax.tree.map(lambda leaf: _all_to_all(leaf, axis_name, split_axis, concat_axis, tiled,
                                                 axis_index_groups, timeout_s), x)


def _all_to_all(x: Any, axis_name: Any, split_axis: int, concat_axis: int, tiled: bool,
                axis_index_groups: Any, timeout_s: float | None) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("jaxcomm.all_to_all: the operand must have at least one dimension")
    split_axis = common.canonical_axis("all_to_all", "split_axis", split_axis, x.ndim)
    concat_axis = common.canonical_axis("all_to_all", "concat_axis", concat_axis, x.ndim)
    axes = groups.normalize_axes("all_to_all", axis_name)
    index_groups = groups.normalize_index_groups("all_to_all", axis_index_groups, axes)
    size = groups.group_size(axes, index_groups)
    n = x.shape[split_axis]
    if tiled and n % size:
        raise ValueError(f"jaxcomm.all_to_all: split_axis {split_axis} of size {n} is not divisible "
                         f"by the group size {size} of axis {groups.describe(axes)}")
    if not tiled and n != size:
        raise ValueError(f"jaxcomm.all_to_all: with tiled=False x.shape[split_axis] must equal the "
                         f"group size {size} of axis {groups.describe(axes)}, got {n}")
    if common.use_xla("all_to_all", x.dtype):
        return compat.jax_lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled,
                                         axis_index_groups=index_groups)
    if not tiled:
        # As jax.lax: insert the new axis, run the tiled op, then drop the split axis.
        if split_axis < concat_axis:
            concat_axis += 1
            x = jnp.expand_dims(x, concat_axis)
        elif split_axis > concat_axis:
            x = jnp.expand_dims(x, concat_axis)
            split_axis += 1
    x, params = common.prepare("all_to_all", x, axis_name, timeout_s, index_groups)
    y = all_to_all_p.bind(x, split_axis=split_axis, concat_axis=concat_axis, **params)
    if not tiled and split_axis != concat_axis:
        y = jnp.squeeze(y, split_axis)
    return y
