"""ft.all_reduce: a sum over the ranks that are still there, for data-parallel replicas.

Handler: ffi/cpu/ft.cc; the tolerance itself lives in the cross-process exchange
(ExchangeSpec::tolerant in ffi/core/cross_process.h, ffi/cpu/transport/world.cc): a process that dies
or misses the deadline is left out of the call, the survivors agree on who contributed,
and the ones left out stay out of every later fault-tolerant call (the group shrinks).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax._src import core

from jaxcomm._src import groups, primitive
from jaxcomm._src.ops import common

def _batcher(axis_data: Any, vals_in: Any, dims_in: Any, **params: Any):
    raise NotImplementedError("jaxcomm.ft.all_reduce under jax.vmap: call it on the batched "
                              "array inside shard_map instead")


# Results: the sum, and which ranks contributed (bool [group size]); both the same on
# every survivor. The host backend's only (the op table's): lowers on CPU alone.
ft_all_reduce_p = primitive.define(primitive.CollectiveSpec(
    name="ft_all_reduce",
    public_name="ft.all_reduce",
    out_avals=lambda x, group_size, **_: [x, core.ShapedArray((group_size,), jnp.bool_)],
    multiple_results=True,
    invariant_result=True,
    ffi_attrs=lambda **_: {},
    batcher=_batcher,
    batch_dims=None,
))


def all_reduce(x: jax.Array, axis_name: Any, *, timeout_s: float | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """Sums ``x`` over the ranks of ``axis_name`` that are alive and on time.

    For data-parallel replicas in a multi-process job (one or more devices per process):
    a process that died, or did not arrive within ``timeout_s``, is left out of this call
    and of every later ``ft.all_reduce`` (the group shrinks); the survivors agree on who
    contributed, so they all get the same sum and mask. Other jaxcomm collectives that
    involve a process left out fail at once, naming it.

    Args:
      x: this rank's array, any shape, a dtype that supports addition.
      axis_name: the mesh axis (or tuple of axes) of the replicas, bound by shard_map.
      timeout_s: how long to wait for a silent (alive but stuck) process before leaving
        it out; default JAXCOMM_TIMEOUT_S. Dead processes are detected within ~0.1 s.

    Returns:
      ``(total, contributed)``: ``total`` has x's shape and dtype, the sum over the ranks
      whose ``contributed`` entry (bool ``[group size]``, in rank order) is True. Average a
      gradient as ``total / contributed.sum()``.

    Not differentiable (apply it to gradients, not through them). With
    ``JAXCOMM_BACKEND=xla``, and on GPU, it is ``jax.lax.psum`` with an all-True mask
    (no tolerance: the host backend's cross-process exchange provides it).

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
        >>> f = jax.shard_map(lambda v: jaxcomm.ft.all_reduce(v, "x"), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=(P(), P()))
        >>> total, contributed = jax.jit(f)(x)    # in a job, a dead process is left out
        >>> total, contributed.sum()
        (Array([28.], dtype=float32), Array(8, dtype=int32))
    """
    x, params = common.prepare("ft.all_reduce", x, axis_name, timeout_s)
    if not jnp.issubdtype(x.dtype, jnp.number):
        raise TypeError(f"jaxcomm.ft.all_reduce: x must have a numeric dtype, got {x.dtype}")
    # Fault tolerance is a host-backend feature (the tolerant cross-process exchange).
    if common.use_xla("ft.all_reduce", x.dtype) or jax.default_backend() != "cpu":
        size = groups.group_size(params["axes"])
        return jax.lax.psum(x, params["axes"]), jnp.ones((size,), jnp.bool_)
    total, mask = ft_all_reduce_p.bind(x, **params)
    return total, mask
