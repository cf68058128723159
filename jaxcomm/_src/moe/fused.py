"""The fused MoE primitives (ffi/cpu/moe_kernels.cc, moe_dispatch.cc, moe_split.cc), each
declared here as a :class:`primitive.CollectiveSpec`, its JVP (and transpose) rules after
it. What they share comes from primitive.py: typing of the results' varying mesh axes, the
lowering inside shard_map or in the global view (``global_view``: through
custom_partitioning, _src/globalview.py), vmap as one call per batch element.

* ``moe_transport``: the transports of the routed rows (core/moe_modes.h): the four
  portable ones, GATHER_SPARSE (leaves the rows no slot writes), and the FP8 gathers that
  dequantize as they deliver (GATHER_DEQUANT, GATHER_DEQUANT_SPARSE).
  Each rank reads its peers' token or expert rows in place, guided by every rank's
  (dest, pos) slot tables, so a dispatch is one copy per expert row and a combine one read
  per expert row. The modes are multilinear in their float operands (GATHER_COPY in src;
  GATHER_SCALED and REDUCE in src and w; DOT in src and g), and the transpose of each mode
  with respect to one of them is again one of them: the primitive has a JVP rule (the
  product rule) and a transpose rule, and forward mode, reverse mode and their
  compositions all come from JAX, with no custom_vjp. Float operands may be bfloat16 or
  float16 (converted in the kernels, accumulated in float32). The dequantizing gathers
  are not differentiated here: the FP8 dispatch defines its own derivative.
* ``moe_dispatch``: routing and the token copy in one call (host backend): the routing is
  computed from every rank's expert ids inside the call, so no count exchange precedes
  it; optionally FP8. Its tangent is a GATHER_COPY transport of x's tangent along the
  routing it returned (the derivative of FP8 rounding taken as 1: straight through).
* ``moe_transport_send`` and ``moe_recv``: split-phase halves (moe_dispatch with
  ``split=True`` is the host dispatch's send half; ffi/cpu/moe_split.h, ffi/cuda/split.h).
  The send returns at once with results the data movement fills later; the receive half
  takes them (aliased: no copy) and completes when it is done. The receive half's value
  equals the fused call on the operands it keeps alive, so its JVP is that call's, and
  the send half's results carry no tangent.

Every call is a collective over the expert-parallel axis.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax._src.interpreters import ad
from jax.sharding import PartitionSpec as P

from jaxcomm._src import callsite, compat, config, primitive
from jaxcomm._src.ops import common, table

GATHER_COPY = table.moe_mode("gather_copy")
GATHER_SCALED = table.moe_mode("gather_scaled")
REDUCE = table.moe_mode("reduce")
DOT = table.moe_mode("dot")
GATHER_SPARSE = table.moe_mode("gather_sparse")
GATHER_DEQUANT = table.moe_mode("gather_dequant")
GATHER_DEQUANT_SPARSE = table.moe_mode("gather_dequant_sparse")
# moe_dispatch's FP8 modes: none, delivered dequantized (in x's dtype), delivered as FP8.
FP8_NONE = table.moe_fp8("none")
FP8_DEQUANTIZED = table.moe_fp8("dequantize")
FP8_RAW = table.moe_fp8("raw")
# One float32 scale per this many channels of a token (core/number_formats.h kFp8Block).
FP8_BLOCK = 128
# int32 words of a split call's status block (ffi/cpu/moe_split.h kStatusWords).
STATUS_WORDS = 128
RAW_NOT_DIFFERENTIABLE = ("jaxcomm.moe: a dispatch that delivers FP8 values (fp8='raw') is not "
                          "differentiable; differentiate fp8='dequantize', whose gradient is a "
                          "bfloat16 combine")
# The route table's trailing counters (moe_dispatch.h): dropped, invalid, recv_dropped.
COUNTERS = ("dropped", "invalid", "recv_dropped")

_F32 = jnp.float32
_I32 = jnp.int32
_FP8 = jnp.float8_e4m3fn


def available(dtype: Any, group_size: int | None = None) -> bool:
    """Whether the fused transports serve this program: the host backend, or the CUDA
    backend for a group whose GPUs are in this process; whole-byte dtypes."""
    return not common.use_xla("moe_transport", dtype, group_size=group_size)


def on_host() -> bool:
    """Whether the fused primitives run on the host backend, which also has the fused
    dispatch (routing inside the call, FP8 quantized in it). The CUDA backend serves every
    transport mode and the split halves; its routing is planned in XLA."""
    return jax.default_backend() == "cpu" and not config.emulate_cuda()


def fp8_blocks(H: int) -> int:
    """Scales per token of an FP8 row of H channels."""
    return -(-H // FP8_BLOCK)


# ------------------------------------------------------------------------ shared rules

# The params every MoE primitive carries (_common_params).
_COMMON = ("axes", "call_site", "timeout_ms", "vma_checked", "shards", "dim0", "mesh")


def _common_of(params: dict) -> dict:
    return {k: params[k] for k in _COMMON}


def _result_aval(ref: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """An aval like operand ``ref``'s with another shape and dtype; a sharding in ref's type
    (explicit mesh axes) carries over to dim 0, as every MoE result splits like the tokens."""
    sharding = getattr(ref, "sharding", None)
    spec = getattr(sharding, "spec", None)
    kw = {}
    if spec is not None and hasattr(sharding, "update"):
        first = spec[0] if len(spec) else None
        kw["sharding"] = sharding.update(spec=P(*([first] + [None] * (len(shape) - 1))[:len(shape)]))
    return ref.update(shape=tuple(shape), dtype=jnp.dtype(dtype), weak_type=False, **kw)


def _typed_like_first(shapes: Callable[..., list[tuple[tuple[int, ...], Any]]]) -> Callable[..., list]:
    """A spec's out_avals from ``shapes`` (each result's (shape, dtype) from the operand avals
    and params; shapes global when ``params["shards"]``): every result typed like the first
    operand (:func:`_result_aval`)."""
    def out_avals(first: Any, *rest: Any, **params: Any) -> list:
        return [_result_aval(first, s, d) for s, d in shapes(first, *rest, **params)]
    return out_avals


def _block_params(params: dict, shards: int) -> dict:
    """A global-view call's params for one of its ``shards`` blocks (the spec's
    ``global_view``): the expert rows divided among them."""
    return dict(params, rows=params["rows"] // shards) if "rows" in params else params


_VMAP_AXIS = "jaxcomm.moe over the vmap axis: use a shard_map axis"
# Under vmap: one call per batch element (the routing spans all of a call's rows).
_PER_ELEMENT = primitive.PerElementVmap(axis_error=_VMAP_AXIS)


def _refuse_vmap(axis_data: Any, vals_in: Any, dims_in: Any, **params: Any):
    """The split halves' vmap rule: stacking the send half's results would copy them while
    they are being written."""
    if axis_data.name in params["axes"]:
        raise NotImplementedError(_VMAP_AXIS)
    raise NotImplementedError("jaxcomm.moe's split-phase calls (send/recv) under jax.vmap: "
                              "use the fused dispatch/combine there")


def _mode_attr(mode: int, **_: Any) -> dict:
    """The handler attribute of moe_transport and moe_transport_send."""
    return {"mode": int(mode)}


def _define(name: str, shapes: Callable[..., list], ffi_attrs: Callable[..., dict],
            batcher: Any = None, **spec: Any) -> primitive.Primitive:
    """An MoE primitive: a CollectiveSpec with what every MoE op shares. Results vary over
    the group (each rank gets its own rows), typed like the first operand; no dimension
    XLA may split (the routing spans all rows); the global view's blocks divide the rows;
    vmap as one call per batch element unless ``batcher`` says otherwise."""
    return primitive.define(primitive.CollectiveSpec(
        name=name, out_avals=_typed_like_first(shapes), invariant_result=False,
        ffi_attrs=ffi_attrs, batcher=batcher or _PER_ELEMENT, batch_dims=None,
        global_view=_block_params, **spec))


def _common_params(x: jax.Array, axis_name: Any, shards: int, dim0: tuple, mesh: Any
                   ) -> tuple[jax.Array, dict]:
    """(x, the params every MoE primitive carries): inside shard_map (shards == 0) x is
    cast to varying over the axes as jax.lax does; in the global view nothing is bound."""
    if shards:
        params = dict(axes=tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,),
                      call_site=callsite.user_call_site(), timeout_ms=config.timeout_ms(None),
                      vma_checked=False)
    else:
        x, params = common.prepare("moe", x, axis_name, None)
    params.update(shards=shards, dim0=tuple(dim0), mesh=getattr(mesh, "abstract_mesh", mesh))
    return x, params


def _zero(primal: Any) -> ad.Zero:
    """The symbolic zero tangent of ``primal``."""
    return ad.Zero(jax.typeof(primal).to_tangent_aval())


def _bind(prim: primitive.Primitive, args: Sequence[jax.Array], params: dict) -> Any:
    """Binds ``prim``, every operand cast to varying over the group's axes under check_vma."""
    if params["vma_checked"]:
        args = [compat.pvary(a, tuple(x for x in params["axes"] if x not in compat.vma(jax.typeof(a))))
                for a in args]
    return prim.bind(*args, **params)


