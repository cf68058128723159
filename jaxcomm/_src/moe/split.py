"""Split-phase dispatch and combine: a send half that returns at once and a receive half that
completes, so that XLA runs independent work (a shared expert, another micro-batch) while
the tokens travel.

On the host backend the halves are the fused primitives' (fused.py: moe_dispatch with
split=True, moe_transport_send, moe_recv; ffi/cpu/moe_split.h): the send publishes this
rank's buffers and returns; the data movement runs on jaxcomm's threads once every rank
has sent, into the send's own results; the receive half takes them (aliased, no copy) and
completes when the round is over. On the CUDA backend the routing is planned in XLA, then
moe_transport_send enqueues the movement on a stream of jaxcomm's and moe_recv makes XLA's
stream wait for it (ffi/cuda/split.h). On the composed transport the send half only
records its arguments and the receive half runs the fused call: same values, no overlap.

The pending value between the halves is not a pytree: it cannot leave the jitted program
(XLA would copy buffers that are still being written) nor cross a vmap, scan or cond.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from jaxcomm._src.moe import api
from jaxcomm._src.moe import dispatch as impl
from jaxcomm._src.moe import fused


class _Pending:
    """A send half's result: the receive half's only argument, received once."""

    def __init__(self, finish: Callable[[], Any]):
        self._finish: Callable[[], Any] | None = finish

    def __repr__(self) -> str:
        return f"{type(self).__name__}({'received' if self._finish is None else 'in flight'})"


class PendingDispatch(_Pending):
    """What :func:`jaxcomm.moe.dispatch_send` returns; pass it to ``dispatch_recv``."""


class PendingCombine(_Pending):
    """What :func:`jaxcomm.moe.combine_send` returns; pass it to ``combine_recv``."""


def take(op: str, pending: Any, kind: type, sender: str) -> Any:
    """Completes ``pending`` (the result of ``sender``) for receive half ``op``."""
    if not isinstance(pending, kind):
        raise TypeError(f"jaxcomm.moe.{op}: expects what {sender} returned, got {type(pending).__name__}")
    if pending._finish is None:
        raise ValueError(f"jaxcomm.moe.{op}: this {kind.__name__} was already received")
    finish, pending._finish = pending._finish, None
    return finish()


def _require_traced(op: str, *arrays: Any) -> None:
    if not any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(arrays)):
        raise TypeError(f"jaxcomm.moe.{op}: split-phase calls live inside one program: call the send "
                        f"and receive halves under jax.jit (or inside jax.shard_map)")


def dispatch_send(spec: api.DispatchSpec, x: Any, expert_ids: Any, axis_name: Any) -> PendingDispatch:
    op = spec.op
    _require_traced(op, x, expert_ids)
    x, expert_ids = jax.numpy.asarray(x), jax.numpy.asarray(expert_ids)
    if api.in_shard_map(axis_name):
        R = impl.group_size(axis_name)
        api.check_inputs(spec, x, expert_ids, R, x.shape[0])
        # Groups the fused transports do not serve (the CUDA backend's across processes
        # that are not one per GPU on one host) take the composed path, as the fused call.
        lay, view = (api.make_layout(spec, x.shape[0], expert_ids.shape[1], R) if impl.use_fused(x.dtype, R)
                     else None), None
    elif impl.use_fused(x.dtype):
        lay, view = api.global_layout(spec, x, expert_ids, axis_name)
    else:
        lay = None
    if lay is None:
        return PendingDispatch(lambda: api.run_dispatch(spec, x, expert_ids, axis_name))
    if not impl.use_host_dispatch(x.dtype, lay.R):
        return _planned_dispatch_send(spec, x, expert_ids, axis_name, lay, view)

    ids = impl.ids_int32(expert_ids, lay.E)
    ex, route, q, scales = impl.host_dispatch(x, ids, lay, axis_name, fp8=spec.fp8, check_ids=spec.check_ids,
                                              split=True, view=view)
    n, dim0, mesh = view or (0, (), None)
    rows = max(n, 1) * lay.rows
    key = fused.fused_key("dispatch", El=lay.El, fp8=impl.FP8_MODES[spec.fp8], rows=rows,
                          zero_unused=not lay.low_latency)

    def finish():
        data, table = fused.recv(ex, route, [x, ids, q, scales], axis_name, fused=key, shards=n, dim0=dim0,
                                 mesh=mesh)
        expert_x, sizes, arrays = impl.host_outputs(x, [data, table, q, scales], lay, axis_name, fp8=spec.fp8,
                                                    split=True, view=view)
        return (impl.shape_expert_x(expert_x, lay, max(n, 1)), sizes,
                api.Handle(arrays, axis_name, spec.padded, x.dtype, lay, view=view))
    return PendingDispatch(finish)


def _planned_dispatch_send(spec: api.DispatchSpec, x: jax.Array, expert_ids: jax.Array, axis_name: Any,
                           lay: impl.Layout, view: tuple | None) -> PendingDispatch:
    """The send half of a dispatch whose routing is planned in XLA (CUDA): the routing
    (a collective in stream order), FP8 quantization (a local kernel), then one transport
    send per moved array: x, or the FP8 codes (dequantized as they arrive), or for
    fp8='raw' the codes and their scales."""
    arrays, sizes = api.planned_routing(spec, expert_ids, axis_name, lay, view)
    dest, pos = arrays["dest"], arrays["pos"]
    n, dim0, mesh = view or (0, (), None)
    common = dict(rows=max(n, 1) * lay.rows, shards=n, dim0=dim0, mesh=mesh)
    tangent_mode = impl.gather_mode(lay)
    if spec.fp8 is None:
        moves = [(tangent_mode, x, None)]
    else:
        # The receive half's JVP moves x's tangent (straight through the rounding).
        q, scales = api.on_shards(view)(impl.fp8_format.quantize_rows, jax.lax.stop_gradient(x))
        moves = ([(tangent_mode, q, None), (tangent_mode, scales, None)] if spec.fp8 == "raw"
                 else [(impl.gather_mode(lay, fp8=True), q, scales)])
    sends = [fused.transport_send(mode, src, dest, pos, axis_name, g=g, out_dtype=x.dtype, **common)
             for mode, src, g in moves]
    key = fused.fused_key("planned_dispatch", fp8=impl.FP8_MODES[spec.fp8], rows=common["rows"],
                          tangent_mode=tangent_mode)

    def finish():
        outs = [fused.recv(data, status, [*keep, x], axis_name, fused=key, shards=n, dim0=dim0, mesh=mesh)[0]
                for data, status, keep in sends]
        expert_x = tuple(outs) if spec.fp8 == "raw" else outs[0]
        return (impl.shape_expert_x(expert_x, lay, max(n, 1)), sizes,
                api.Handle(arrays, axis_name, spec.padded, x.dtype, lay, view=view))
    return PendingDispatch(finish)


def combine_send(op: str, expert_y: Any, handle: Any, weights: Any) -> PendingCombine:
    _require_traced(op, expert_y, weights)
    expert_y, weights = api.check_combine_args(op, expert_y, handle, weights)
    axis_name = handle.axis_name
    # A handle with slot tables came from the fused transports (host or CUDA), which split.
    native = "pos" in handle.arrays
    if not native or not (api.in_shard_map(axis_name) or handle.view is not None):
        return PendingCombine(lambda: api.run_combine(op, expert_y, handle, weights))
    n, dim0, mesh = handle.view or (0, (), None)
    lay = handle.layout
    api.check_combine_shapes(op, expert_y, weights, handle, max(n, 1))
    ey = expert_y.reshape(max(n, 1) * lay.rows, expert_y.shape[-1])
    y, status, keep = fused.transport_send(fused.REDUCE, ey, handle["dest"], handle["pos"], axis_name, w=weights,
                                           out_dtype=handle.x_dtype, shards=n, dim0=dim0, mesh=mesh)
    key = fused.fused_key("transport", mode=fused.REDUCE, rows=0, out_dtype=jax.numpy.dtype(handle.x_dtype))

    def finish():
        return fused.recv(y, status, keep, axis_name, fused=key, shards=n, dim0=dim0, mesh=mesh)[0]
    return PendingCombine(finish)
