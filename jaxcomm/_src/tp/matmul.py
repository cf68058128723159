"""Collective matmuls: all_gather_matmul and matmul_reduce_scatter as rings of chunk
matmuls, each step's block travelling by a one-sided put (put.py) while the step's matmul
runs. Gradients by custom_vjp: each op's backward is the other op (so it overlaps too).

Ring schedule (R ranks, this rank r, a block cut into ``chunks`` pieces, piece p moving in
direction d_p = +1 or -1 around the ring):
  all_gather_matmul: at step s piece p holds rows of rank (r - d_p s) mod R; the step
    starts its put to rank r + d_p, multiplies it into its place in the result, and takes
    the received piece for the next step.
  matmul_reduce_scatter: the partial sums of block b visit ranks b + d_p, b + 2 d_p, ...,
    b; at step s rank r adds its partial of block (r - d_p (s + 1)) mod R to the
    accumulator received and puts it on, the next step's partial computed meanwhile.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import numpy as np

import jax
import jax.numpy as jnp

from jaxcomm._src import compat, groups
from jaxcomm._src.ops import common
from jaxcomm._src.ops.gather import all_gather
from jaxcomm._src.ops.reduce import reduce_scatter
from jaxcomm._src.tp import put

DIRECTIONS = ("one_way", "bidirectional", "none")

# Below this many bytes moving per ring step the default is no ring ("none": the collective,
# then the matmul): each step's put costs a rendezvous of the group (12-20 us in one
# process with 8 devices, more under load), which a small block's transfer cannot repay.
# Measured (python -m jaxcomm.bench tp, 2026-12-07, at load 10-15): decode-size blocks of
# 32-64 KiB ran 2-3x slower as rings than unfused.
RING_MIN_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True)
class Ring:
    """A collective matmul's static plan (hashable: custom_vjp's static argument)."""

    axis_name: Any
    size: int          # ranks in the group
    axis: int          # the gathered (scattered) dimension of x (of the result)
    pieces: tuple      # (start, size) of each piece within a block, along ``axis``
    shifts: tuple      # each piece's direction: +1 or -1
    direction: str     # one of DIRECTIONS
    timeout_s: float | None
    precision: Any
    # "put": jaxcomm's one-sided puts; "lax": jax.lax.ppermute, i.e. the shard_map docs'
    # collective matmul; "local": no communication, each block stays (wrong values, the
    # same matmuls: the benchmark's compute-alone side). The last two are the baselines of
    # python -m jaxcomm.bench tp.
    transport: str = "put"

    def perm(self, shift: int) -> tuple[tuple[int, int], ...]:
        return tuple((i, (i + shift) % self.size) for i in range(self.size))

    def send(self, block: jax.Array, shift: int) -> Callable[[], jax.Array]:
        """Starts moving ``block`` to rank + ``shift``; returns what completes it."""
        perm = self.perm(shift)
        if self.transport == "lax":
            return lambda: compat.jax_lax.ppermute(block, self.axis_name, perm)
        if self.transport == "local":
            return lambda: block
        return put.start(block, self.axis_name, perm, self.timeout_s)


def plan(op: str, axis_name: Any, axis: int, block: int, *, chunks: int | None, direction: str | None,
         timeout_s: float | None, precision: Any, transport: str = "put", step_bytes: int = 0,
         size: int | None = None) -> Ring:
    """The ring for a block of ``block`` rows along ``axis`` (``step_bytes`` moving per
    step): by default no ring below RING_MIN_BYTES, one-way over 2 ranks (both directions
    lead to the same peer) and bidirectional above, as the shard_map docs' collective
    matmul; ``chunks`` pieces per block (default: one per direction). ``size``: the group
    size, for a ring planned outside shard_map (the global view); else the bound axes'."""
    if size is None:
        size = groups.group_size(groups.normalize_axes(f"tp.{op}", axis_name))
    if direction is None:
        if size > 1 and step_bytes < RING_MIN_BYTES:
            direction = "none"
        else:
            direction = "bidirectional" if size > 2 and block >= 2 else "one_way"
    if direction not in DIRECTIONS:
        raise ValueError(f"jaxcomm.tp.{op}: direction must be one of {DIRECTIONS}, got {direction!r}")
    if chunks is None or direction == "none":
        chunks = 2 if direction == "bidirectional" else 1
    chunks = common.as_int(f"tp.{op}", "chunks", chunks)
    if chunks < 1 or (direction == "bidirectional" and chunks < 2):
        raise ValueError(f"jaxcomm.tp.{op}: chunks must be at least {2 if direction == 'bidirectional' else 1} "
                         f"for direction {direction!r}, got {chunks}")
    sizes = [len(a) for a in np.array_split(np.arange(block), min(chunks, max(block, 1)))]
    starts = np.cumsum([0] + sizes[:-1])
    pieces = tuple((int(a), int(n)) for a, n in zip(starts, sizes) if n > 0) or ((0, 0),)
    shifts = tuple(1 if direction == "one_way" or i % 2 == 0 else -1 for i in range(len(pieces)))
    return Ring(axis_name, size, axis, pieces, shifts, direction, timeout_s, precision, transport)


def _dot(a: jax.Array, w: jax.Array, ring: Ring, acc: Any) -> jax.Array:
    return jnp.matmul(a, w, precision=ring.precision, preferred_element_type=acc)