# ------------------------------------------------------------------------ moe_transport

def _transport_avals(src, dest, pos, w, g, *, mode, rows, out_dtype, **_):
    T, K = dest.shape
    H = src.shape[1]
    if mode in (GATHER_COPY, GATHER_SPARSE):
        return [((rows, H), src.dtype)]
    if mode in (GATHER_SCALED, GATHER_DEQUANT, GATHER_DEQUANT_SPARSE):
        return [((rows, H), out_dtype)]
    if mode == REDUCE:
        return [((T, H), out_dtype)]
    return [((T, K), _F32)]


moe_transport_p = _define("moe_transport", _transport_avals, _mode_attr)

# Operand positions: src, dest, pos, w, g. The float operands each mode is linear in.
_SRC, _W, _G = 0, 3, 4
_LINEAR = {GATHER_COPY: (_SRC,), GATHER_SPARSE: (_SRC,), GATHER_SCALED: (_SRC, _W),
           REDUCE: (_SRC, _W), DOT: (_SRC, _G), GATHER_DEQUANT: (), GATHER_DEQUANT_SPARSE: ()}


def _transport_tangent(primals, tangents, *, mode, **params):
    """The product rule: one call per linear operand with a nonzero tangent, that operand
    replaced by its tangent; None when every tangent is zero."""
    terms = []
    for i in _LINEAR[mode]:
        if type(tangents[i]) is ad.Zero:
            continue
        args = list(primals)
        args[i] = tangents[i]
        terms.append(moe_transport_p.bind(*args, mode=mode, **params))
    return functools.reduce(jnp.add, terms) if terms else None


