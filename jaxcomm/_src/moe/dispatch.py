"""Expert-parallel dispatch/combine: routing plan plus one of three transports.

Routing (one rank r of R, T tokens, top-K): from every rank's per-expert counts each sender
knows exactly which row of the receiver's ``expert_x`` each of its (token, slot)
assignments will take (``pos``), and which are dropped for capacity, before any token moves.

Fused host dispatch (``fused.dispatch``, the default on the CPU backend): the routing and
the copy are one collective call (ffi/cpu/moe_dispatch.cc): the routing is computed from
every rank's expert ids inside the call, no count exchange precedes it, and each kept
assignment's token row is copied once, straight into the receiver's expert row.

Fused transports (the CUDA backend): the counts are all-gathered (an [R, E] int32 array,
no host round trip) and the plan computed in XLA; then one custom call per direction, in
which every rank reads its peers' rows in place guided by their (dest, pos) slot tables.

combine, on both fused paths: each source reads its tokens' expert rows from the ranks that
hold them, summing each rank's slots in k order and then the ranks in order (float32; on
the host backend half precision rows are converted in the kernel). No send/receive
buffers, no per-(token, rank) partial rows.

Composed transport (other platforms, JAXCOMM_BACKEND=xla): a token travels once to each
destination rank that keeps at least one of its assignments, packed by rank with one int32
row per token listing its rows at the receiver; two ragged_all_to_all calls move them and
the receiver expands each token into its rows with one gather. combine sends the weights
the same way, reduces each received token over its slots on the receiver and returns one
float32 row per (token, rank) with the reverse ragged_all_to_all; the source sums the ranks.

FP8 (``fp8=``): tokens quantized per 128 channels (fp8.py; the host kernels do the same),
moved as float8_e4m3fn with their scales, dequantized by the receiver or delivered as
they are. Its derivative treats the rounding as the identity (straight through): the
gradient of an FP8 dispatch is the combine of the cotangent in its own dtype.

Autodiff, forward and reverse: the fused primitives have JVP and transpose rules
(fused.py): dispatch's transpose is a combine with unit weights, combine's a dispatch of
the weighted cotangent plus one dot product per slot for the weights. The composed
transport is built from ragged_all_to_all (which has both rules) and gathers, and JAX
differentiates it as it is.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxcomm._src import groups
from jaxcomm._src.moe import fp8 as fp8_format
from jaxcomm._src.moe import fused
from jaxcomm._src.ops.gather import all_gather
from jaxcomm._src.ops.ragged import ragged_all_to_all

Handle = dict  # a pytree of arrays; see `_plan` for its entries


class Layout(NamedTuple):
    """Static shape facts of one dispatch."""
    R: int          # ranks in the group
    T: int          # tokens per rank
    K: int          # slots per token
    E: int          # experts in total
    El: int         # experts per rank
    rows: int       # rows of the flat expert buffer: C (packed) or El * S (padded, S rows per expert)
    recv: int       # rows of the receive buffer of unique tokens
    send: int       # rows of the send buffer of (token, rank) pairs
    padded: bool
    slab: int = 0   # padded layouts: rows per expert
    low_latency: bool = False  # rows past each expert's count are left unwritten


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(x, axis=axis, dtype=x.dtype) - x


def layout(T: int, K: int, E: int, R: int, capacity: int | None, padded: bool,
           max_tokens: int | None = None) -> Layout:
    """``max_tokens``: the low-latency layout, padded with R * max_tokens rows per expert."""
    El = E // R
    if max_tokens is not None:
        slab = R * max_tokens
        return Layout(R, T, K, E, El, El * slab, min(R * T, El * slab), T * min(R, K), True, slab, True)
    if padded:
        # capacity: rows per expert slab (R*T, the default, never drops).
        slab = capacity if capacity is not None else R * T
        rows = El * slab
        recv = min(R * T, rows)
        return Layout(R, T, K, E, El, rows, recv, T * min(R, K), True, slab)
    rows = capacity if capacity is not None else R * T * min(K, El)
    # Every received token row carries at least one kept assignment, so never more
    # than `rows` of them arrive.
    recv = min(R * T, rows)
    return Layout(R, T, K, E, El, rows, recv, T * min(R, K), False)


def plan(expert_ids: jax.Array, lay: Layout, axis_name: Any,
         fused: bool = False) -> tuple[Handle, jax.Array]:
    """Routing of one dispatch: the handle, and group sizes/counts of this rank's experts.

    ``fused``: the handle of the fused host transports (dest, pos and the counters) only.
    """
    R, T, K, E, El = lay.R, lay.T, lay.K, lay.E, lay.El
    r = jax.lax.axis_index(axis_name).astype(jnp.int32)
    ids = expert_ids
    valid = (ids >= 0) & (ids < E)  # compared in the caller's dtype: no wrap-around
    invalid = jnp.sum((ids != -1) & ~valid, dtype=jnp.int32)
    e = jnp.where(valid, ids, E).astype(jnp.int32)  # E sorts after every real expert

    # Rank of each assignment among this rank's assignments to the same expert, in (t, k)
    # order: a stable sort by expert, then position minus the expert's first position.
    flat = e.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.zeros((E + 1,), jnp.int32).at[flat].add(1)
    first = _exclusive_cumsum(counts)
    ranked = jnp.arange(T * K, dtype=jnp.int32) - first[flat[order]]
    local_rank = jnp.zeros((T * K,), jnp.int32).at[order].set(ranked).reshape(T, K)

    G = all_gather(counts[:E], axis_name)  # [R, E]: every source's per-expert counts
    total = jnp.sum(G, axis=0, dtype=jnp.int32)
    before = jnp.sum(jnp.where(jnp.arange(R)[:, None] < r, G, 0), axis=0, dtype=jnp.int32)  # sources < r
    ep = jnp.minimum(e, E - 1)
    slab = lay.slab  # padded layout: rows per expert
    if lay.padded:
        slot_in_group = before[ep] + local_rank
        pos = (ep % El) * slab + slot_in_group
        kept = valid & (slot_in_group < slab)
    else:
        tb = total.reshape(R, El)
        start = _exclusive_cumsum(tb, axis=1).reshape(E)
        pos = start[ep] + before[ep] + local_rank
        kept = valid & (pos < lay.rows)
    pos = jnp.where(kept, pos, -1)
    dropped = jnp.sum(valid & ~kept, dtype=jnp.int32)

    mine = jax.lax.dynamic_slice_in_dim(total, r * El, El)
    arrived = jnp.sum(mine, dtype=jnp.int32)
    if lay.padded:
        sizes = jnp.minimum(mine, slab)
    else:
        st = jax.lax.dynamic_slice_in_dim(start, r * El, El)
        sizes = jnp.clip(st + mine, 0, lay.rows) - jnp.clip(st, 0, lay.rows)
    stats = dict(dropped=dropped, invalid=invalid,
                 recv_dropped=arrived - jnp.sum(sizes, dtype=jnp.int32))
    dest = ep // El
    if fused:
        # The fused transports need only each slot's destination rank and row there.
        return dict(dest=jnp.where(kept, dest, -1), pos=pos, **stats), sizes.astype(jnp.int32)

    # (token, destination rank) pairs with at least one kept assignment, packed by rank.
    on = (dest[:, :, None] == jnp.arange(R, dtype=jnp.int32)) & kept[:, :, None]  # [T, K, R]
    need = jnp.any(on, axis=1)  # [T, R]
    cnt_d = jnp.sum(need, axis=0, dtype=jnp.int32)
    in_off = _exclusive_cumsum(cnt_d)
    slot = jnp.where(need, in_off[None, :] + _exclusive_cumsum(need.astype(jnp.int32), axis=0), lay.send)
    tok = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[:, None], (T, R))
    send_tok = jnp.zeros((lay.send,), jnp.int32).at[slot.reshape(-1)].set(tok.reshape(-1), mode="drop")
    pos_td = jnp.where(on, pos[:, :, None], -1).transpose(0, 2, 1)  # [T, R, K]
    send_pos = jnp.full((lay.send, K), -1, jnp.int32).at[slot.reshape(-1)].set(
        pos_td.reshape(T * R, K), mode="drop")

    C = all_gather(cnt_d, axis_name)  # [R sources, R destinations] token counts
    below = jnp.arange(R)[:, None] < r
    out_off = jnp.sum(jnp.where(below, C, 0), axis=0, dtype=jnp.int32)  # where my rows land on each rank
    recv_sizes = jnp.take(C, r, axis=1)
    recv_off = _exclusive_cumsum(recv_sizes)
    back_off = jnp.take(_exclusive_cumsum(C, axis=1), r, axis=1)  # my rows in each source's send buffer

    recv_pos = ragged_all_to_all(send_pos, jnp.full((lay.recv, K), -1, jnp.int32),
                                 in_off, cnt_d, out_off, recv_sizes, axis_name=axis_name)
    # inv[row] = which received token fills expert row `row` (lay.recv: the zero row).
    target = jnp.where(recv_pos >= 0, recv_pos, lay.rows).reshape(-1)
    src = jnp.broadcast_to(jnp.arange(lay.recv, dtype=jnp.int32)[:, None], (lay.recv, K)).reshape(-1)
    inv = jnp.full((lay.rows,), lay.recv, jnp.int32).at[target].set(src, mode="drop")

    handle = dict(
        send_tok=send_tok, send_mask=send_pos >= 0, slot=slot,
        in_off=in_off, send_sizes=cnt_d, out_off=out_off, recv_sizes=recv_sizes,
        recv_off=recv_off, back_off=back_off, recv_pos=recv_pos, inv=inv,
        **stats,
    )
    return handle, sizes.astype(jnp.int32)


_F32 = jnp.float32


def _gather_reduce(src: jax.Array, idx: jax.Array, w: jax.Array) -> jax.Array:
    """out[j] = sum_k w[j, k] * src[idx[j, k]] in float32, k ascending, indices outside
    [0, N) skipped: the row reduction of the composed transport and of its gradients.

    Args:
      src: [N, H] rows (any float dtype; read as float32).
      idx: [M, K] int32 row indices.
      w: [M, K] weights.

    Returns:
      [M, H] float32.
    """
    src, w = src.astype(_F32), w.astype(_F32)
    N = src.shape[0]
    idx = jnp.where((idx >= 0) & (idx < N), idx, N)  # N: a zero row (jnp.take wraps -1)
    out = jnp.zeros((idx.shape[0], src.shape[1]), _F32)
    for k in range(idx.shape[1]):  # k order
        out = out + w[:, k:k + 1] * _take(src, idx[:, k])
    return out


def _take(a: jax.Array, idx: jax.Array) -> jax.Array:
    """a[idx] along dim 0 with out-of-range indices giving zero rows, without the copy of
    ``a`` that appending a zero row would cost."""
    return jnp.take(a, idx, axis=0, mode="fill", fill_value=0)


def _forward(a: jax.Array, out_rows: int, h: Handle, axis_name: Any) -> jax.Array:
    """(token, rank) rows from the send layout to the receive layout."""
    return ragged_all_to_all(a, jnp.zeros((out_rows, a.shape[1]), a.dtype), h["in_off"],
                             h["send_sizes"], h["out_off"], h["recv_sizes"], axis_name=axis_name)


def _backward(a: jax.Array, out_rows: int, h: Handle, axis_name: Any) -> jax.Array:
    """Receive-layout rows back to the send layout of their source."""
    return ragged_all_to_all(a, jnp.zeros((out_rows, a.shape[1]), a.dtype), h["recv_off"],
                             h["recv_sizes"], h["back_off"], h["send_sizes"], axis_name=axis_name)


def _expand(x: jax.Array, h: Handle, lay: Layout, axis_name: Any) -> jax.Array:
    """expert_x as [rows, H] (composed transport)."""
    recv_x = _forward(x[h["send_tok"]], lay.recv, h, axis_name)
    return _take(recv_x, h["inv"])


def _reduce(ey: jax.Array, w_recv: jax.Array, h: Handle, lay: Layout, axis_name: Any) -> jax.Array:
    """float32 [T, H]: each receiver sums its slots in k order, the source sums ranks in order."""
    partial = _gather_reduce(ey, h["recv_pos"], w_recv)
    back = _backward(partial, lay.send, h, axis_name)
    return _gather_reduce(back, h["slot"], jnp.ones(h["slot"].shape, _F32))


def _send_weights(weights: jax.Array, h: Handle, lay: Layout, axis_name: Any) -> jax.Array:
    w_send = jnp.where(h["send_mask"], weights[h["send_tok"]], 0).astype(_F32)
    return _forward(w_send, lay.recv, h, axis_name)


def _combine_rows(ey: jax.Array, weights: jax.Array, h: Handle, lay: Layout, axis_name: Any,
                  out_dtype: Any) -> jax.Array:
    """y [T, H] (composed transport)."""
    return _reduce(ey, _send_weights(weights, h, lay, axis_name), h, lay, axis_name).astype(out_dtype)


def gather_mode(lay: Layout, fp8: bool = False) -> int:
    """The fused gather of a dispatch planned in XLA: the low-latency layout leaves the
    rows past each expert's count unwritten (as the host dispatch does); FP8 values are
    dequantized as they are delivered."""
    if fp8:
        return fused.GATHER_DEQUANT_SPARSE if lay.low_latency else fused.GATHER_DEQUANT
    return fused.GATHER_SPARSE if lay.low_latency else fused.GATHER_COPY


def _fused_dispatch_rows(x: jax.Array, h: Handle, lay: Layout, axis_name: Any) -> jax.Array:
    return fused.transport(gather_mode(lay), x, h["dest"], h["pos"], axis_name, rows=lay.rows)


def _fused_combine_rows(ey: jax.Array, weights: jax.Array, h: Handle, lay: Layout,
                        axis_name: Any, out_dtype: Any) -> jax.Array:
    return fused.transport(fused.REDUCE, ey, h["dest"], h["pos"], axis_name, w=weights, out_dtype=out_dtype)


def use_fused(dtype: Any, group_size: int | None = None) -> bool:
    """Whether this dispatch takes the fused transports (else ragged_all_to_all)."""
    return fused.available(dtype, group_size)


def use_host_dispatch(dtype: Any, group_size: int | None = None) -> bool:
    """Whether this dispatch is the host backend's one fused call (routing included)."""
    return fused.on_host() and use_fused(dtype, group_size)


