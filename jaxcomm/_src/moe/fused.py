"""The host backend's fused MoE transports: one custom call per direction (ffi/cpu/moe_kernels.cc).

Each rank reads its peers' token or expert rows in place, guided by every rank's
(dest, pos) slot tables, so a dispatch is one copy per expert row and a combine one read
per expert row: no send buffer, receive buffer or per-(token, rank) partial rows. Every
call is a collective over the expert-parallel axis.

The four modes are multilinear in their float operands (GATHER_COPY in src; GATHER_SCALED
and REDUCE in src and w; DOT in src and g), and the transpose of each mode with respect to
one of them is again one of the four. So the primitive has a JVP rule (the product rule)
and a transpose rule, and forward mode, reverse mode and their compositions (e.g.
Hessian-vector products) all come from JAX, with no custom_vjp.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import ad, batching, mlir

from jaxcomm._src import callsite, compat, config, primitive
from jaxcomm._src.moe import globalview
from jaxcomm._src.ops import common, table

GATHER_COPY = table.moe_mode("gather_copy")
GATHER_SCALED = table.moe_mode("gather_scaled")
REDUCE = table.moe_mode("reduce")
DOT = table.moe_mode("dot")

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


def _abstract_eval(src, dest, pos, w, g, *, mode, rows, axes, vma_checked, shards, **_):
    shape, dtype = _out_shape(mode, src, dest, rows)
    out = src.update(shape=shape, dtype=jnp.dtype(dtype), weak_type=False)
    if shards:  # global view: no axis is bound here
        return out, set()
    if vma_checked:
        out = compat.with_vma(out, frozenset().union(*(compat.vma(a) for a in (src, dest, pos, w, g))))
    return out, {compat.NamedAxisEffect(a) for a in axes}


moe_transport_p.def_effectful_abstract_eval(_abstract_eval)


def _lowering(ctx: mlir.LoweringRuleContext, *args: Any, mode: int, rows: int, shards: int,
              dim0: tuple, mesh: Any, **params: Any):
    if shards:
        # Global view (shards > 0 dim-0 blocks over the mesh axes dim0): the same call on
        # each block, with the expert-parallel axis bound (globalview.py).
        def local(*blocks):
            return [moe_transport_p.bind(*blocks, mode=mode, rows=rows // shards, shards=0, dim0=(),
                                         mesh=None, **params)]

        def run(*xs):
            out = ctx.avals_out[0]
            return globalview.sharded_call(local, xs, [jax.ShapeDtypeStruct(out.shape, out.dtype)],
                                           shards, dim0, mesh)[0]
        return mlir.lower_fun(run, multiple_results=False)(ctx, *args)
    return primitive.lower_collective(ctx, "moe_transport", list(args), params, {"mode": int(mode)})


primitive.register_lowerings(moe_transport_p, _lowering)
# The global view's lowering hands the devices to custom_partitioning; jax gives a lowering
# the program's devices only when one of its primitives asks.
compat.require_devices_at_lowering(moe_transport_p)


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


# Operand positions: src, dest, pos, w, g. The float operands each mode is linear in.
_SRC, _W, _G = 0, 3, 4
_LINEAR = {GATHER_COPY: (_SRC,), GATHER_SCALED: (_SRC, _W), REDUCE: (_SRC, _W), DOT: (_SRC, _G)}
_F32 = jnp.float32


def _jvp(primals, tangents, *, mode, rows, **params):
    out = moe_transport_p.bind(*primals, mode=mode, rows=rows, **params)
    # Product rule: one call per linear operand with a nonzero tangent, that operand
    # replaced by its tangent.
    terms = []
    for i in _LINEAR[mode]:
        if type(tangents[i]) is ad.Zero:
            continue
        args = list(primals)
        args[i] = tangents[i]
        terms.append(moe_transport_p.bind(*args, mode=mode, rows=rows, **params))
    if not terms:
        return out, ad.Zero.from_primal_value(out)
    return out, functools.reduce(jnp.add, terms)


ad.primitive_jvps[moe_transport_p] = _jvp


def _transpose(ct, src, dest, pos, w, g, *, mode, rows, **params):
    undefined = [ad.is_undefined_primal(a) for a in (src, dest, pos, w, g)]
    if undefined[1] or undefined[2]:
        raise ValueError("jaxcomm.moe: the routing tables are not differentiable")
    avals = [a.aval if ad.is_undefined_primal(a) else None for a in (src, dest, pos, w, g)]
    if type(ct) is ad.Zero:
        return [ad.Zero(a) if a is not None else None for a in avals]

    def call(m, s, w_=None, g_=None, rows_=0):
        return _bind(m, s, dest, pos, params, w=w_, g=g_, rows=rows_)

    out: list[Any] = [None] * 5
    if mode == GATHER_COPY:  # out[pos] = src[t]: each token sums its rows
        out[_SRC] = call(REDUCE, ct.astype(_F32), w_=jnp.ones(dest.shape, _F32)).astype(avals[_SRC].dtype)
    elif mode == GATHER_SCALED:  # out[pos] = w * src[t]
        if undefined[_SRC]:
            out[_SRC] = call(REDUCE, ct, w_=w)
        else:
            out[_W] = call(DOT, ct, g_=src)
    elif mode == REDUCE:  # y[t] = sum_k w * src[pos]
        if undefined[_SRC]:
            out[_SRC] = call(GATHER_SCALED, ct, w_=w, rows_=avals[_SRC].shape[0])
        else:
            out[_W] = call(DOT, src, g_=ct)
    else:  # DOT: out[t, k] = <g[t], src[pos]>
        if undefined[_SRC]:
            out[_SRC] = call(GATHER_SCALED, g, w_=ct, rows_=avals[_SRC].shape[0])
        else:
            out[_G] = call(REDUCE, src, w_=ct)
    return out


ad.primitive_transposes[moe_transport_p] = _transpose


def _bind(mode: int, src: jax.Array, dest: jax.Array, pos: jax.Array, params: dict, *,
          w: jax.Array | None, g: jax.Array | None, rows: int) -> jax.Array:
    T, K = dest.shape
    w = jnp.zeros((T, K), _F32) if w is None else w.astype(_F32)
    # The unused g has T rows, so that in the global view it splits like every operand.
    g = jnp.zeros((T, 1), _F32) if g is None else g.astype(_F32)
    args = [src, dest.astype(jnp.int32), pos.astype(jnp.int32), w, g]
    if params["vma_checked"]:
        args = [compat.pvary(a, tuple(x for x in params["axes"] if x not in compat.vma(jax.typeof(a))))
                for a in args]
    return moe_transport_p.bind(*args, mode=mode, rows=rows, **params)


def transport(mode: int, src: jax.Array, dest: jax.Array, pos: jax.Array, axis_name: Any, *,
              w: jax.Array | None = None, g: jax.Array | None = None, rows: int = 0,
              shards: int = 0, dim0: tuple = (), mesh: Any = None) -> jax.Array:
    """One fused transport (see MoeMode in ffi/cpu/moe_kernels.cc for the four modes).

    Args:
      mode: GATHER_COPY, GATHER_SCALED, REDUCE or DOT.
      src: [T, H] token rows (gathers) or [rows, H] float32 expert rows (REDUCE, DOT).
      dest, pos: [T, K] int32 slot tables (destination rank and row there, or -1).
      w: [T, K] slot weights (GATHER_SCALED, REDUCE). g: [T, H] float32 (DOT).
      rows: expert rows of the gathers' result.
      shards, dim0, mesh: 0 inside shard_map; in the global view (outside it) the number
        of dim-0 blocks of every operand, the mesh axes they are sharded over and the mesh
        (globalview.mesh_of), with all shapes (rows included) global.

    Returns:
      [rows, H] (gathers; src's dtype for GATHER_COPY, else float32), [T, H] float32
      (REDUCE) or [T, K] float32 (DOT).
    """
    if shards:
        params = dict(axes=tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,),
                      call_site=callsite.user_call_site(), timeout_ms=config.timeout_ms(None),
                      vma_checked=False)
    else:
        src, params = common.prepare("moe_transport", src, axis_name, None)
    params.update(shards=shards, dim0=tuple(dim0), mesh=getattr(mesh, "abstract_mesh", mesh))
    return _bind(mode, src, dest, pos, params, w=w, g=g, rows=rows)