def _transport_jvp(primals, tangents, **params):
    out = moe_transport_p.bind(*primals, **params)
    t = _transport_tangent(primals, tangents, **params)
    return out, _zero(out) if t is None else t


ad.primitive_jvps[moe_transport_p] = _transport_jvp


def _transport_transpose(ct, src, dest, pos, w, g, *, mode, rows, out_dtype, **params):
    undefined = [ad.is_undefined_primal(a) for a in (src, dest, pos, w, g)]
    if undefined[1] or undefined[2]:
        raise ValueError("jaxcomm.moe: the routing tables are not differentiable")
    if mode in (GATHER_DEQUANT, GATHER_DEQUANT_SPARSE):
        raise ValueError("jaxcomm.moe: FP8 codes are not differentiable (the FP8 dispatch's "
                         "derivative moves x's cotangent instead)")
    avals = [a.aval if ad.is_undefined_primal(a) else None for a in (src, dest, pos, w, g)]
    if type(ct) is ad.Zero:
        return [ad.Zero(a) if a is not None else None for a in avals]

    def call(m, s, dtype, w_=None, g_=None, rows_=0):
        return _transport_bind(m, s, dest, pos, params, w=w_, g=g_, rows=rows_, out_dtype=dtype)

    out: list[Any] = [None] * 5
    if mode in (GATHER_COPY, GATHER_SPARSE):  # out[pos] = src[t]: each token sums its rows
        out[_SRC] = call(REDUCE, ct, avals[_SRC].dtype, w_=jnp.ones(dest.shape, _F32))
    elif mode == GATHER_SCALED:  # out[pos] = w * src[t]
        if undefined[_SRC]:
            out[_SRC] = call(REDUCE, ct, avals[_SRC].dtype, w_=w)
        else:
            out[_W] = call(DOT, ct, _F32, g_=src).astype(avals[_W].dtype)
    elif mode == REDUCE:  # y[t] = sum_k w * src[pos]
        if undefined[_SRC]:
            out[_SRC] = call(GATHER_SCALED, ct, avals[_SRC].dtype, w_=w, rows_=avals[_SRC].shape[0])
        else:
            out[_W] = call(DOT, src, _F32, g_=ct).astype(avals[_W].dtype)
    else:  # DOT: out[t, k] = <g[t], src[pos]>
        if undefined[_SRC]:
            out[_SRC] = call(GATHER_SCALED, g, avals[_SRC].dtype, w_=ct, rows_=avals[_SRC].shape[0])
        else:
            out[_G] = call(REDUCE, src, avals[_G].dtype, w_=ct)
    return out


