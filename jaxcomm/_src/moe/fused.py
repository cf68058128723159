"""The host backend's fused MoE transports: one custom call per direction (ffi/cpu/moe_kernels.cc).

Each rank reads its peers' token or expert rows in place, guided by every rank's
(dest, pos) slot tables, so a dispatch is one copy per expert row and a combine one read
per expert row: no send buffer, receive buffer or per-(token, rank) partial rows. Every
call is a collective over the expert-parallel axis.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import batching, mlir

from jaxcomm._src import compat, primitive
from jaxcomm._src.ops import common

GATHER_COPY, GATHER_SCALED, REDUCE, DOT = 0, 1, 2, 3

moe_transport_p = core.Primitive("jaxcomm_moe_transport")
moe_transport_p.def_impl(primitive._outside_shard_map("moe_transport"))


def _out_shape(mode: int, src: Any, dest: Any, rows: int) -> tuple[tuple[int, ...], Any]:
    T, K = dest.shape
    H = src.shape[1]
    if mode == GATHER_COPY:
        return (rows, H), src.dtype
    if mode == GATHER_SCALED:
        return (rows, H), jnp.float32
    if mode == REDUCE:
        return (T, H), jnp.float32
    return (T, K), jnp.float32


def _abstract_eval(src, dest, pos, w, g, *, mode, rows, axes, vma_checked, **_):
    shape, dtype = _out_shape(mode, src, dest, rows)
    out = src.update(shape=shape, dtype=jnp.dtype(dtype), weak_type=False)
    if vma_checked:
        out = compat.with_vma(out, frozenset().union(*(compat.vma(a) for a in (src, dest, pos, w, g))))
    return out, {compat.NamedAxisEffect(a) for a in axes}


moe_transport_p.def_effectful_abstract_eval(_abstract_eval)


def _lowering(ctx: mlir.LoweringRuleContext, *args: Any, mode: int, rows: int, **params: Any):
    return primitive.lower_collective(ctx, "moe_transport", list(args), params, {"mode": int(mode)})


primitive.register_lowerings(moe_transport_p, _lowering)


def _batcher(axis_data, vals_in, dims_in, **params):
    # One collective per batch element, in batch order on every rank.
    if axis_data.name in params["axes"]:
        raise NotImplementedError("jaxcomm.moe over the vmap axis: use a shard_map axis")
    size = axis_data.size
    vals = [batching.bdim_at_front(v, d, size) for v, d in zip(vals_in, dims_in)]
    outs = [moe_transport_p.bind(*(v[b] for v in vals), **params) for b in range(size)]
    return jnp.stack(outs), 0


batching.fancy_primitive_batchers[moe_transport_p] = _batcher


def available(dtype: Any, group_size: int | None = None) -> bool:
    """Whether the fused transports serve this program: the host backend, or the CUDA
    backend for a group whose GPUs are in this process; whole-byte dtypes."""
    return not common.use_xla("moe_transport", dtype, group_size=group_size)


def transport(mode: int, src: jax.Array, dest: jax.Array, pos: jax.Array, axis_name: Any, *,
              w: jax.Array | None = None, g: jax.Array | None = None, rows: int = 0,
              after: jax.Array | None = None) -> jax.Array:
    """One fused transport (see MoeMode in ffi/cpu/moe_kernels.cc for the four modes).

    ``after``: a float32 array the call takes as its unused ``g`` operand (modes other than
    DOT), only so that it runs after whatever computes it. XLA:CPU starts independent
    collectives in different orders on different ranks, and ranks then stall on each other.
    """
    T, K = dest.shape
    w = jnp.zeros((T, K), jnp.float32) if w is None else w.astype(jnp.float32)
    if g is None:
        g = jnp.zeros((1, 1), jnp.float32) if after is None else after.astype(jnp.float32)
    src, params = common.prepare("moe_transport", src, axis_name, None)
    args = [src, dest.astype(jnp.int32), pos.astype(jnp.int32), w, g]
    if params["vma_checked"]:
        args = [compat.pvary(a, tuple(x for x in params["axes"] if x not in compat.vma(jax.typeof(a))))
                for a in args]
    return moe_transport_p.bind(*args, mode=mode, rows=rows, **params)

