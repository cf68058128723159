"""The global view: per-rank code run on dim-0 shards of global arrays (jaxcomm.moe's global
call form is built on it; CollectiveSpec.global_view lowers through it).

Under ``jax.jit`` on ``NamedSharding`` arrays (pjit style), an argument's type carries only an
abstract mesh: its devices are known once the program is lowered. jaxcomm's custom calls
need them (to map partitions to ranks), and a ``shard_map`` over an abstract mesh lowers
only under ``jax.set_mesh``. ``jax.experimental.custom_partitioning`` is handed the concrete
mesh by the partitioner, so :func:`sharded_call` runs the per-rank function there, with
every operand and result sharded on dim 0 over the same mesh axes (``dim0``) and all
mesh axes manual: the shard_map form over ``P(dim0)``, without set_mesh, and with no
all-gather of operands already laid out so.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxcomm._src import compat


def _rule(in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]],
          shards: int) -> tuple[str, dict[str, int]]:
    """A Shardy rule that ties dim 0 of every operand and result to one factor ``r``.

    Compound factors (``(r a0) b0 -> (r a1) b1``) keep the results sharded like the
    operands where ``a0 b0 -> a1 b1`` would leave them replicated; every factor that
    appears only inside a compound one needs its size.
    """
    sizes: dict[str, int] = {"r": shards}
    count = iter(range(1 << 30))

    def one(shape: tuple[int, ...]) -> str:
        rest = " ".join(f"b{next(count)}" for _ in shape[1:])
        if shape[0] == shards:  # Shardy refuses a size-1 factor inside a compound one
            return f"r {rest}".strip()
        name = f"a{next(count)}"
        sizes[name] = shape[0] // shards
        return f"(r {name}) {rest}".strip()

    lhs = ", ".join(one(s) for s in in_shapes)
    rhs = ", ".join(one(s) for s in out_shapes)
    if any(s[0] == shards for s in (*in_shapes, *out_shapes)):
        del sizes["r"]  # a whole dimension somewhere: Shardy infers it (and refuses it given)
    return f"{lhs} -> {rhs}", sizes


def sharded_call(local: Callable[..., Sequence[jax.Array]], args: Sequence[jax.Array],
                 out_shapes: Sequence[jax.ShapeDtypeStruct], shards: int,
                 dim0: tuple, mesh: Any) -> list[jax.Array]:
    """Runs ``local`` on the ``shards`` dim-0 blocks of ``args``; results concatenate on dim 0.

    Args:
      local: per-rank function, called inside the partitioned program with every mesh axis
        bound (manual); returns a sequence of arrays, block i of each result.
      args: global arrays (each dim 0 divisible by ``shards``).
      out_shapes: global shapes and dtypes of the results (dim 0 = shards * local dim 0).
      shards: product of the sizes of the mesh axes ``dim0``.
      dim0: mesh axes dim 0 is sharded over, e.g. ``("ep",)`` or ``("dp", "ep")``.
      mesh: the (abstract) mesh of the arguments' sharding, from :func:`mesh_of`.

    Returns:
      The results as global arrays sharded ``P(dim0)``.

    Example::

        y, = sharded_call(lambda v: [jaxcomm.all_reduce(v, "ep")], [x],
                          [jax.ShapeDtypeStruct(x.shape, x.dtype)], 4, ("ep",),
                          jax.typeof(x).sharding.mesh)
    """
    out_shapes = list(out_shapes)
    abstract = getattr(mesh, "abstract_mesh", mesh)
    # The partitioner calls back outside the caller's jax.enable_x64 context: without it,
    # int64 ids would be traced as int32 there (and 2**40 would wrap to a valid id).
    x64 = bool(jax.config.jax_enable_x64)

    @custom_partitioning
    def call(*xs):
        # Shapes (and, over explicit mesh axes, sharding types) only: with more than one
        # device the partitioner always calls `partition`, and mesh_of rejects one device.
        typed = NamedSharding(abstract, P(dim0)) if _explicit(abstract, dim0) else None
        return tuple(jnp.zeros(s.shape, s.dtype, out_sharding=typed) for s in out_shapes)

    def shardings(mesh: Any, n: int) -> tuple:
        return tuple(NamedSharding(mesh, P(dim0)) for _ in range(n))

    def partition(given, arg_shapes, result_shape):
        mesh = partition_mesh(given, abstract, arg_shapes)
        lower = per_rank(lambda *xs: tuple(local(*xs)), mesh, x64)
        return mesh, lower, shardings(mesh, len(out_shapes)), shardings(mesh, len(arg_shapes))

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, len(out_shapes))

    rule, sizes = _rule([a.shape for a in args], [s.shape for s in out_shapes], shards)
    # decode_shardings=False: the operands' shardings are not read (partition() sets them), and
    # decoding some that Shardy picks (e.g. over a subset of the axes) raises in jax.
    call.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                       decode_shardings=False, **sizes)
    return list(call(*args))


def partition_mesh(given: Any, abstract: Any, arg_shapes: Sequence[Any]) -> Mesh:
    """The concrete mesh a custom_partitioning ``partition`` callback lowers over."""
    if getattr(given, "empty", True) or tuple(given.axis_names) != tuple(abstract.axis_names):
        # jax passes an empty mesh when the program's context has no abstract mesh (e.g.
        # the arrays' mesh came from jax.set_mesh); the partitioner's device order is
        # the mesh's, as in jax's own abstract-to-concrete conversion.
        devices = np.asarray(compat.device_assignment(arg_shapes[0].sharding), dtype=object)
        return Mesh(devices.reshape(abstract.axis_sizes), abstract.axis_names)
    return given


def per_rank(local: Callable[..., Any], mesh: Mesh, x64: bool) -> Callable[..., Any]:
    """``local`` as a partition callback's lowering over ``mesh``: every mesh axis is manual
    there, and jaxcomm's ops check the names against the mesh in context, which the
    partitioner does not set; ``x64`` is the caller's (the partitioner calls back outside
    its jax.enable_x64 context)."""
    def lower(*xs: Any) -> Any:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.enable_x64(x64):
            return local(*xs)
    return lower


def _explicit(mesh: Any, axes: tuple) -> bool:
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
    return all(str(types.get(a, "")).endswith("Explicit") for a in axes)


def mesh_of(x: Any, axis_name: tuple, op: str) -> tuple[Any, tuple, int]:
    """(mesh, dim-0 axes, shard count) of the global view, from x's sharding.

    x's type gives the (abstract) mesh; dim 0's axes are those x is sharded over when its
    type says (explicit mesh axes) and they include ``axis_name``, else ``axis_name``.
    Falls back to the mesh in context (``jax.set_mesh``).
    """
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or not all(a in mesh.axis_names for a in axis_name):
        mesh, sharding = jax.sharding.get_abstract_mesh(), None  # jax.set_mesh's
    if mesh is None or getattr(mesh, "empty", True) or not all(a in mesh.axis_names for a in axis_name):
        raise NameError(f"jaxcomm.moe.{op}: axis {axis_name if len(axis_name) > 1 else axis_name[0]!r} "
                        f"is not bound by an enclosing shard_map, and x has no NamedSharding over a "
                        f"mesh with that axis: call it inside jax.shard_map, or under jax.jit on "
                        f"arrays sharded with NamedSharding (global view)")
    dim0 = axis_name
    spec = getattr(sharding, "spec", None)
    if spec is not None and len(spec) and spec[0] is not None:
        first = tuple(spec[0]) if isinstance(spec[0], (tuple, list)) else (spec[0],)
        if all(a in first for a in axis_name):
            dim0 = first
    if mesh.size == 1:
        raise NotImplementedError(f"jaxcomm.moe.{op}: the global view needs a mesh of more than one "
                                  f"device; call it inside jax.shard_map")
    return mesh, dim0, math.prod(mesh.shape[a] for a in dim0)