ad.primitive_transposes[moe_transport_p] = _transport_transpose


def _transport_operands(mode: int, src: jax.Array, dest: jax.Array, pos: jax.Array, *,
                        w: jax.Array | None, g: jax.Array | None, out_dtype: Any
                        ) -> tuple[list[jax.Array], Any, Any]:
    """(operands, the dtype the call produces, the dtype asked for). Backends without half
    precision kernels get float32 operands; the caller casts the result."""
    T, K = dest.shape
    w = jnp.zeros((T, K), _F32) if w is None else w.astype(_F32)
    # The unused g has T rows, so that in the global view it splits like every operand.
    g = jnp.zeros((T, 1), _F32) if g is None else g
    want = made = jnp.dtype(out_dtype)
    if mode in (GATHER_DEQUANT, GATHER_DEQUANT_SPARSE):  # src: FP8 codes, g: their scales
        made = _kernel_float(made)
    elif mode not in (GATHER_COPY, GATHER_SPARSE):
        src, g, made = _kernel_float(src), _kernel_float(g), _kernel_float(made)
    return [src, dest.astype(_I32), pos.astype(_I32), w, g], made, want


_KERNEL_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _kernel_float(v: Any) -> Any:
    """A float operand (or result dtype) as the transport kernels take it: float32,
    bfloat16 and float16; others (float64) go through float32."""
    dtype = jnp.dtype(getattr(v, "dtype", v))
    if dtype in _KERNEL_FLOATS:
        return v
    return v.astype(_F32) if hasattr(v, "astype") else jnp.dtype(_F32)


def _transport_bind(mode: int, src: jax.Array, dest: jax.Array, pos: jax.Array, params: dict, *,
                    w: jax.Array | None, g: jax.Array | None, rows: int, out_dtype: Any) -> jax.Array:
    args, made, want = _transport_operands(mode, src, dest, pos, w=w, g=g, out_dtype=out_dtype)
    out = _bind(moe_transport_p, args, dict(params, mode=mode, rows=rows, out_dtype=made))
    return out if mode == DOT or made == want else out.astype(want)


