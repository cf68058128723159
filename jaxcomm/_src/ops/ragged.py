"""ragged_all_to_all: jax.lax.ragged_all_to_all's semantics, on every backend jaxcomm has.

Handler: ffi/cpu/ragged.cc. One primitive carries a ``mode``: the forward op (0) and the two
halves of its transpose (1: towards ``operand``, 2: towards ``output``). The handler reads
every rank's offsets directly, so the transpose needs no all_to_all of the offsets (jax.lax
needs two), and it is exact where jax.lax's is not: rows of ``output`` that a received slice
overwrote get a zero cotangent even when a zero-size slice shares its offset with the next
slice, overlapping received slices give the gradient to the slice that won, and operand rows
sent twice accumulate both cotangents.
"""

from __future__ import annotations

from typing import Any


import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import ad, batching

from jaxcomm._src import compat, groups, primitive
from jaxcomm._src.ops import common, table

FORWARD = table.ragged_mode("forward")
TRANSPOSE_OPERAND = table.ragged_mode("transpose_operand")
ZERO_RECEIVED = table.ragged_mode("zero_received")


def _ffi_attrs(avals_in: Any, mode: int, src_rows: int, **_: Any) -> dict[str, int]:
    """The handler's rows: ``src_rows`` read and ``dst_rows`` written, per mode."""
    operand, output = (int(a.shape[0]) for a in avals_in[:2])
    if mode == FORWARD:
        src, dst = operand, output
    elif mode == TRANSPOSE_OPERAND:
        src, dst = output, operand
    else:
        src, dst = src_rows, output
    return {"mode": int(mode), "src_rows": src, "dst_rows": dst}


def _batcher(axis_data, vals_in, dims_in, *, mode: int, src_rows: int, **params):
    if axis_data.name in params["axes"]:
        raise NotImplementedError(
            f"jaxcomm.ragged_all_to_all over the vmap axis {axis_data.name!r}: use a shard_map axis")
    if all(d is None for d in dims_in):
        return ragged_all_to_all_p.bind(*vals_in, mode=mode, src_rows=src_rows, **params), None
    size = axis_data.size

    def front(x, d):
        return batching.bdim_at_front(x, d, size)

    def second(x, d):  # index arrays as [slices, batch], so merged slice k*B+b keeps k's rank
        if d is None:
            return jnp.broadcast_to(x[:, None], (x.shape[0], size))
        return jnp.moveaxis(x, d, 1)

    operand, output = (front(v, d) for v, d in zip(vals_in[:2], dims_in[:2]))
    io, ss, oo, rs = (second(v, d) for v, d in zip(vals_in[2:], dims_in[2:]))
    b = jnp.arange(size, dtype=io.dtype)[None, :]
    n_op, n_out = operand.shape[1], output.shape[1]
    if mode == FORWARD:
        io, oo = io + b * n_op, oo + b * n_out
    elif mode == TRANSPOSE_OPERAND:
        io, oo = io + b * n_out, oo + b * n_op
    else:
        io, oo = io + b * src_rows, oo + b * n_out
    merge = lambda x: x.reshape(-1, *x.shape[2:])
    out = ragged_all_to_all_p.bind(merge(operand), merge(output), *(x.reshape(-1) for x in (io, ss, oo, rs)),
                                   mode=mode, src_rows=src_rows * size, **params)
    return out.reshape(size, n_out, *out.shape[1:]), 0


ragged_all_to_all_p = primitive.define(primitive.CollectiveSpec(
    name="ragged_all_to_all",
    out_avals=lambda operand, output, *idx, **_: [output],  # result: output, slices written
    invariant_result=False,
    ffi_attrs=_ffi_attrs,
    aliases={1: 0},  # the result is written into `output`'s buffer
    batcher=_batcher,
    batch_dims=None,
))


def _jvp(primals, tangents, **params):
    operand, output, *idx = primals
    d_operand, d_output, *_ = tangents
    out = ragged_all_to_all_p.bind(operand, output, *idx, **params)
    if type(d_operand) is ad.Zero and type(d_output) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    d_operand = ad.instantiate_zeros(d_operand)
    d_output = ad.instantiate_zeros(d_output)
    return out, ragged_all_to_all_p.bind(d_operand, d_output, *idx, **params)


ad.primitive_jvps[ragged_all_to_all_p] = _jvp


def _zeros(aval: Any, axes: tuple, vma_checked: bool) -> jax.Array:
    z = jnp.zeros(aval.shape, aval.dtype)
    return compat.pvary(z, tuple(axes)) if vma_checked else z


