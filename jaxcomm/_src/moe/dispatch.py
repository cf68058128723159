"""Expert-parallel dispatch/combine: routing plan plus one of two transports.

Routing (both transports; one rank r of R, T tokens, top-K): per-expert counts of this
rank's assignments are all-gathered ([R, E] int32, no host round trip). From them every
sender knows exactly which row of the receiver's ``expert_x`` each of its (token, slot)
assignments will take (``pos``), and which are dropped for capacity, before any token moves.

Fused host transports (``fused.py``, the default on the CPU backend): one custom call per
direction, in which every rank reads its peers' rows in place guided by their (dest, pos)
slot tables. dispatch copies each kept assignment's token row once, straight into the
receiver's expert row; combine has each source read its tokens' expert rows from the
ranks that hold them, summing each rank's slots in k order and then the ranks in order
(float32). No send/receive buffers, no per-(token, rank) partial rows.

Composed transport (other platforms, JAXCOMM_BACKEND=xla): a token travels once to each
destination rank that keeps at least one of its assignments, packed by rank with one int32
row per token listing its rows at the receiver; two ragged_all_to_all calls move them and
the receiver expands each token into its rows with one gather. combine sends the weights
the same way, reduces each received token over its slots on the receiver and returns one
float32 row per (token, rank) with the reverse ragged_all_to_all; the source sums the ranks.

Autodiff, forward and reverse: the fused transports are one primitive with JVP and
transpose rules (fused.py): dispatch's transpose is a combine with unit weights, combine's
a dispatch of the weighted cotangent plus one dot product per slot for the weights. The
composed transport is built from ragged_all_to_all (which has both rules) and gathers,
and JAX differentiates it as it is.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src import groups
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


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(x, axis=axis, dtype=x.dtype) - x


def layout(T: int, K: int, E: int, R: int, capacity: int | None, padded: bool) -> Layout:
    El = E // R
    if padded:
        # capacity: rows per expert slab (R*T, the default, never drops).
        rows = El * (capacity if capacity is not None else R * T)
        recv = min(R * T, rows)
    else:
        rows = capacity if capacity is not None else R * T * min(K, El)
        # Every received token row carries at least one kept assignment, so never more
        # than `rows` of them arrive.
        recv = min(R * T, rows)
    return Layout(R, T, K, E, El, rows, recv, T * min(R, K), padded)


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
    slab = lay.rows // El  # padded layout: rows per expert
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


def _fused_dispatch_rows(x: jax.Array, h: Handle, lay: Layout, axis_name: Any) -> jax.Array:
    return fused.transport(fused.GATHER_COPY, x, h["dest"], h["pos"], axis_name, rows=lay.rows)


def _fused_combine_rows(ey: jax.Array, weights: jax.Array, h: Handle, lay: Layout,
                        axis_name: Any, out_dtype: Any) -> jax.Array:
    y = fused.transport(fused.REDUCE, ey.astype(_F32), h["dest"], h["pos"], axis_name, w=weights)
    return y.astype(out_dtype)


def use_fused(dtype: Any, group_size: int | None = None) -> bool:
    """Whether this dispatch takes the fused transports (else ragged_all_to_all)."""
    return fused.available(dtype, group_size)


def dispatch(x: jax.Array, expert_ids: jax.Array, lay: Layout, axis_name: Any):
    is_fused = use_fused(x.dtype, lay.R)
    handle, sizes = plan(expert_ids, lay, axis_name, fused=is_fused)
    rows = _fused_dispatch_rows if is_fused else _expand
    expert_x = rows(x, handle, lay, axis_name)
    if lay.padded:
        expert_x = expert_x.reshape(lay.El, lay.rows // lay.El, x.shape[1])
    return expert_x, sizes, handle


def combine(expert_y: jax.Array, handle: Handle, weights: jax.Array, lay: Layout,
            axis_name: Any, out_dtype: Any) -> jax.Array:
    ey = expert_y.reshape(lay.rows, expert_y.shape[-1])
    rows = _fused_combine_rows if "pos" in handle else _combine_rows
    return rows(ey, weights, handle, lay, axis_name, jnp.dtype(out_dtype))


def group_size(axis_name: Any) -> int:
    return groups.group_size(groups.normalize_axes("moe", axis_name))
