"""Expert-parallel dispatch/combine composed from jaxcomm primitives.

Transport (one rank r of R, T tokens, top-K):

1. Routing is counted locally: per-expert counts of this rank's assignments, all-gathered
   ([R, E] int32, no host round trip). From them every sender knows exactly which row of
   the receiver's ``expert_x`` each of its (token, slot) assignments will take, and which
   are dropped for capacity, before any token moves.
2. A token travels once to each destination rank that keeps at least one of its
   assignments: the sender packs those (token, rank) rows by rank (``send_x``), with one
   int32 row per token listing its assignments' row positions at the receiver
   (``send_pos``). Two ragged_all_to_all calls move them; the receiver expands each token
   into its assignment rows with one local gather.
3. combine sends the weights the same way, reduces each received token over its local
   slots (float32) on the receiver, and returns one float32 row per (token, rank) with the
   reverse ragged_all_to_all; the source sums the ranks' partial rows.

Gradients come from JAX's rules for the pieces (ragged_all_to_all has an exact transpose),
so the backward passes move the same rows in the opposite directions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src import groups
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
    rows: int       # rows of the flat expert buffer: C (packed) or El * R * T (padded)
    recv: int       # rows of the receive buffer of unique tokens
    send: int       # rows of the send buffer of (token, rank) pairs
    padded: bool


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(x, axis=axis, dtype=x.dtype) - x


def layout(T: int, K: int, E: int, R: int, capacity: int | None, padded: bool) -> Layout:
    El = E // R
    if padded:
        rows = El * R * T
        recv = R * T
    else:
        rows = capacity if capacity is not None else R * T * min(K, El)
        # Every received token row carries at least one kept assignment, so never more
        # than `rows` of them arrive.
        recv = min(R * T, rows)
    return Layout(R, T, K, E, El, rows, recv, T * min(R, K), padded)


def plan(expert_ids: jax.Array, lay: Layout, axis_name: Any) -> tuple[Handle, jax.Array]:
    """Routing of one dispatch: the handle, and group sizes/counts of this rank's experts."""
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
    if lay.padded:
        slot_in_group = before[ep] + local_rank
        pos = (ep % El) * (R * T) + slot_in_group
        kept = valid & (slot_in_group < R * T)
    else:
        tb = total.reshape(R, El)
        start = _exclusive_cumsum(tb, axis=1).reshape(E)
        pos = start[ep] + before[ep] + local_rank
        kept = valid & (pos < lay.rows)
    pos = jnp.where(kept, pos, -1)
    dropped = jnp.sum(valid & ~kept, dtype=jnp.int32)

    # (token, destination rank) pairs with at least one kept assignment, packed by rank.
    dest = ep // El
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

    mine = jax.lax.dynamic_slice_in_dim(total, r * El, El)
    arrived = jnp.sum(mine, dtype=jnp.int32)
    if lay.padded:
        sizes = jnp.minimum(mine, R * T)
    else:
        st = jax.lax.dynamic_slice_in_dim(start, r * El, El)
        sizes = jnp.clip(st + mine, 0, lay.rows) - jnp.clip(st, 0, lay.rows)
    handle = dict(
        send_tok=send_tok, send_mask=send_pos >= 0, slot=slot,
        in_off=in_off, send_sizes=cnt_d, out_off=out_off, recv_sizes=recv_sizes,
        recv_off=recv_off, back_off=back_off, recv_pos=recv_pos, inv=inv,
        dropped=dropped, invalid=invalid,
        recv_dropped=arrived - jnp.sum(sizes, dtype=jnp.int32),
    )
    return handle, sizes.astype(jnp.int32)


def dispatch(x: jax.Array, expert_ids: jax.Array, lay: Layout, axis_name: Any):
    handle, sizes = plan(expert_ids, lay, axis_name)
    send_x = x[handle["send_tok"]]
    recv_x = ragged_all_to_all(send_x, jnp.zeros((lay.recv, x.shape[1]), x.dtype),
                               handle["in_off"], handle["send_sizes"], handle["out_off"],
                               handle["recv_sizes"], axis_name=axis_name)
    recv_x = jnp.concatenate([recv_x, jnp.zeros((1, x.shape[1]), x.dtype)])
    expert_x = recv_x[handle["inv"]]
    if lay.padded:
        expert_x = expert_x.reshape(lay.El, lay.R * lay.T, x.shape[1])
    return expert_x, sizes, handle


def combine(expert_y: jax.Array, handle: Handle, weights: jax.Array, lay: Layout,
            axis_name: Any, out_dtype: Any) -> jax.Array:
    H = expert_y.shape[-1]
    ey = expert_y.reshape(lay.rows, H)
    w_send = jnp.where(handle["send_mask"], weights[handle["send_tok"]], 0).astype(jnp.float32)
    w_recv = ragged_all_to_all(w_send, jnp.zeros((lay.recv, lay.K), jnp.float32),
                               handle["in_off"], handle["send_sizes"], handle["out_off"],
                               handle["recv_sizes"], axis_name=axis_name)
    ey = jnp.concatenate([ey, jnp.zeros((1, H), ey.dtype)])
    p = jnp.where(handle["recv_pos"] >= 0, handle["recv_pos"], lay.rows)
    partial = jnp.zeros((lay.recv, H), jnp.float32)
    for k in range(lay.K):  # k order; XLA fuses the gathers into one loop
        partial = partial + w_recv[:, k:k + 1] * ey[p[:, k]].astype(jnp.float32)
    back = ragged_all_to_all(partial, jnp.zeros((lay.send, H), jnp.float32),
                             handle["recv_off"], handle["recv_sizes"], handle["back_off"],
                             handle["send_sizes"], axis_name=axis_name)
    back = jnp.concatenate([back, jnp.zeros((1, H), jnp.float32)])
    slot = handle["slot"]
    y = jnp.zeros((slot.shape[0], H), jnp.float32)
    for d in range(lay.R):  # rank order
        y = y + back[slot[:, d]]
    return y.astype(out_dtype)


def group_size(axis_name: Any) -> int:
    return groups.group_size(groups.normalize_axes("moe", axis_name))
