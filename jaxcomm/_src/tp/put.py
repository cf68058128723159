"""One-sided puts with a signal: the split-phase ``put_start`` / ``put_done`` over an axis
with a static peer map. Handlers: ffi/cpu/put.cc (ops put_start, put_done of
ffi/core/op_table.h).

``put_start`` binds a primitive whose results are the buffer the peers write into (this
rank's received block) and a status block (the put's signal); it returns at once. The
data moves on jaxcomm's threads once every rank of the group has started, straight into
each destination's result buffer. ``put_done`` takes both results (aliased to its own: no
copy) and the put's operand (kept alive while peers read it) and completes when the
signal does. XLA runs whatever does not depend on the received block in between.

Where jaxcomm's backend does not serve the op (JAXCOMM_BACKEND=xla, a platform without a
put handler, a zero-size block) ``put_start`` only records its arguments and ``put_done``
is ``jax.lax.ppermute``: same values, no overlap.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax._src.interpreters import ad, batching

from jaxcomm._src import backends, compat, groups, primitive
from jaxcomm._src.moe.fused import STATUS_WORDS
from jaxcomm._src.ops import common, permute, table

_NOT_MAPPED = getattr(batching, "not_mapped", None)


def _start_avals(x: Any, **_: Any) -> list:
    # The received block is typed like x; the status block is int32 words.
    return [x, x.update(shape=(STATUS_WORDS,), dtype=jnp.dtype(jnp.int32), weak_type=False)]


def _refuse_own_axis(op: str, axis_data: Any, params: dict) -> None:
    if axis_data.name in params["axes"]:
        raise NotImplementedError(f"jaxcomm.tp.{op} over the vmap axis {axis_data.name!r}: puts run "
                                  f"over shard_map mesh axes; use jax.lax.ppermute for a vmap axis")


def _start_batcher(axis_data: Any, vals_in: Any, dims_in: Any, **params: Any):
    """A batched put moves the whole batch: the batch dimension goes in front before the
    put (never after: the received block must reach put_done as put_start wrote it)."""
    _refuse_own_axis("put_start", axis_data, params)
    (x,), (d,) = vals_in, dims_in
    if d is _NOT_MAPPED or d is None:
        return put_start_p.bind(x, **params), [_NOT_MAPPED, _NOT_MAPPED]
    return put_start_p.bind(jnp.moveaxis(x, d, 0), **params), [0, _NOT_MAPPED]


def _done_batcher(axis_data: Any, vals_in: Any, dims_in: Any, **params: Any):
    """put_done binds on its operands as they are: the received block came from a batched
    put_start (batch dimension in front), the kept operands only stay alive."""
    _refuse_own_axis("put_done", axis_data, params)
    data, status, *keep = vals_in
    if dims_in[1] not in (None, _NOT_MAPPED):
        raise NotImplementedError("jaxcomm.tp.put_done: a put's status block cannot be batched")
    outs = put_done_p.bind(data, status, *keep, **params)
    return outs, [dims_in[0], _NOT_MAPPED]


put_start_p = primitive.define(primitive.CollectiveSpec(
    name="put_start",
    out_avals=_start_avals,
    multiple_results=True,
    invariant_result=False,
    ffi_attrs=lambda perm, group_size, **_: {
        "sources": np.asarray(permute._sources(perm, group_size), dtype=np.int64)},
    batcher=_start_batcher,
    batch_dims=None,
    public_name="tp.put_start",
))

put_done_p = primitive.define(primitive.CollectiveSpec(
    name="put_done",
    out_avals=lambda data, status, *keep, **_: [data, status],
    multiple_results=True,
    invariant_result=False,
    ffi_attrs=lambda **_: {},
    aliases={0: 0, 1: 1},  # put_start's results, completed in place: no copy
    batcher=_done_batcher,
    batch_dims=None,
    public_name="tp.put_done",
))


def _zero(v: Any) -> ad.Zero:
    return ad.Zero(jax.typeof(v).to_tangent_aval())


def _start_jvp(primals: Any, tangents: Any, **params: Any):
    # The tangent travels at put_done (below), from the kept operand's tangent.
    outs = put_start_p.bind(*primals, **params)
    return outs, [_zero(o) for o in outs]


def _done_jvp(primals: Any, tangents: Any, *, perm: tuple, **params: Any):
    """put_done's value is ppermute(x) of the kept operand x: so is its tangent."""
    outs = put_done_p.bind(*primals, perm=perm, **params)
    tx = tangents[2]
    if type(tx) is ad.Zero:
        return outs, [_zero(o) for o in outs]
    return outs, [permute.ppermute_p.bind(tx, perm=perm, **params), _zero(outs[1])]