def accumulator(dtype: Any) -> Any:
    """The dtype chunk products are accumulated in: float32 for half precision."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else dtype


def gather_matmul(x: jax.Array, w: jax.Array, ring: Ring, *, gathered: bool = False
                  ) -> tuple[jax.Array, jax.Array | None]:
    """(all_gather(x, axis=ring.axis, tiled=True) @ w, and that gathered x if ``gathered``)."""
    R, g, m = ring.size, ring.axis, x.shape[ring.axis]
    acc, out_dtype = accumulator(x.dtype), x.dtype
    if ring.direction == "none":
        full = all_gather(x, ring.axis_name, axis=g, tiled=True, timeout_s=ring.timeout_s)
        return _dot(full, w, ring, acc).astype(out_dtype), full
    me = compat.jax_lax.axis_index(ring.axis_name) if R > 1 else 0
    y = jnp.zeros(x.shape[:g] + (R * m,) + x.shape[g + 1:-1] + (w.shape[1],), out_dtype)
    full = jnp.zeros(x.shape[:g] + (R * m,) + x.shape[g + 1:], x.dtype) if gathered else None
    held = [jax.lax.slice_in_dim(x, a, a + n, axis=g) for a, n in ring.pieces]
    for s in range(R):
        # Start every piece's put before this step's matmuls, so that they overlap.
        pending = [ring.send(h, d) for h, d in zip(held, ring.shifts)] if s < R - 1 else []
        for h, (a, _), d in zip(held, ring.pieces, ring.shifts):
            row = ((me - d * s) % R) * m + a
            y = jax.lax.dynamic_update_slice_in_dim(y, _dot(h, w, ring, acc).astype(out_dtype), row, g)
            if gathered:
                full = jax.lax.dynamic_update_slice_in_dim(full, h, row, g)
        held = [finish() for finish in pending]
    return y, full


def matmul_scatter(x: jax.Array, w: jax.Array, ring: Ring) -> jax.Array:
    """psum_scatter(x @ w, scatter_dimension=ring.axis, tiled=True), summed in the
    accumulator dtype along the ring."""
    R, g = ring.size, ring.axis
    mb = x.shape[g] // R
    acc, out_dtype = accumulator(x.dtype), x.dtype
    if ring.direction == "none":
        return reduce_scatter(_dot(x, w, ring, acc), ring.axis_name, scatter_dimension=g, tiled=True,
                              timeout_s=ring.timeout_s).astype(out_dtype)
    me = compat.jax_lax.axis_index(ring.axis_name) if R > 1 else 0

    def partial(s: int) -> list[jax.Array]:
        # This rank's share of each piece of block (r - d (s + 1)) mod R.
        out = []
        for (a, n), d in zip(ring.pieces, ring.shifts):
            row = ((me - d * (s + 1)) % R) * mb + a
            out.append(_dot(jax.lax.dynamic_slice_in_dim(x, row, n, g), w, ring, acc))
        return out

    sums = partial(0)
    for s in range(1, R):
        pending = [ring.send(v, d) for v, d in zip(sums, ring.shifts)]
        mine = partial(s)  # runs while the accumulators travel
        sums = [finish() + v for finish, v in zip(pending, mine)]
    return jnp.concatenate(sums, axis=g).astype(out_dtype) if len(sums) > 1 else sums[0].astype(out_dtype)


# ------------------------------------------------------------------------------ gradients

def _like(ct: jax.Array, primal_vma: frozenset, dtype: Any) -> jax.Array:
    """A cotangent typed as its primal: summed over the axes it varies over and the primal
    does not (the transpose of the implicit cast to varying), cast to varying where the
    primal varies."""
    ct = ct.astype(dtype)
    if not compat.check_vma_enabled():
        return ct
    have = compat.vma(jax.typeof(ct))
    extra = tuple(a for a in have if a not in primal_vma)
    if extra:
        ct = compat.jax_lax.psum(ct, extra)
    return compat.pvary(ct, tuple(a for a in primal_vma if a not in compat.vma(jax.typeof(ct))))


def _contract_rows(a: jax.Array, b: jax.Array, acc: Any) -> jax.Array:
    """a^T b over every dimension but the last: [..., K] x [..., N] -> [K, N]."""
    lead = tuple(range(a.ndim - 1))
    return jax.lax.dot_general(a, b, ((lead, lead), ((), ())), preferred_element_type=acc)


def _vma(x: jax.Array) -> frozenset:
    return compat.vma(jax.typeof(x)) if compat.check_vma_enabled() else frozenset()


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def all_gather_matmul_p(x: jax.Array, w: jax.Array, ring: Ring) -> jax.Array:
    return gather_matmul(x, w, ring)[0]


def _agm_fwd(x, w, ring):
    y, full = gather_matmul(x, w, ring, gathered=True)
    return y, (full, x, w)


def _agm_bwd(ring, res, ct):
    full, x, w = res
    # d/dx: the cotangent's rows reduce-scattered back, i.e. matmul_reduce_scatter(ct, w^T).
    dx = matmul_scatter(ct, w.T, ring)
    dw = _contract_rows(full, ct, accumulator(w.dtype))
    return _like(dx, _vma(x), x.dtype), _like(dw, _vma(w), w.dtype)


all_gather_matmul_p.defvjp(_agm_fwd, _agm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul_reduce_scatter_p(x: jax.Array, w: jax.Array, ring: Ring) -> jax.Array:
    return matmul_scatter(x, w, ring)


def _mrs_fwd(x, w, ring):
    return matmul_scatter(x, w, ring), (x, w)


def _mrs_bwd(ring, res, ct):
    x, w = res
    # d/dx: the cotangent gathered back, i.e. all_gather_matmul(ct, w^T).
    dx, full_ct = gather_matmul(ct, w.T, ring, gathered=True)
    dw = _contract_rows(x, full_ct, accumulator(w.dtype))
    return _like(dx, _vma(x), x.dtype), _like(dw, _vma(w), w.dtype)


matmul_reduce_scatter_p.defvjp(_mrs_fwd, _mrs_bwd)
