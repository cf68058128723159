"""Tensor parallelism with its communication hidden behind the matmuls.

``all_gather_matmul`` and ``matmul_reduce_scatter`` are the two collective matmuls of a
tensor-parallel transformer layer (the all-gather before a column-parallel matmul, the
reduce-scatter after a row-parallel one), computed as rings of chunk matmuls whose blocks
travel by one-sided puts while the previous chunk's matmul runs. ``put_start`` /
``put_done`` expose the put underneath for overlapping a program's own work. See
docs/tp.md.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxcomm._src import compat
from jaxcomm._src.ops import common
from jaxcomm._src.tp import globalview as _global
from jaxcomm._src.tp import matmul as _matmul
from jaxcomm._src.tp.put import PendingPut, put_done, put_start

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "put_start", "put_done", "PendingPut"]


def _operands(op: str, x: Any, w: Any, axis: Any, axis_label: str) -> tuple[jax.Array, jax.Array, int]:
    """(x, w, ``axis`` made non-negative), checked."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    if x.ndim < 2:
        raise ValueError(f"jaxcomm.tp.{op}: x must have at least 2 dimensions ([..., rows, K]), got shape "
                         f"{x.shape}")
    if w.ndim != 2:
        raise ValueError(f"jaxcomm.tp.{op}: w must have 2 dimensions ([K, N]), got shape {w.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"jaxcomm.tp.{op}: x's last dimension ({x.shape[-1]}) must equal w's first "
                         f"({w.shape[0]}); shapes {x.shape} and {w.shape}")
    if x.dtype != w.dtype:
        raise TypeError(f"jaxcomm.tp.{op}: x and w must have one dtype, got {x.dtype} and {w.dtype}")
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        raise TypeError(f"jaxcomm.tp.{op}: takes floating or integer operands, got {x.dtype}")
    axis = common.as_int(f"tp.{op}", axis_label, axis)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"jaxcomm.tp.{op}: {axis_label}={axis} is out of range for x of shape {x.shape}")
    axis %= x.ndim
    if axis == x.ndim - 1:
        raise ValueError(f"jaxcomm.tp.{op}: {axis_label}={axis} names x's contracted (last) dimension; "
                         f"it must name a row dimension (use jaxcomm.all_gather and a dot otherwise)")
    return x, w, axis


def _in_shard_map(axis_name: Any) -> bool:
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    return all(compat.axis_exists(a) for a in names)


def _global_ring(op: str, x: jax.Array, w: jax.Array, axis_name: Any, axis: int, chunks: Any,
                 direction: Any, timeout_s: Any, precision: Any,
                 step_bytes: Callable[[int], int]) -> tuple[Any, tuple, _matmul.Ring]:
    """The global view's (mesh, other row axes, ring): x's rows (dimension ``axis``) are
    split over the other mesh axes its sharding names there, then ``axis_name``;
    ``step_bytes(rows per rank)`` is what moves per ring step."""
    if not isinstance(axis_name, str):
        raise NotImplementedError(f"jaxcomm.tp.{op}: the global view takes one mesh axis name, got {axis_name!r}; "
                                  f"call it inside jax.shard_map for a tuple of axes")
    mesh, rows = _global.mesh_and_rows(op, x, w, axis_name, axis)
    R = int(dict(zip(mesh.axis_names, mesh.axis_sizes))[axis_name])
    shards = R
    for a in rows:
        shards *= int(dict(zip(mesh.axis_names, mesh.axis_sizes))[a])
    if x.shape[axis] % shards:
        raise ValueError(f"jaxcomm.tp.{op}: x's dimension {axis} ({x.shape[axis]}) is not divisible by the "
                         f"{shards} ranks of mesh axes {rows + (axis_name,)}")
    block = x.shape[axis] // shards  # rows per rank (gathered op: of x; scattering op: of the result)
    ring = _matmul.plan(op, axis_name, axis, block, chunks=chunks, direction=direction, timeout_s=timeout_s,
                        precision=precision, step_bytes=step_bytes(block), size=R)
    return mesh, rows, ring