def _transpose(ct, operand, output, *idx, mode: int, src_rows: int, **params):
    aval = lambda v: v.aval if ad.is_undefined_primal(v) else core.get_aval(v)
    want_operand, want_output = ad.is_undefined_primal(operand), ad.is_undefined_primal(output)
    nones = [None] * 4
    if type(ct) is ad.Zero:
        return [ad.Zero(aval(operand)) if want_operand else None,
                ad.Zero(aval(output)) if want_output else None, *nones]
    axes, checked = params["axes"], params["vma_checked"]
    bind = lambda a, b, m, rows=0: ragged_all_to_all_p.bind(a, b, *idx, mode=m, src_rows=rows, **params)
    operand_t = output_t = None
    dummy = lambda: _zeros(core.ShapedArray((1, *ct.shape[1:]), ct.dtype), axes, checked)
    if mode == FORWARD:
        if want_operand:
            operand_t = bind(ct, _zeros(aval(operand), axes, checked), TRANSPOSE_OPERAND)
        if want_output:
            output_t = bind(dummy(), ct, ZERO_RECEIVED, aval(operand).shape[0])
    elif mode == TRANSPOSE_OPERAND:
        if want_operand:  # the adjoint of "gather visible rows, add" is "write rows"
            operand_t = bind(ct, _zeros(aval(operand), axes, checked), FORWARD)
        if want_output:
            output_t = ct
    else:
        if want_operand:
            operand_t = ad.Zero(aval(operand))
        if want_output:
            output_t = bind(dummy(), ct, ZERO_RECEIVED, src_rows)
    return [operand_t, output_t, *nones]


ad.primitive_transposes[ragged_all_to_all_p] = _transpose


def _index_dtype(arrays: list) -> Any:
    wide = any(jnp.dtype(a.dtype).itemsize > 4 for a in arrays) and jax.config.jax_enable_x64
    return jnp.int64 if wide else jnp.int32


INDEX_NAMES = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")


class IndexDtypeError(ValueError, TypeError):
    """Offsets or sizes that are not integers: the ValueError jax.lax raises, and the
    TypeError jaxcomm raised before it followed jax.lax."""


def check_indices(idx: list) -> None:
    """jax.lax's checks of the four index arrays, in its order and with its error type
    (ValueError), so that a mistake fails the same way with either."""
    for name, a in zip(INDEX_NAMES, idx):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise IndexDtypeError(f"jaxcomm.ragged_all_to_all: offsets and sizes must be integers; "
                                  f"{name} has dtype {a.dtype}")
    for name, a in zip(INDEX_NAMES, idx):
        if a.ndim != 1 or a.shape[0] < 1:
            raise ValueError(f"jaxcomm.ragged_all_to_all: {name} must be 1-D with at least one "
                             f"entry, got shape {a.shape}")