FP8_MODES = {None: fused.FP8_NONE, "dequantize": fused.FP8_DEQUANTIZED, "raw": fused.FP8_RAW}


def ids_int32(expert_ids: jax.Array, E: int) -> jax.Array:
    """The ids as int32 for the host kernels, which count what is outside [-1, E) as
    invalid: wider values are clipped into int32 first, so none wraps into a valid id."""
    if expert_ids.dtype == jnp.int32:
        return expert_ids
    info = jnp.iinfo(jnp.int32)
    return jnp.clip(expert_ids, info.min, info.max).astype(jnp.int32) if expert_ids.dtype.itemsize >= 4 \
        else expert_ids.astype(jnp.int32)


def host_dispatch(x: jax.Array, expert_ids: jax.Array, lay: Layout, axis_name: Any, *, fp8: str | None,
                  check_ids: bool, split: bool = False, view: tuple | None = None) -> list[jax.Array]:
    """The host backend's fused dispatch call ([expert_x, route, fp8 values, scales]);
    ``view``: (blocks, dim-0 axes, mesh) of the global view."""
    n, dim0, mesh = view or (0, (), None)
    return fused.dispatch(x, ids_int32(expert_ids, lay.E), axis_name, num_experts=lay.E, ranks=lay.R,
                          rows=max(n, 1) * lay.rows, slab=lay.slab if lay.padded else 0,
                          fp8=FP8_MODES[fp8], zero_unused=not lay.low_latency, check_ids=check_ids,
                          split=split, shards=n, dim0=dim0, mesh=mesh)