def all_gather_matmul(x: Any, w: Any, axis_name: Any, *, gather_axis: int = 0, chunks: int | None = None,
                      direction: str | None = None, precision: Any = None,
                      timeout_s: float | None = None) -> jax.Array:
    """``jax.lax.all_gather(x, axis_name, axis=gather_axis, tiled=True) @ w``, with the
    gather hidden behind the matmul.

    Call inside ``jax.shard_map`` (under ``jax.jit``) over ``axis_name``: the R ranks'
    blocks of x are gathered along ``gather_axis`` while each block already received is
    multiplied into its place: a ring of R steps, each step's put of the block held (to the
    next rank) overlapping its matmul. Or call it in the global view, under ``jax.jit`` on
    global arrays with a ``NamedSharding`` (one mesh axis ``axis_name``): x's rows split
    over ``axis_name`` (and other mesh axes before it, e.g. ``P(("dp", "tp"))``), w's
    columns over ``axis_name``; the result is ``x @ w`` with its columns split there.

    Args:
      x: this rank's block, ``[..., m, ..., K]``: any leading batch dimensions; the
        gathered dimension ``gather_axis`` is any but the last (contracted) one. float32,
        bfloat16, float16, float64 or an integer dtype.
      w: ``[K, N]``, x's dtype: typically this rank's column block of a weight (a
        column-parallel layer: the MLP's up-projection, attention's QKV projection).
      axis_name: mesh axis name, or tuple of names, of the enclosing shard_map.
      gather_axis: x's dimension to gather (default 0: rows).
      chunks: pieces each block is cut into, each its own put (default: 1 one-way, 2
        bidirectional).
      direction: ``"one_way"`` (a ring, every piece to rank + 1), ``"bidirectional"``
        (alternate pieces to rank + 1 and rank - 1, as in the shard_map docs' collective
        matmul) or ``"none"`` (no ring: ``jaxcomm.all_gather``, then one matmul). Default:
        ``"none"`` where a block is under 256 KiB (a ring step's synchronisation costs
        more than such a block's transfer could hide), else one-way on 2 ranks and
        bidirectional above.
      precision: passed to the chunk matmuls (``jnp.matmul``).
      timeout_s: deadline of each put (default ``JAXCOMM_TIMEOUT_S``).

    Returns:
      ``[..., R * m, ..., N]`` in x's dtype, varying over ``axis_name``. Half precision is
      multiplied with float32 accumulation and rounded once per element (the unfused
      composition in XLA:CPU rounds alike: equal within bfloat16/float16 rounding, 1e-2
      relative); float32 and integers equal the unfused composition exactly.

    Differentiable (reverse mode: the gradient with respect to x is a
    ``matmul_reduce_scatter``, with respect to w a local product with the gathered x) and
    vmappable. Example (8 CPU devices)::

        >>> mesh = jax.make_mesh((8,), ("tp",))
        >>> x = jax.device_put(jnp.ones((64, 16)), NamedSharding(mesh, P("tp")))     # rows split
        >>> w = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P(None, "tp")))  # columns split
        >>> f = jax.jit(jax.shard_map(lambda x, w: jaxcomm.tp.all_gather_matmul(x, w, "tp"), mesh=mesh,
        ...                           in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
        >>> f(x, w).shape                                    # [64, 32]: all rows, all columns
        (64, 32)
    """
    x, w, axis = _operands("all_gather_matmul", x, w, gather_axis, "gather_axis")
    if not _in_shard_map(axis_name):
        mesh, rows, ring = _global_ring("all_gather_matmul", x, w, axis_name, axis, chunks, direction, timeout_s,
                                        precision, lambda block: block * x.size // x.shape[axis] * x.dtype.itemsize)
        return _global.all_gather_matmul(x, w, ring, mesh, rows)
    ring = _matmul.plan("all_gather_matmul", axis_name, axis, x.shape[axis], chunks=chunks, direction=direction,
                        timeout_s=timeout_s, precision=precision, step_bytes=x.size * x.dtype.itemsize)
    return _matmul.all_gather_matmul_p(x, w, ring)


def matmul_reduce_scatter(x: Any, w: Any, axis_name: Any, *, scatter_dimension: int = 0,
                          chunks: int | None = None, direction: str | None = None, precision: Any = None,
                          timeout_s: float | None = None) -> jax.Array:
    """``jax.lax.psum_scatter(x @ w, axis_name, scatter_dimension=scatter_dimension,
    tiled=True)``, with the reduce-scatter hidden behind the matmul.

    Call inside ``jax.shard_map`` (under ``jax.jit``) over ``axis_name``: each block's
    partial sums travel around the ring, each rank adding its share, while the next
    block's share is computed. In the global view (as :func:`all_gather_matmul`'s): x's
    columns split over ``axis_name``, w's rows too; the result is ``x @ w`` with its rows
    split over ``axis_name`` (after the other mesh axes x's rows are split over).

    Args:
      x: ``[..., M, ..., K]``: any leading batch dimensions; ``scatter_dimension`` is any
        but the last (contracted) one, of a size divisible by the group size R.
        Typically this rank's column block of activations (a row-parallel layer: the MLP's
        down-projection, attention's output projection).
      w: ``[K, N]``, x's dtype: this rank's row block of the weight.
      axis_name, chunks, direction, precision, timeout_s: as in :func:`all_gather_matmul`.

    Returns:
      ``[..., M / R, ..., N]`` in x's dtype: this rank's block of the summed product.
      Half precision accumulates in float32 along the ring and rounds once (more accurate
      than the unfused composition, which rounds each addition: equal within 1e-2
      relative); integers equal it exactly; float32 equals it up to the order of the R
      additions (the ring adds rank b + 1's share first for block b).

    Differentiable (the gradient with respect to x is an ``all_gather_matmul``) and
    vmappable. Example (8 CPU devices)::

        >>> mesh = jax.make_mesh((8,), ("tp",))
        >>> h = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P(None, "tp")))  # columns split
        >>> w = jax.device_put(jnp.ones((32, 16)), NamedSharding(mesh, P("tp")))        # rows split
        >>> f = jax.jit(jax.shard_map(lambda h, w: jaxcomm.tp.matmul_reduce_scatter(h, w, "tp"), mesh=mesh,
        ...                           in_specs=(P(None, "tp"), P("tp")), out_specs=P("tp")))
        >>> y = f(h, w)                                      # rows split again, summed over the ranks
        >>> y.shape, float(np.asarray(y)[0, 0])
        ((64, 16), 32.0)
    """
    x, w, axis = _operands("matmul_reduce_scatter", x, w, scatter_dimension, "scatter_dimension")
    if not _in_shard_map(axis_name):
        acc = _matmul.accumulator(x.dtype)
        mesh, rows, ring = _global_ring("matmul_reduce_scatter", x, w, axis_name, axis, chunks, direction,
                                        timeout_s, precision,
                                        lambda block: block * x.size // x.shape[axis] // x.shape[-1]
                                        * w.shape[1] * acc.itemsize)
        return _global.matmul_reduce_scatter(x, w, ring, mesh, rows)
    ring = _matmul.plan("matmul_reduce_scatter", axis_name, axis, 0, chunks=chunks, direction=direction,
                        timeout_s=timeout_s, precision=precision)
    if x.shape[axis] % ring.size:
        raise ValueError(f"jaxcomm.tp.matmul_reduce_scatter: x's dimension {axis} ({x.shape[axis]}) is not "
                         f"divisible by the group size {ring.size}")
    acc = _matmul.accumulator(x.dtype)
    step_bytes = x.size // x.shape[-1] // ring.size * w.shape[1] * acc.itemsize  # one block's partial sums
    ring = _matmul.plan("matmul_reduce_scatter", axis_name, axis, x.shape[axis] // ring.size, chunks=chunks,
                        direction=direction, timeout_s=timeout_s, precision=precision, step_bytes=step_bytes)
    return _matmul.matmul_reduce_scatter_p(x, w, ring)