def ragged_xla(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
               send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array,
               axis_name: Any, axis_index_groups: groups.IndexGroups = None) -> jax.Array:
    """Pure-JAX ragged_all_to_all (all_gather + local gather), for backends with none.

    XLA:CPU has no ragged-all-to-all. This moves R times the operand and cannot raise at run
    time: a slice whose offsets or sizes fall outside a buffer is skipped (not written).
    Differentiable by JAX's own rules.
    """
    del recv_sizes  # implied by the senders' send_sizes
    axes = groups.normalize_axes("ragged_all_to_all", axis_name)
    R = groups.group_size(axes, axis_index_groups)
    n_slices, n_op, n_out = input_offsets.shape[0], operand.shape[0], output.shape[0]
    m = n_slices // R
    r = groups.rank_in_group(axes, axis_index_groups)
    gather = lambda a: compat.jax_lax.all_gather(a, axis_name, axis_index_groups=axis_index_groups)
    every = gather(operand)  # [R, n_op, ...]
    pick = r * m + jnp.arange(m)
    io, ss, oo = (gather(a)[:, pick].reshape(-1) for a in (input_offsets, send_sizes, output_offsets))
    ok = (ss >= 0) & (io >= 0) & (io <= n_op - ss) & (oo >= 0) & (oo <= n_out - ss)
    rows = jnp.arange(n_out, dtype=oo.dtype)[:, None]
    cover = ok & (oo <= rows) & (rows < oo + ss)  # [n_out, R*m]
    j = jnp.arange(R * m)
    last = jnp.max(jnp.where(cover, j, -1), axis=1)  # later slices win, as in the forward op
    lj = jnp.maximum(last, 0)
    src_row = jnp.clip(io[lj] + jnp.arange(n_out) - oo[lj], 0, max(n_op - 1, 0))
    got = every[lj // m, src_row]
    keep = (last >= 0).reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(keep, got, output)


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                      send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array, *,
                      axis_name: Any, axis_index_groups: Any = None,
                      timeout_s: float | None = None) -> jax.Array:
    """Sends ragged slices of ``operand`` to the ranks of ``axis_name``: ``jax.lax.ragged_all_to_all``.

    With R ranks and N = m*R slices per rank, slice i (rows ``input_offsets[i] :
    input_offsets[i] + send_sizes[i]`` of ``operand``) goes to rank ``i // m`` and is written
    there at rows ``output_offsets[i] : + send_sizes[i]`` of its ``output`` (offsets are in
    the receiver's buffer). ``recv_sizes[s*m + q]`` on a receiver must equal the matching
    ``send_sizes`` on sender s. Rows of ``output`` that no slice writes keep their value.

    Args:
      operand: [N_op, ...] data to send.
      output: [M, ...] (same trailing shape and dtype) the result starts from.
      input_offsets, send_sizes, output_offsets, recv_sizes: [N] integers, N a multiple of R.
      axis_name: shard_map mesh axis (or tuple of axes).
      axis_index_groups: as in jax.lax: groups of axis indices exchanging among
        themselves (equal sizes, covering the axis once); R is then one group's size.

    Returns:
      [M, ...] ``output`` with the received slices written in (source, slice) order.

    Raises at trace time what jax.lax raises for the same mistake (ValueError for index
    arrays that are not 1-D integers, NameError for an unbound axis), and ValueError for
    mistakes jax.lax leaves to the compiler (operand and output disagreeing, a slice count
    that is not a multiple of R). At run time (from the program): an error naming the rank
    and slice when an offset or size would read or write outside a buffer, or recv_sizes
    disagree with send_sizes; nothing is written then.

    Example (jax.lax's, on an axis of 2 ranks)::

        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
        >>> put = lambda a: jax.device_put(jnp.array(a), NamedSharding(mesh, P("x")))
        >>> operand = put([1., 2., 2., 3., 4., 0.])  # rank 0: [1, 2, 2], rank 1: [3, 4, 0]
        >>> input_offsets, send_sizes = put([0, 1, 0, 1]), put([1, 2, 1, 1])
        >>> output_offsets, recv_sizes = put([0, 0, 1, 2]), put([1, 1, 2, 1])
        >>> f = jax.shard_map(
        ...     lambda *a: jaxcomm.ragged_all_to_all(a[0], jnp.zeros(4), *a[1:], axis_name="x"),
        ...     mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        >>> jax.jit(f)(operand, input_offsets, send_sizes, output_offsets, recv_sizes)
        Array([1., 3., 0., 0., 2., 2., 4., 0.], dtype=float32)
    """
    operand, output = jnp.asarray(operand), jnp.asarray(output)
    idx = [jnp.asarray(a) for a in (input_offsets, send_sizes, output_offsets, recv_sizes)]
    check_indices(idx)
    axes = groups.normalize_axes("ragged_all_to_all", axis_name)
    index_groups = groups.normalize_index_groups("ragged_all_to_all", axis_index_groups, axes)
    R = groups.group_size(axes, index_groups)
    if operand.ndim < 1 or output.ndim < 1:
        raise ValueError("jaxcomm.ragged_all_to_all: operand and output need at least one dimension")
    if operand.shape[1:] != output.shape[1:] or operand.dtype != output.dtype:
        raise ValueError(f"jaxcomm.ragged_all_to_all: operand {operand.dtype}{list(operand.shape)} and "
                         f"output {output.dtype}{list(output.shape)} must agree in dtype and in all "
                         f"but the first dimension")
    n = idx[0].shape[0]
    if any(a.shape[0] != n for a in idx):
        raise ValueError("jaxcomm.ragged_all_to_all: input_offsets, send_sizes, output_offsets and "
                         f"recv_sizes must have one length, got {[a.shape for a in idx]}")
    if n % R:
        raise ValueError(f"jaxcomm.ragged_all_to_all: {n} slices is not a multiple of the group size "
                         f"{R} of axis {groups.describe(axes)}")
    dt = _index_dtype(idx)
    idx = [a.astype(dt) for a in idx]
    if common.use_xla("ragged_all_to_all", operand.dtype, group_size=R):
        return ragged_xla(operand, output, *idx, axis_name=axis_name, axis_index_groups=index_groups)
    operand, params = common.prepare("ragged_all_to_all", operand, axis_name, timeout_s, index_groups)
    if params["vma_checked"]:
        def vary(a):
            return compat.pvary(a, tuple(x for x in axes if x not in compat.vma(jax.typeof(a))))
        output = vary(output)
        idx = [vary(a) for a in idx]
    return ragged_all_to_all_p.bind(operand, output, *idx, mode=FORWARD, src_rows=operand.shape[0],
                                    **params)
