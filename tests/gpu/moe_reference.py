"""NumPy references of jaxcomm.moe's dispatch and combine, written from their documented
semantics (jaxcomm/moe.py), independent of jaxcomm's code: what the GPU tests compare
with (never jaxcomm on the host)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Dispatched(NamedTuple):
    expert_x: np.ndarray  # [R, rows, H] (padded: rows = El * S, expert-major)
    sizes: np.ndarray     # [R, El] kept rows per local expert
    dropped: np.ndarray   # [R] assignments of each rank's tokens dropped for capacity
    invalid: np.ndarray   # [R] ids outside [-1, E)
    recv_dropped: np.ndarray  # [R] rows that arrived past capacity
    place: dict           # (source rank, token, slot) -> (destination rank, row)


def dispatch(x: np.ndarray, ids: np.ndarray, E: int, capacity: int | None = None,
             padded: bool = False) -> Dispatched:
    """Every rank's dispatch (x [R, T, H], ids [R, T, K]): rows grouped by local expert,
    in (source rank, token, slot) order; packed from row 0 (capacity: rows per rank) or in
    slabs of `capacity` rows per expert (padded); the first rows in that order are kept."""
    R, T, H = x.shape
    K = ids.shape[2]
    El = E // R
    invalid = ((ids != -1) & ((ids < 0) | (ids >= E))).reshape(R, -1).sum(1)
    arrivals: dict[int, list] = {e: [] for e in range(E)}
    for s in range(R):
        for t in range(T):
            for k in range(K):
                e = int(ids[s, t, k])
                if 0 <= e < E:
                    arrivals[e].append((s, t, k))
    if padded:
        S = capacity if capacity is not None else R * T
        rows = El * S
    else:
        rows = capacity if capacity is not None else R * T * min(K, El)
    expert_x = np.zeros((R, rows, H), x.dtype)
    sizes = np.zeros((R, El), np.int32)
    dropped = np.zeros(R, np.int32)
    recv_dropped = np.zeros(R, np.int32)
    place = {}
    for d in range(R):
        row = 0
        for el in range(El):
            e = d * El + el
            if padded:
                row = el * S
                limit = (el + 1) * S
            else:
                limit = rows
            for (s, t, k) in arrivals[e]:
                if row < limit:
                    expert_x[d, row] = x[s, t]
                    place[(s, t, k)] = (d, row)
                    sizes[d, el] += 1
                    row += 1
                else:
                    dropped[s] += 1
                    recv_dropped[d] += 1
    return Dispatched(expert_x, sizes, dropped, invalid, recv_dropped, place)


def combine(expert_y: np.ndarray, d: Dispatched, w: np.ndarray) -> np.ndarray:
    """y[s, t] = sum over kept slots k of w[s, t, k] * expert_y[dest, row], in float64."""
    R, T, K = w.shape
    y = np.zeros((R, T, expert_y.shape[-1]), np.float64)
    for (s, t, k), (dest, row) in d.place.items():
        y[s, t] += np.float64(w[s, t, k]) * expert_y[dest, row].astype(np.float64)
    return y


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets):
    """One rank's ragged_all_to_all: slice i's rows land at output_offsets[i]; later
    slices win where they overlap; rows no slice writes keep their value."""
    out = np.array(output, copy=True)
    for i in range(len(send_sizes)):
        n = int(send_sizes[i])
        out[output_offsets[i]:output_offsets[i] + n] = operand[input_offsets[i]:input_offsets[i] + n]
    return out
