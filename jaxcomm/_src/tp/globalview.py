"""The global view of jaxcomm.tp: the collective matmuls called under ``jax.jit`` on
global arrays with a ``NamedSharding`` (no shard_map), as jaxcomm.moe's global view.

Globally both ops are a plain matmul ``x @ w`` with a tensor-parallel layout:
  all_gather_matmul:     x rows over ``axes`` (and, before them, other mesh axes such as a
                         data-parallel "dp"), w columns over ``axis`` -> y rows over the
                         other axes, columns over ``axis``;
  matmul_reduce_scatter: x columns over ``axis`` (rows over the other axes), w rows over
                         ``axis`` -> y rows over all of them.
``jax.experimental.custom_partitioning`` hands the partitioner's concrete mesh to the
per-rank ring (matmul.py), every mesh axis manual there, and asks for the operands in
that layout (XLA reshards an operand laid out otherwise). It has no differentiation rule:
a custom_vjp around it gives each op's backward as the other op (global too), and w's
gradient as a plain product that XLA partitions.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxcomm._src import globalview
from jaxcomm._src.tp import matmul


def _has_axis(mesh: Any, axis: str) -> bool:
    return mesh is not None and not getattr(mesh, "empty", True) and axis in mesh.axis_names


def mesh_and_rows(op: str, x: jax.Array, w: jax.Array, axis: str, row_dim: int) -> tuple[Any, tuple]:
    """(the abstract mesh of x's sharding, else w's, else jax.set_mesh's; the mesh axes x's
    ``row_dim`` is split over besides ``axis``, where x's type says: explicit axes)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if not _has_axis(mesh, axis):
        sharding = None
        mesh = getattr(getattr(jax.typeof(w), "sharding", None), "mesh", None)
    if not _has_axis(mesh, axis):
        mesh = jax.sharding.get_abstract_mesh()
    if not _has_axis(mesh, axis):
        raise NameError(f"jaxcomm.tp.{op}: axis {axis!r} is not bound by an enclosing shard_map, and x has no "
                        f"NamedSharding over a mesh with that axis: call it inside jax.shard_map, or under "
                        f"jax.jit on arrays sharded with NamedSharding (global view)")
    spec = tuple(getattr(sharding, "spec", ()) or ())
    entry = spec[row_dim] if row_dim < len(spec) else None
    rows = tuple(entry) if isinstance(entry, (tuple, list)) else (() if entry is None else (entry,))
    return mesh, tuple(a for a in rows if a != axis)


def _spec(ndim: int, **dims: Any) -> P:
    entries: list[Any] = [None] * ndim
    for d, axes in dims.items():
        axes = tuple(a for a in axes if a)
        entries[int(d[1:])] = axes if len(axes) > 1 else (axes[0] if axes else None)
    return P(*entries)


def partitioned(local: Callable[..., jax.Array], args: list[jax.Array], in_specs: list[P], out_shape: Any,
                out_spec: P, mesh: Any, rule: str) -> jax.Array:
    """``local`` (per rank, every mesh axis manual) on operands laid out as ``in_specs``,
    the result laid out as ``out_spec`` (global shape ``out_shape``)."""
    abstract = getattr(mesh, "abstract_mesh", mesh)
    explicit = all(str(t).endswith("Explicit") for t in getattr(abstract, "axis_types", ()))
    x64 = bool(jax.config.jax_enable_x64)

    @custom_partitioning
    def call(*xs):
        typed = NamedSharding(abstract, out_spec) if explicit else None
        return jnp.zeros(out_shape.shape, out_shape.dtype, out_sharding=typed)

    def partition(given, arg_shapes, result_shape):
        concrete = globalview.partition_mesh(given, abstract, arg_shapes)
        return (concrete, globalview.per_rank(local, concrete, x64), NamedSharding(concrete, out_spec),
                tuple(NamedSharding(concrete, s) for s in in_specs))

    call.def_partition(partition, infer_sharding_from_operands=lambda m, a, r: NamedSharding(m, out_spec),
                       sharding_rule=rule, decode_shardings=False)
    return call(*args)


def _rule(ndim: int, row_dim: int, rows_in: str, rows_out: str, k_in: str, n_out: str) -> str:
    lead = [f"b{i}" for i in range(ndim - 1)]
    x = list(lead) + [k_in]
    x[row_dim] = rows_in
    y = list(lead) + [n_out]
    y[row_dim] = rows_out
    return f"{' '.join(x)}, {k_in} {n_out} -> {' '.join(y)}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def all_gather_matmul(x: jax.Array, w: jax.Array, ring: matmul.Ring, mesh: Any, rows: tuple) -> jax.Array:
    g, axis = ring.axis, ring.axis_name
    x_spec = _spec(x.ndim, **{f"d{g}": rows + (axis,)})
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[1],), x.dtype)
    y_spec = _spec(x.ndim, **{f"d{g}": rows, f"d{x.ndim - 1}": (axis,)})
    return partitioned(lambda xb, wb: matmul.gather_matmul(xb, wb, ring)[0], [x, w], [x_spec, P(None, axis)],
                       out, y_spec, mesh, _rule(x.ndim, g, "m", "m", "k", "n"))


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, ring: matmul.Ring, mesh: Any, rows: tuple) -> jax.Array:
    return _mrs(x, w, ring, mesh, rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _mrs(x: jax.Array, w: jax.Array, ring: matmul.Ring, mesh: Any, rows: tuple) -> jax.Array:
    g, axis = ring.axis, ring.axis_name
    x_spec = _spec(x.ndim, **{f"d{g}": rows, f"d{x.ndim - 1}": (axis,)})
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[1],), x.dtype)
    y_spec = _spec(x.ndim, **{f"d{g}": rows + (axis,)})
    return partitioned(lambda xb, wb: matmul.matmul_scatter(xb, wb, ring), [x, w], [x_spec, P(axis, None)],
                       out, y_spec, mesh, _rule(x.ndim, g, "m", "m", "k", "n"))


def _contract(a: jax.Array, b: jax.Array, like: jax.Array) -> jax.Array:
    """a^T b over every dimension but the last, laid out as ``like`` (w): over explicit
    mesh axes jax asks where a product over a sharded dimension goes."""
    lead = tuple(range(a.ndim - 1))
    sharding = getattr(jax.typeof(like), "sharding", None)
    explicit = sharding is not None and any(str(t).endswith("Explicit")
                                            for t in getattr(sharding.mesh, "axis_types", ()))
    out = jax.lax.dot_general(a, b, ((lead, lead), ((), ())), preferred_element_type=matmul.accumulator(a.dtype),
                              out_sharding=sharding if explicit else None)
    return out.astype(a.dtype)


def _agm_fwd(x, w, ring, mesh, rows):
    return all_gather_matmul(x, w, ring, mesh, rows), (x, w)


def _agm_bwd(ring, mesh, rows, res, ct):
    x, w = res
    return _mrs(ct, w.T, ring, mesh, rows), _contract(x, ct, w)


def _mrs_fwd(x, w, ring, mesh, rows):
    return _mrs(x, w, ring, mesh, rows), (x, w)


def _mrs_bwd(ring, mesh, rows, res, ct):
    x, w = res
    return all_gather_matmul(ct, w.T, ring, mesh, rows), _contract(x, ct, w)


all_gather_matmul.defvjp(_agm_fwd, _agm_bwd)
_mrs.defvjp(_mrs_fwd, _mrs_bwd)