def host_outputs(x: jax.Array, outs: Sequence[jax.Array], lay: Layout, axis_name: Any, *,
                 fp8: str | None, split: bool = False, view: tuple | None = None):
    """(expert_x [flat rows], sizes, handle arrays) from the host dispatch call's results;
    FP8 delivered as such has its scales moved along the same routing."""
    n, dim0, mesh = view or (0, (), None)
    ex, route, _, scales = outs
    rt = fused.RouteTables(route, max(n, 1), x.shape[0] // max(n, 1), lay.K, lay.El, split, n > 0)
    arrays = dict(dest=rt.dest, pos=rt.pos, **rt.counters)
    if fp8 == "raw":
        mode = fused.GATHER_SPARSE if lay.low_latency else fused.GATHER_COPY
        ex = (ex, fused.transport(mode, scales, rt.dest, rt.pos, axis_name, rows=max(n, 1) * lay.rows,
                                  shards=n, dim0=dim0, mesh=mesh))
    return ex, rt.sizes, arrays


def fp8_rows(x: jax.Array, fp8: str, move: Callable, *, deliver: Callable | None = None,
             local: Callable = lambda f, *a: f(*a)) -> Any:
    """FP8 dispatch on the transports other than the host dispatch: quantize
    (fp8.quantize_rows: the CUDA kernel where there is one), move values and scales with
    ``move`` (a linear map of [T, C] rows) and dequantize; straight-through derivative
    (x's tangent moved by ``move``).

    ``deliver(values, scales)``, where given, moves and dequantizes in one call (the fused
    transports' dequantizing gather). ``local(f, *arrays)`` applies a per-rank function
    (the global view: on each shard's rows; inside shard_map: the function itself).
    """
    if fp8 == "raw":
        @jax.custom_jvp
        def raw(x):
            q, s = local(fp8_format.quantize_rows, x)
            return move(q), move(s)

        def not_differentiable(primals, tangents):
            raise TypeError(fused.RAW_NOT_DIFFERENTIABLE)
        raw.defjvp(not_differentiable)
        return raw(x)

    @jax.custom_jvp
    def rows(x):
        q, s = local(fp8_format.quantize_rows, x)
        if deliver is not None:
            return deliver(q, s)
        return fp8_format.dequantize(move(q), move(s), x.dtype)

    rows.defjvp(lambda primals, tangents: (rows(*primals), move(tangents[0])))
    return rows(x)


def checked_ids(expert_ids: jax.Array, E: int, axis_name: Any) -> jax.Array:
    """check_ids on the transports other than the host dispatch (whose kernel checks):
    ``expert_ids`` back from a host callback that raises on an id outside [-1, E).

    Every rank must fail, or the others would wait forever in the next collective: the
    ranks all-gather their first invalid id and every rank's callback raises the same
    message; the routing continues from the callback's result, so no later collective
    starts before it.
    """
    K = expert_ids.shape[1]
    bad = ((expert_ids < 0) | (expert_ids >= E)) & (expert_ids != -1)
    first = jnp.argmax(bad.reshape(-1)).astype(jnp.int32)
    info = jnp.iinfo(jnp.int32)
    value = jnp.clip(expert_ids.reshape(-1)[first], info.min, info.max).astype(jnp.int32)
    mine = jnp.stack([jnp.any(bad).astype(jnp.int32), first // K, first % K, value])
    found = all_gather(mine, axis_name)  # [R, 4]

    def check(found, ids):
        for r, (has, t, k, v) in enumerate(found.tolist()):
            if has:
                raise ValueError(f"jaxcomm.moe: expert id {v} of token {t}, slot {k} on rank {r} is "
                                 f"outside [-1, {E}) (check_ids=True)")
        return ids

    return jax.pure_callback(check, jax.ShapeDtypeStruct(expert_ids.shape, expert_ids.dtype), found, expert_ids)


def dispatch(x: jax.Array, expert_ids: jax.Array, lay: Layout, axis_name: Any, *,
             fp8: str | None = None, check_ids: bool = False):
    """(expert_x, sizes, handle arrays) inside shard_map; expert_x is (values, scales) for
    ``fp8="raw"``."""
    if use_host_dispatch(x.dtype, lay.R):
        outs = host_dispatch(x, expert_ids, lay, axis_name, fp8=fp8, check_ids=check_ids)
        expert_x, sizes, handle = host_outputs(x, outs, lay, axis_name, fp8=fp8)
    else:
        if check_ids:
            expert_ids = checked_ids(expert_ids, lay.E, axis_name)
        is_fused = use_fused(x.dtype, lay.R)
        handle, sizes = plan(expert_ids, lay, axis_name, fused=is_fused)
        rows = _fused_dispatch_rows if is_fused else _expand
        move = lambda v: rows(v, handle, lay, axis_name)  # noqa: E731
        deliver = None
        if is_fused:
            deliver = lambda q, s: fused.transport(  # noqa: E731
                gather_mode(lay, fp8=True), q, handle["dest"], handle["pos"], axis_name, g=s,
                rows=lay.rows, out_dtype=x.dtype)
        expert_x = move(x) if fp8 is None else fp8_rows(x, fp8, move, deliver=deliver)
    return shape_expert_x(expert_x, lay), sizes, handle


def shape_expert_x(expert_x: Any, lay: Layout, n: int = 1) -> Any:
    """Flat expert rows [n*rows, C] in the layout's shape: [n*E_local, slab, C] when padded
    (also each part of an FP8 (values, scales) pair)."""
    if isinstance(expert_x, tuple):
        return tuple(shape_expert_x(e, lay, n) for e in expert_x)
    return expert_x.reshape(n * lay.El, lay.slab, expert_x.shape[-1]) if lay.padded else expert_x


def combine(expert_y: jax.Array, handle: Handle, weights: jax.Array, lay: Layout,
            axis_name: Any, out_dtype: Any) -> jax.Array:
    ey = expert_y.reshape(lay.rows, expert_y.shape[-1])
    rows = _fused_combine_rows if "pos" in handle else _combine_rows
    return rows(ey, weights, handle, lay, axis_name, jnp.dtype(out_dtype))


def group_size(axis_name: Any) -> int:
    return groups.group_size(groups.normalize_axes("moe", axis_name))