ad.primitive_jvps[put_start_p] = _start_jvp
ad.primitive_jvps[put_done_p] = _done_jvp


def _served_natively(op: str, dtype: Any) -> bool:
    """Whether the platform's jaxcomm backend has a handler for ``op``."""
    if common.use_xla(op, dtype):
        return False
    backend = backends.for_jax_backend(jax.default_backend())
    return backend is None or backend.platform in table.op(op).backends


class PendingPut:
    """What :func:`put_start` returns: pass it to :func:`put_done` once.

    Not a pytree: the received block is still being written, so it cannot leave the
    jitted program (XLA would copy it) nor cross a vmap, scan or cond boundary."""

    def __init__(self, finish: Callable[[], jax.Array]):
        self._finish: Callable[[], jax.Array] | None = finish

    def __repr__(self) -> str:
        return f"PendingPut({'done' if self._finish is None else 'in flight'})"


def start(x: jax.Array, axis_name: Any, pairs: tuple[tuple[int, int], ...],
          timeout_s: float | None) -> Callable[[], jax.Array]:
    """Starts the put of ``x`` along ``pairs`` (validated (source, destination) ranks) and
    returns the function that completes it (``put_done``'s work)."""
    x = jnp.asarray(x)
    if x.size == 0 or not _served_natively("put_start", x.dtype):
        return lambda: compat.jax_lax.ppermute(x, axis_name, pairs)
    x, params = common.prepare("tp.put_start", x, axis_name, timeout_s)
    data, status = put_start_p.bind(x, perm=pairs, **params)
    return lambda: put_done_p.bind(data, status, x, perm=pairs, **params)[0]


def put_start(x: Any, axis_name: Any, perm: Sequence[Sequence[int]], *,
              timeout_s: float | None = None) -> PendingPut:
    """Starts a one-sided put of ``x`` from rank ``s`` into rank ``d``'s result for each
    (s, d) pair of ``perm``, and returns at once.

    The pair :func:`put_start` / :func:`put_done` computes ``jax.lax.ppermute(x, axis_name,
    perm)`` (ranks no pair sends to receive zeros), split so that XLA runs the program's
    other work while the data moves: each source's block is written by jaxcomm's threads
    straight into its destination's result buffer, and ``put_done`` waits on the put's
    signal. Both halves must be in one jitted program, inside ``jax.shard_map`` over
    ``axis_name``.

    Args:
      x: array of any shape and dtype (this rank's block).
      axis_name: mesh axis name, or tuple of names, of the enclosing shard_map.
      perm: static (source, destination) pairs of ranks in ``[0, R)``, each rank at most
        once as a source and once as a destination.
      timeout_s: deadline of the put (default ``JAXCOMM_TIMEOUT_S``); a rank that never
        starts fails every ``put_done`` with a timeout naming it.

    Returns:
      A :class:`PendingPut` for :func:`put_done`.

    Differentiable (the tangent is the ppermute of x's tangent) and vmappable over axes
    other than ``axis_name``. Example (8 CPU devices), overlapping a matmul with the put::

        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> ring = [(i, (i + 1) % 8) for i in range(8)]      # rank i puts into rank i + 1
        >>> def body(v, a):
        ...     pending = jaxcomm.tp.put_start(v, "x", ring)  # returns at once
        ...     h = a @ a.T                                   # runs while v travels
        ...     return jaxcomm.tp.put_done(pending), h
        >>> v = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
        >>> a = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("x")))
        >>> f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))
        >>> f(v, a)[0]
        Array([7., 0., 1., 2., 3., 4., 5., 6.], dtype=float32)
    """
    axes = groups.normalize_axes("tp.put_start", axis_name)
    pairs = permute.validate_perm("tp.put_start", perm, groups.group_size(axes))
    return PendingPut(start(x, axis_name, pairs, timeout_s))


def put_done(pending: PendingPut) -> jax.Array:
    """Completes a put begun by :func:`put_start`: this rank's received block (same shape
    and dtype as the operand of ``put_start``; zeros where no pair sends to this rank)."""
    if not isinstance(pending, PendingPut):
        raise TypeError(f"jaxcomm.tp.put_done: expects what jaxcomm.tp.put_start returned, got "
                        f"{type(pending).__name__}")
    if pending._finish is None:
        raise ValueError("jaxcomm.tp.put_done: this PendingPut was already completed")
    finish, pending._finish = pending._finish, None
    return finish()