def transport(mode: int, src: jax.Array, dest: jax.Array, pos: jax.Array, axis_name: Any, *,
              w: jax.Array | None = None, g: jax.Array | None = None, rows: int = 0,
              out_dtype: Any = None, shards: int = 0, dim0: tuple = (), mesh: Any = None) -> jax.Array:
    """One fused transport (see MoeMode in core/moe_modes.h for the modes).

    Args:
      mode: GATHER_COPY, GATHER_SCALED, REDUCE, DOT, GATHER_SPARSE, GATHER_DEQUANT or
        GATHER_DEQUANT_SPARSE.
      src: [T, H] token rows (gathers; FP8 codes for the dequantizing ones) or [rows, H]
        expert rows (REDUCE, DOT), float32, bfloat16 or float16 (any dtype for the copies).
      dest, pos: [T, K] int32 slot tables (destination rank and row there, or -1).
      w: [T, K] slot weights (GATHER_SCALED, REDUCE). g: [T, H] (DOT), or the FP8 scales
        [T, ceil(H/128)] (the dequantizing gathers).
      rows: expert rows of the gathers' result.
      out_dtype: the result dtype of GATHER_SCALED, REDUCE and the dequantizing gathers
        (default float32).
      shards, dim0, mesh: 0 inside shard_map; in the global view (outside it) the number
        of dim-0 blocks of every operand, the mesh axes they are sharded over and the mesh
        (globalview.mesh_of), with all shapes (rows included) global.

    Returns:
      [rows, H] (gathers: src's dtype for the copies), [T, H] (REDUCE) or [T, K] float32 (DOT).
    """
    src, params = _common_params(src, axis_name, shards, dim0, mesh)
    return _transport_bind(mode, src, dest, pos, params, w=w, g=g, rows=rows,
                           out_dtype=_F32 if out_dtype is None else out_dtype)


# ------------------------------------------------------------------------ moe_dispatch

def route_length(T: int, K: int, El: int, split: bool) -> int:
    """int32 words of one rank's route table (ffi/cpu/moe_dispatch.h)."""
    return (STATUS_WORDS if split else 0) + 2 * T * K + El + len(COUNTERS)


