"""Runs programs written against jax.lax with jax.lax and with jaxcomm.lax, in one program.

    from lax_util import both, assert_identical

    got, want = both(mesh, lambda lax, v: lax.psum(v, "x"), x)
    assert_identical(got, want)

``both(mesh, f, *args)`` gives device k the slice ``args[i][k]`` (leading dimension
mesh.size, devices in the mesh's row-major order) and runs ``f(jax.lax, *slices)`` and
``f(jaxcomm.lax, *slices)`` in one jit(shard_map) program. It returns the two results as
pytrees of numpy arrays stacked per device, after checking that both sides produced the same
pytree structure and the same JAX types (shape, dtype, weak type, varying/unreduced/reduced
axes: :func:`type_of`). With ``fast=True`` it also checks that the jaxcomm side contains jaxcomm collectives
and no jax.lax collective (no fallback).

The jaxcomm side takes a data dependency on every jax.lax result, so the two sides'
collectives never wait on each other in one device's program.
"""

from __future__ import annotations

from typing import Any, Callable

import ml_dtypes
import numpy as np

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm

#: jax.lax's collective primitives (none may appear on a fast jaxcomm side).
LAX_COLLECTIVE_PRIMS = frozenset({
    "psum", "pmax", "pmin", "psum_invariant", "all_gather", "all_gather_invariant",
    "all_gather_reduced", "reduce_scatter", "unreduced_reduce_scatter", "unreduced_psum",
    "all_to_all", "ppermute", "pbroadcast", "ragged_all_to_all"})


def primitives(jaxpr: Any) -> set[str]:
    """Names of every primitive in ``jaxpr`` and the jaxprs nested in it."""
    names: set[str] = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.tree.leaves(eqn.params, is_leaf=lambda v: isinstance(
                v, (jex_core.Jaxpr, jex_core.ClosedJaxpr))):
            if isinstance(sub, jex_core.ClosedJaxpr):
                names |= primitives(sub.jaxpr)
            elif isinstance(sub, jex_core.Jaxpr):
                names |= primitives(sub)
    return names


def _checksum(tree: Any) -> jax.Array:
    """An int32 computed from every leaf (a data dependency only: its value is irrelevant)."""
    total = jnp.zeros((), jnp.int32)
    for leaf in jax.tree.leaves(tree):
        total = total + jnp.sum(jnp.asarray(leaf) != 0, dtype=jnp.int32)
    return total


def _after(dep: jax.Array, xs: tuple) -> tuple:
    # x unchanged, bit for bit, but computed after dep: XLA cannot know dep's value.
    return tuple(jnp.where(dep == 0x5EED1E55, x + jnp.ones((), x.dtype) if x.dtype != jnp.bool_ else ~x, x)
                 for x in xs)


def both(mesh: Any, f: Callable[..., Any], *args: Any, check_vma: bool = True, fast: bool = True,
         sequence: bool = True) -> tuple[Any, Any]:
    """``(jaxcomm.lax result, jax.lax result)`` of ``f`` on each device's slice of ``args``."""
    axes = tuple(mesh.axis_names)
    spec = P(axes)
    for a in args:
        assert np.shape(a)[0] == mesh.size, np.shape(a)
    types: dict[str, Any] = {}

    def side(lib: Any, xs: tuple, name: str) -> Any:
        out = f(lib, *xs)
        types[name] = (jax.tree.structure(out), [jax.typeof(v) for v in jax.tree.leaves(out)])
        return out

    def body(*xs):
        xs = tuple(x[0] for x in xs)
        want = side(jax.lax, xs, "lax")
        got = side(jaxcomm.lax, _after(_checksum(want), xs) if sequence else xs, "jaxcomm")
        stack = lambda t: jax.tree.map(lambda v: jnp.expand_dims(v, 0), t)
        return stack(got), stack(want), jnp.zeros((1,), jnp.int8)

    placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in args]
    g = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec,
                              check_vma=check_vma))
    got, want, _ = g(*placed)
    assert types["jaxcomm"][0] == types["lax"][0], (types["jaxcomm"][0], types["lax"][0])
    for a, b in zip(types["jaxcomm"][1], types["lax"][1]):
        assert type_of(a) == type_of(b), f"jaxcomm.lax type {type_of(a)} != jax.lax type {type_of(b)}"
    if fast:
        assert_fast(mesh, f, *placed, check_vma=check_vma)
    return jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want)


def type_of(aval: Any) -> tuple:
    """What a program can observe of a value's type inside shard_map: shape, dtype, weak
    type and the varying/unreduced/reduced axes (not the abstract mesh that jax attaches to
    a Python scalar's sharding in some paths and not in others)."""
    return (aval.shape, aval.dtype, aval.weak_type, getattr(aval, "mat", None))


def assert_fast(mesh: Any, f: Callable[..., Any], *placed: Any, check_vma: bool = True) -> None:
    """The jaxcomm.lax side of ``f`` uses jaxcomm's collectives only."""
    spec = P(tuple(mesh.axis_names))
    flat = lambda out: jax.tree.map(lambda v: jnp.ravel(v)[None], out)
    program = jax.shard_map(lambda *xs: flat(f(jaxcomm.lax, *(x[0] for x in xs))), mesh=mesh,
                            in_specs=(spec,) * len(placed), out_specs=spec, check_vma=check_vma)
    names = primitives(jax.make_jaxpr(program)(*placed).jaxpr)
    assert not names & LAX_COLLECTIVE_PRIMS, f"fell back to jax.lax: {sorted(names & LAX_COLLECTIVE_PRIMS)}"
    assert any(n.startswith("jaxcomm_") for n in names), f"no jaxcomm collective in {sorted(names)}"


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    if a.dtype == np.bool_:
        return a.view(np.uint8)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.itemsize in (1, 2, 4, 8) else \
        a.view(np.uint8)


def assert_identical(got: Any, want: Any, what: str = "") -> None:
    """Same pytree, dtypes and shapes, and every value the same bits (NaN payloads and the
    sign of zero included)."""
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (what, g.dtype, g.shape, w.dtype, w.shape)
        if not np.array_equal(_bits(g), _bits(w)):
            show = (lambda a: a.astype(np.float32)) if g.dtype == ml_dtypes.bfloat16 else (lambda a: a)
            raise AssertionError(f"{what}: jaxcomm.lax {show(g).ravel()[:16]} != jax.lax "
                                 f"{show(w).ravel()[:16]} (dtype {g.dtype})")