def _dispatch_avals(x, ids, *, rows, num_experts, ranks, fp8, split, shards, **_):
    n = max(shards, 1)
    T, H = x.shape
    K = ids.shape[1]
    ex_dtype = _FP8 if fp8 == FP8_RAW else x.dtype
    stage = [((T, H), _FP8), ((T, fp8_blocks(H)), _F32)] if fp8 else [((T, 0), _FP8), ((T, 0), _F32)]
    return [((rows, H), ex_dtype), ((n * route_length(T // n, K, num_experts // ranks, split),), _I32), *stage]


def _dispatch_attrs(**p: Any) -> dict:
    return {k: int(p[k]) for k in ("num_experts", "slab", "fp8", "zero_unused", "check_ids", "split")}


# Results: expert rows, route table, FP8 values and scales (empty unless fp8).
moe_dispatch_p = _define("moe_dispatch", _dispatch_avals, _dispatch_attrs, multiple_results=True)


def reshape_rows(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``a.reshape(shape)`` with dim 0 split over the same mesh axes as a's (a global-view
    array typed with explicit mesh axes needs the result's sharding said)."""
    sharding = getattr(jax.typeof(a), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or not len(spec) or spec[0] is None:
        return a.reshape(shape)
    out = sharding.update(spec=P(*([spec[0]] + [None] * (len(shape) - 1))))
    return jax.lax.reshape(a, shape, out_sharding=out)


class RouteTables:
    """The slot tables and counters in the route tables of ``n`` blocks (global view: one
    per dim-0 shard; inside shard_map one), sliced out as arrays sharded like the blocks:
    pos, dest [n*T, K], sizes [n*E_local], counters (scalars inside shard_map, else [n])."""

    def __init__(self, route: jax.Array, n: int, T: int, K: int, El: int, split: bool,
                 global_view: bool):
        blocks = reshape_rows(route, (n, route.shape[0] // n))
        at = STATUS_WORDS if split else 0
        TK = T * K
        self.pos = reshape_rows(blocks[:, at:at + TK], (n * T, K))
        self.dest = reshape_rows(blocks[:, at + TK:at + 2 * TK], (n * T, K))
        self.sizes = reshape_rows(blocks[:, at + 2 * TK:at + 2 * TK + El], (n * El,))
        tail = blocks[:, at + 2 * TK + El:]
        self.counters = {k: tail[:, i] if global_view else tail[0, i] for i, k in enumerate(COUNTERS)}


def _dispatch_jvp(primals, tangents, *, fp8, rows, num_experts, ranks, slab, zero_unused, split,
                  shards, **params):
    x, ids = primals
    outs = moe_dispatch_p.bind(x, ids, fp8=fp8, rows=rows, num_experts=num_experts, ranks=ranks,
                               slab=slab, zero_unused=zero_unused, split=split, shards=shards, **params)
    zeros = [_zero(o) for o in outs]
    if type(tangents[0]) is ad.Zero or split:
        # A send half's results carry no tangent: its receive half computes it (moe_recv).
        return outs, zeros
    n = max(shards, 1)
    route = RouteTables(outs[1], n, x.shape[0] // n, ids.shape[1], num_experts // ranks, False, shards > 0)
    t = dispatch_tangent(tangents[0], route, fp8=fp8, rows=rows, zero_unused=zero_unused,
                         params=_common_of(dict(params, shards=shards)))
    return outs, [t, *zeros[1:]]


def dispatch_tangent(tx: jax.Array, route: RouteTables, *, fp8: int, rows: int, zero_unused: bool,
                     params: dict) -> jax.Array:
    """The tangent of a fused dispatch's expert rows: x's tangent moved along its routing
    (straight through FP8's rounding)."""
    if fp8 == FP8_RAW:
        raise TypeError(RAW_NOT_DIFFERENTIABLE)
    mode = GATHER_COPY if zero_unused else GATHER_SPARSE
    return _transport_bind(mode, tx, route.dest, route.pos, params, w=None, g=None, rows=rows,
                           out_dtype=tx.dtype)


ad.primitive_jvps[moe_dispatch_p] = _dispatch_jvp


def dispatch(x: jax.Array, ids: jax.Array, axis_name: Any, *, num_experts: int, ranks: int, rows: int,
             slab: int, fp8: int = FP8_NONE, zero_unused: bool = True, check_ids: bool = False,
             split: bool = False, shards: int = 0, dim0: tuple = (), mesh: Any = None) -> list[jax.Array]:
    """The fused dispatch (ffi/cpu/moe_dispatch.h): [expert_x, route, fp8 values, scales].

    Args:
      x: [T, H] tokens; ids: [T, K] int32 expert ids (invalid ones already mapped into
        int32 by the caller).
      num_experts, ranks: E and the group size R.
      rows, slab: expert rows of the result and rows per expert (0: packed layout).
      fp8: FP8_NONE, FP8_DEQUANTIZED or FP8_RAW.
      zero_unused: zero the rows no assignment fills (else they are left unwritten).
      check_ids: fail on an expert id outside [-1, E) instead of counting it.
      split: the send half of a split-phase dispatch (the route table starts with its
        status block; see :func:`recv`).
      shards, dim0, mesh: the global view, as for :func:`transport`.
    """
    x, params = _common_params(x, axis_name, shards, dim0, mesh)
    params.update(num_experts=num_experts, ranks=ranks, rows=rows, slab=slab, fp8=fp8,
                  zero_unused=bool(zero_unused), check_ids=bool(check_ids), split=bool(split))
    return list(_bind(moe_dispatch_p, [x, ids.astype(_I32)], params))


# ------------------------------------------------------------------------ split phase

def _send_avals(src, dest, pos, w, g, *, shards, **params):
    return [*_transport_avals(src, dest, pos, w, g, **params), ((max(shards, 1) * STATUS_WORDS,), _I32)]


# Results: the transport's result (written after the call returns), the status block.
moe_transport_send_p = _define("moe_transport_send", _send_avals, _mode_attr, batcher=_refuse_vmap,
                               multiple_results=True)


def _send_jvp(primals, tangents, **params):
    outs = moe_transport_send_p.bind(*primals, **params)
    return outs, [_zero(o) for o in outs]


ad.primitive_jvps[moe_transport_send_p] = _send_jvp


def transport_send(mode: int, src: jax.Array, dest: jax.Array, pos: jax.Array, axis_name: Any, *,
                   w: jax.Array | None = None, g: jax.Array | None = None, rows: int = 0,
                   out_dtype: Any = None, shards: int = 0, dim0: tuple = (), mesh: Any = None
                   ) -> tuple[jax.Array, jax.Array, list[jax.Array]]:
    """The send half of :func:`transport` (any mode but GATHER_SCALED on CUDA): (result
    being written, status block, the operands the receive half keeps alive). Its result is
    ``made`` in the kernels' dtype: the caller casts after the receive."""
    src, params = _common_params(src, axis_name, shards, dim0, mesh)
    args, made, want = _transport_operands(mode, src, dest, pos, w=w, g=g,
                                           out_dtype=_F32 if out_dtype is None else out_dtype)
    params.update(mode=mode, rows=rows, out_dtype=made)
    out, status = _bind(moe_transport_send_p, args, params)
    return out, status, args


def _recv_avals(data, table, *keep, **_):
    return [(data.shape, data.dtype), (table.shape, table.dtype)]


# Operands: the send half's results, then every operand it published (kept alive).
moe_recv_p = _define("moe_recv", _recv_avals, lambda **_: {}, batcher=_refuse_vmap, multiple_results=True,
                     aliases={0: 0, 1: 1})  # the send half's results, completed in place: no copy


def _recv_jvp(primals, tangents, *, fused, **params):
    """The receive half's value is the fused call's on the operands it keeps alive, so its
    tangent is that call's tangent: a transport of the kept operands' tangents."""
    outs = moe_recv_p.bind(*primals, fused=fused, **params)
    data, table = outs
    keep, keep_t = primals[2:], tangents[2:]
    kind, info = fused[0], dict(fused[1:])
    common_params = _common_of(params)
    t = None
    if kind == "planned_dispatch":
        # keep: the send's transport operands (src, dest, pos, w, g), then x: x's tangent
        # moved along the routing (straight through FP8's rounding).
        if info["fp8"] == FP8_RAW:
            raise TypeError(RAW_NOT_DIFFERENTIABLE)
        if type(keep_t[-1]) is not ad.Zero:
            t = _transport_bind(info["tangent_mode"], keep_t[-1], keep[1], keep[2], common_params,
                                w=None, g=None, rows=info["rows"], out_dtype=keep_t[-1].dtype)
    elif kind == "dispatch":
        x, ids = keep[:2]
        if type(keep_t[0]) is not ad.Zero:
            n = max(params["shards"], 1)
            route = RouteTables(table, n, x.shape[0] // n, ids.shape[1], info["El"], True,
                                params["shards"] > 0)
            t = dispatch_tangent(keep_t[0], route, fp8=info["fp8"], rows=info["rows"],
                                 zero_unused=info["zero_unused"], params=common_params)
    else:
        t = _transport_tangent(keep, keep_t, **dict(common_params, **info))
    return outs, [_zero(data) if t is None else t, _zero(table)]


ad.primitive_jvps[moe_recv_p] = _recv_jvp


def recv(data: jax.Array, table: jax.Array, keep: Sequence[jax.Array], axis_name: Any, *,
         fused: tuple, shards: int = 0, dim0: tuple = (), mesh: Any = None) -> tuple[jax.Array, jax.Array]:
    """The receive half: (data, table) once the send half's data movement is done.

    Args:
      data, table: the send half's results (the result being written, and its route table
        or status block).
      keep: every operand the send half published, kept alive until the round is over.
      fused: what the pair computes, for the JVP: ("dispatch", (key, value)...) with El,
        fp8, rows, zero_unused (the host dispatch); ("planned_dispatch", ...) with fp8,
        rows and the tangent's transport mode (a dispatch planned in XLA, x last in
        ``keep``); or ("transport", ...) with the transport's params.
    """
    data, params = _common_params(data, axis_name, shards, dim0, mesh)
    params["fused"] = fused
    return tuple(_bind(moe_recv_p, [data, table, *keep], params))


def fused_key(kind: str, **info: Any) -> tuple:
    """A hashable description of a split pair's fused call (a primitive param)."""
    return (kind, *sorted(info.items()))

