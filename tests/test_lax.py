"""jaxcomm.lax against jax.lax: the same program run through both, compared bit for bit.

Each check traces its function twice in one jit(shard_map) program, once with ``jax.lax``
and once with ``jaxcomm.lax`` (lax_util.both), and requires the same pytree, the same JAX
types (weak types and varying/unreduced/reduced axes included) and the same bits. Where
jaxcomm serves the case (``fast``), the jaxcomm side must contain jaxcomm's collectives and
none of jax.lax's. Mistakes must raise jax.lax's exception type, with jaxcomm's message.
"""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import jax.test_util
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from jaxcomm._src import compat
from jaxcomm._src.dropin import collectives, route
from jaxcomm._src.ops import ragged as ragged_ops
from conftest import rand
from lax_util import LAX_COLLECTIVE_PRIMS, assert_identical, both, primitives

N = 8
GROUPS = [[0, 5, 2, 7], [4, 1, 6, 3]]  # index groups in no particular order
X64 = {"float64", "int64", "complex128"}


def same(mesh, f, *args, **kw):
    got, want = both(mesh, f, *args, **kw)
    assert_identical(got, want)
    return got


# ----------------------------------------------------------------------------- the module

@pytest.mark.parametrize("name", [*collectives.COLLECTIVES, "axis_index", "axis_size"])
def test_signature_is_jax_lax(name):
    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    assert params(getattr(jaxcomm.lax, name)) == params(getattr(compat.jax_lax, name))


def test_other_names_are_jax_lax():
    from jaxcomm import lax
    assert lax.dot is jax.lax.dot and lax.axis_index is jax.lax.axis_index
    assert lax.psum is not jax.lax.psum or jaxcomm._src.dropin.switch.is_active()
    with pytest.raises(AttributeError, match="jaxcomm.lax"):
        lax.no_such_function  # noqa: B018
    assert {"psum", "dot", "axis_size"} <= set(dir(lax))


# ------------------------------------------------------------------------------- pytrees

def _tree(v, i, b):
    return {"w": v, "pair": (v[..., :2].astype(jnp.bfloat16), i), "flag": b, "none": None,
            "list": [v[0, 0]]}


TREE_OPS = {
    "psum": lambda lax, t, ax: lax.psum(t, ax),
    "pmean": lambda lax, t, ax: lax.pmean({k: v for k, v in t.items() if k != "flag"}, ax),
    "pmax": lambda lax, t, ax: lax.pmax(t, ax),
    "pmin": lambda lax, t, ax: lax.pmin(t, ax),
    "all_gather": lambda lax, t, ax: lax.all_gather(t, ax, axis=0),
    "all_gather_tiled": lambda lax, t, ax: lax.all_gather({k: t[k] for k in ("w", "pair")}, ax,
                                                          axis=-1, tiled=True),
    "psum_scatter": lambda lax, t, ax: lax.psum_scatter(
        jax.tree.map(lambda v: jnp.tile(v, (8,) + (1,) * (v.ndim - 1)), [t["w"], t["pair"][1]]), ax,
        scatter_dimension=0, tiled=True),
    "all_to_all": lambda lax, t, ax: lax.all_to_all(
        jax.tree.map(lambda v: jnp.tile(v, (8,) + (1,) * (v.ndim - 1)), [t["w"], t["flag"]]), ax,
        0, 0, tiled=True),
    "ppermute": lambda lax, t, ax: lax.ppermute(t, ax, [(0, 3), (3, 1), (1, 0)]),
    "pshuffle": lambda lax, t, ax: lax.pshuffle(t, ax, [7, 0, 1, 2, 3, 4, 5, 6]),
}


def test_pytrees_of_mixed_dtypes(mesh2x4):
    v, i, b = rand((N, 2, 3), "float32", 1), rand((N, 4), "int32", 2), rand((N, 3), "bool", 3)
    same(mesh2x4, lambda lax, v, i, b: {op: f(lax, _tree(v, i, b), ("dp", "ep"))
                                        for op, f in TREE_OPS.items()}, v, i, b)


def test_small_leaves_share_calls(mesh8):
    # A gradient pytree of many small leaves: one call per type and 4 MiB, as XLA's
    # all-reduce combiner makes one; leaves over 256 KiB go alone. Same bits as jax.lax.
    small = [rand((N, 3, 5), "float32", s) for s in range(30, 50)]
    ints, big = rand((N, 7), "int32", 50), rand((N, 300, 256), "float32", 51)  # 300 KiB

    def f(lax, *xs):
        return lax.pmean({"small": list(xs[:-2]), "ints": xs[-2], "big": xs[-1]}, "x")
    same(mesh8, f, *small, ints, big)
    placed = [jax.device_put(a, NamedSharding(mesh8, P("x"))) for a in (*small, ints, big)]
    jaxpr = jax.make_jaxpr(jax.shard_map(lambda *xs: f(jaxcomm.lax, *(x[0] for x in xs)), mesh=mesh8,
                                         in_specs=(P("x"),) * len(placed), out_specs=P()))(*placed)
    calls = [e for e in jaxpr.jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "jaxcomm_all_reduce"]
    assert sorted(e.invars[0].aval.size for e in calls) == [7, 20 * 15, 300 * 256], calls


# -------------------------------------------------------------------- axis_index_groups

GROUP_OPS = {
    "all_gather": lambda lax, v: lax.all_gather(v, "x", axis_index_groups=GROUPS),
    "all_gather_tiled": lambda lax, v: lax.all_gather(v, "x", axis_index_groups=GROUPS, axis=1,
                                                      tiled=True),
    "psum_scatter": lambda lax, v: lax.psum_scatter(v[:4], "x", axis_index_groups=GROUPS),
    "psum_scatter_tiled": lambda lax, v: lax.psum_scatter(v, "x", axis_index_groups=GROUPS,
                                                          scatter_dimension=0, tiled=True),
    "all_to_all": lambda lax, v: lax.all_to_all(v, "x", 0, 1, axis_index_groups=GROUPS, tiled=True),
    "all_to_all_untiled": lambda lax, v: lax.all_to_all(v[:4], "x", 0, 1, axis_index_groups=GROUPS),
    "pswapaxes": lambda lax, v: lax.pswapaxes(v[:4], "x", 0, axis_index_groups=GROUPS),
    "pmax": lambda lax, v: lax.pmax({"a": v, "b": -v}, "x", axis_index_groups=GROUPS),
    "pmin": lambda lax, v: lax.pmin(v, "x", axis_index_groups=GROUPS),
}


def test_axis_index_groups(mesh8):
    same(mesh8, lambda lax, v: {op: f(lax, v) for op, f in GROUP_OPS.items()},
         rand((N, 8, 3), "float32", 4))


@pytest.mark.parametrize("op", ["psum", "pmean"])
def test_psum_groups_without_check_vma(mesh8, op):
    same(mesh8, lambda lax, v: getattr(lax, op)((v, v.astype(jnp.int32)), "x",
                                                 axis_index_groups=GROUPS),
         rand((N, 5), "float32", 5), check_vma=False)


@pytest.mark.parametrize("op", ["psum", "pmean"])
def test_psum_groups_where_jax_lax_refuses(mesh8, op):
    # jax.lax.psum raises NotImplementedError for axis_index_groups under check_vma (the
    # default); jaxcomm.lax computes jax.lax's check_vma=False result, typed invariant.
    x = rand((N, 5), "float32", 6)
    with pytest.raises(NotImplementedError):
        both(mesh8, lambda lax, v: getattr(lax, op)(v, "x", axis_index_groups=GROUPS), x)
    want, _ = both(mesh8, lambda lax, v: getattr(lax, op)(v, "x", axis_index_groups=GROUPS), x,
                   check_vma=False)
    run = jax.jit(jax.shard_map(
        lambda v: getattr(jaxcomm.lax, op)(v[0], "x", axis_index_groups=GROUPS)[None],
        mesh=mesh8, in_specs=P("x"), out_specs=P("x")))
    assert_identical(np.asarray(run(jax.device_put(x, NamedSharding(mesh8, P("x"))))), want)


def test_native_ops_take_pytrees_and_groups(mesh8):
    # jaxcomm.all_reduce & co. (jaxcomm's own names) take what jax.lax's take.
    def f(lax, v):
        if lax is jax.lax:
            gathered = jax.lax.all_gather(v, "x", axis_index_groups=GROUPS)
            return {"sum": jnp.sum(gathered, 0), "max": jax.lax.pmax((v, -v), "x", axis_index_groups=GROUPS),
                    "gather": gathered,
                    "scatter": jax.lax.psum_scatter(v, "x", axis_index_groups=GROUPS, tiled=True),
                    "a2a": jax.lax.all_to_all([v], "x", 0, 0, axis_index_groups=GROUPS, tiled=True),
                    "bcast": gathered[2],
                    "perm": jax.lax.ppermute(v, "x", [(0, 5), (5, 2), (4, 1), (1, 6)])}
        return {"sum": jaxcomm.all_reduce(v, "x", axis_index_groups=GROUPS),
                "max": jaxcomm.all_reduce((v, -v), "x", op="max", axis_index_groups=GROUPS),
                "gather": jaxcomm.all_gather(v, "x", axis_index_groups=GROUPS),
                "scatter": jaxcomm.reduce_scatter(v, "x", axis_index_groups=GROUPS, tiled=True),
                "a2a": jaxcomm.all_to_all([v], "x", 0, 0, axis_index_groups=GROUPS, tiled=True),
                "bcast": jaxcomm.broadcast(v, "x", root=2, axis_index_groups=GROUPS),
                # rank 0 -> 1 and 1 -> 2 within each group
                "perm": jaxcomm.ppermute(v, "x", [(0, 1), (1, 2)], axis_index_groups=GROUPS)}
    x = rand((N, 8, 2), "int32", 7)  # integer sums: exact in any order
    got, want = both(mesh8, f, x, fast=False, check_vma=False)
    assert_identical(got, want)


# ------------------------------------------------------------------------------ vmap axes

VMAP_OPS = {
    "psum": lambda lax, r: lax.psum(r, "v"),
    "psum_mixed": lambda lax, r: lax.psum(r, ("v", "x")),
    "pmean": lambda lax, r: lax.pmean({"r": r}, "v"),
    "pmax": lambda lax, r: lax.pmax(r, "v"),
    "all_gather": lambda lax, r: lax.all_gather(r, "v", axis=1),
    "all_gather_tiled": lambda lax, r: lax.all_gather(r, "v", tiled=True),
    "psum_scatter": lambda lax, r: lax.psum_scatter(r[:4], "v"),
    "all_to_all": lambda lax, r: lax.all_to_all(r, "v", 0, 0, tiled=True),
    "ppermute": lambda lax, r: lax.ppermute(r, "v", [(0, 1), (1, 2), (2, 3), (3, 0)]),
    "axis_index": lambda lax, r: r * lax.axis_index("v"),
}


def test_vmap_axis_names(mesh8):
    # jax.lax computes collectives over a vmap axis locally, over the batch dimension.
    # (Inside shard_map only without check_vma: with it, jax 0.10.2 fails an assertion in
    # pvary, and jaxcomm.lax, which hands vmap axes to jax.lax, fails the same way.)
    def f(lax, v, ops=tuple(VMAP_OPS)):
        return {op: jax.vmap(lambda r: VMAP_OPS[op](lax, r), axis_name="v")(v) for op in ops}
    same(mesh8, f, rand((N, 4, 8), "float32", 8), fast=False, check_vma=False)
    x = jnp.asarray(rand((4, 8), "float32", 8))
    alone = tuple(op for op in VMAP_OPS if op != "psum_mixed")  # outside shard_map: vmap alone
    assert_identical(jax.tree.map(np.asarray, f(jaxcomm.lax, x, alone)),
                     jax.tree.map(np.asarray, f(jax.lax, x, alone)))


def test_pmap_axis_names():
    x = rand((N, 3), "float32", 9)
    got = jax.pmap(lambda v: jaxcomm.lax.pmean({"v": v}, "i"), axis_name="i")(x)
    want = jax.pmap(lambda v: jax.lax.pmean({"v": v}, "i"), axis_name="i")(x)
    assert_identical(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want))


def test_vmap_over_mesh_collective(mesh8):
    # vmap over another axis (the batch is data, not a collective axis): jaxcomm's path.
    f = lambda lax, v: jax.vmap(lambda r: lax.psum_scatter(r, "x", tiled=True), in_axes=1)(v)
    same(mesh8, f, rand((N, 8, 3), "float32", 10))


# ------------------------------------------------------------------------------ NaN, inf

def _specials():
    # Column j of x is the value each of the 8 ranks holds at that position.
    nan, inf = np.nan, np.inf
    cols = [
        [nan, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, nan, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, nan],
        [nan] * 8, [nan, inf, 0, 0, 0, 0, 0, -inf], [-inf] * 8, [inf] * 8, [1, nan, -inf, 2, 0, 0, 0, 0],
        [-0.0, 0.0] * 4, [0.0, -0.0] * 4, [5, 5, 5, 5, 5, 5, 5, 5], [nan, nan, 3, nan, nan, -1, nan, nan],
    ]
    return np.asarray(cols, np.float32).T.copy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_nan_and_inf(mesh8, dtype, request):
    if dtype in X64:
        request.getfixturevalue("x64")
    x = _specials().astype(jnp.dtype(dtype))
    same(mesh8, lambda lax, v: {"max": lax.pmax(v, "x"), "min": lax.pmin(v, "x"),
                                "sum": lax.psum(v, "x"), "mean": lax.pmean(v, "x"),
                                "gather": lax.all_gather(v, "x"),
                                "perm": lax.ppermute(v, "x", [(7, 0), (0, 7)])}, x)


# ------------------------------------------------------------------- explicit sharding

EXPLICIT_OPS = {
    "psum_unreduced": lambda lax, v: lax.psum(jax.lax.pcast(v, "ep", to="unreduced"), "ep"),
    "psum_scatter_unreduced": lambda lax, v: lax.psum_scatter(
        jax.lax.pcast(jnp.tile(v, (4, 1)), "ep", to="unreduced"), "ep", tiled=True),
    "all_gather_invarying": lambda lax, v: lax.all_gather(v, "ep", to="invarying", tiled=True),
    "all_gather_invarying_tuple": lambda lax, v: lax.all_gather(v, ("dp", "ep"), to="invarying"),
    "all_gather_reduced": lambda lax, v: jax.lax.pcast(
        lax.all_gather(v, "ep", to="reduced", axis=1), "ep", to="varying"),
    "varying_psum": lambda lax, v: lax.psum(v, ("dp", "ep")),
    # FSDP's parameters (jax's test_shmap_unreduced_fsdp_grad): an operand already typed
    # reduced over another axis (dp), gathered over ep to="reduced"; its cotangent is
    # unreduced over both.
    "all_gather_reduced_over_reduced": lambda lax, v: jax.lax.pcast(lax.all_gather(
        jax.lax.pcast(lax.psum(v, "dp"), "dp", to="reduced"), "ep", to="reduced", axis=1,
        tiled=True), ("dp", "ep"), to="varying"),
}


def test_explicit_sharding_types(mesh2x4):
    # Sums of operands typed unreduced, and gathers typed invariant or reduced (jax 0.10's
    # explicit sharding): jaxcomm's collectives with jax.lax's result types.
    with jax.set_mesh(mesh2x4):
        same(mesh2x4, lambda lax, v: {op: f(lax, v) for op, f in EXPLICIT_OPS.items()},
             rand((N, 2, 3), "float32", 11))


def test_explicit_sharding_grads(mesh2x4):
    # Their transposes: reduced cast (psum), unreduced psum_scatter (all_gather to="reduced"),
    # this rank's block (invariant gather), a reduce-scatter of partial sums
    # (all_gather(to="reduced"), also of an operand reduced over another axis; that case's
    # own cast to reduced over dp transposes to an XLA all-reduce, so it is checked apart).
    def grads(ops):
        return lambda lax, v: {op: jax.grad(lambda u: jnp.sum(jnp.sin(EXPLICIT_OPS[op](lax, u))))(v)
                               for op in ops}
    x = rand((N, 2, 3), "float32", 27)
    fsdp = "all_gather_reduced_over_reduced"
    with jax.set_mesh(mesh2x4):
        same(mesh2x4, grads([op for op in EXPLICIT_OPS if op != fsdp]), x)
        same(mesh2x4, grads([fsdp]), x, fast=False)


def test_native_ops_take_unreduced_sums(mesh2x4):
    # jaxcomm.all_reduce/reduce_scatter sum unreduced operands as jax.lax.psum does; the
    # other ops refuse them with a ValueError naming the type (jax.lax's type).
    def f(lax, v):
        u = jax.lax.pcast(v, "ep", to="unreduced")
        if lax is jax.lax:
            return jax.lax.pmean(u, "ep"), jax.lax.psum_scatter(jnp.tile(u, (4, 1)), "ep", tiled=True)
        return (jaxcomm.all_reduce(u, "ep", op="mean"),
                jaxcomm.reduce_scatter(jnp.tile(u, (4, 1)), "ep", tiled=True))
    with jax.set_mesh(mesh2x4):
        same(mesh2x4, f, rand((N, 2, 3), "float32", 28))
        with pytest.raises(ValueError, match=r"jaxcomm.all_gather: the operand .* is unreduced "
                                             r"over axis 'ep'"):
            jax.make_jaxpr(jax.shard_map(
                lambda v: jaxcomm.all_gather(jax.lax.pcast(v, "ep", to="unreduced"), "ep"),
                mesh=mesh2x4, in_specs=P(("dp", "ep")), out_specs=P(("dp", "ep"))))(
                _abstract(mesh2x4, (N, 3), P(("dp", "ep"))))


# ------------------------------------------------------------------ tuples of mesh axes

AXIS_TUPLES = [("dp", "ep"), ("ep", "dp")]
TUPLE_OPS = {
    "psum": lambda lax, v, ax: lax.psum(v, ax),
    "pmax": lambda lax, v, ax: lax.pmax(v, ax),
    "all_gather": lambda lax, v, ax: lax.all_gather(v, ax),
    "psum_scatter": lambda lax, v, ax: lax.psum_scatter(v, ax, tiled=True),
    "all_to_all": lambda lax, v, ax: lax.all_to_all(v, ax, 0, 1, tiled=True),
    "ppermute_ring": lambda lax, v, ax: lax.ppermute(v, ax, [(i, (i + 1) % 8) for i in range(8)]),
    "ppermute_partial": lambda lax, v, ax: lax.ppermute(v, ax, [(0, 5), (5, 2), (-1, 3)]),
    "pshuffle": lambda lax, v, ax: lax.pshuffle(v, ax, [3, 1, 4, 0, 6, 7, 2, 5]),
    "axis_index_ppermute": lambda lax, v, ax: lax.ppermute(
        v * lax.axis_index(ax).astype(v.dtype), ax, [(1, 6), (6, 1)]),
}


@pytest.mark.parametrize("axes", AXIS_TUPLES, ids=",".join)
def test_tuple_axes_in_both_orders(mesh2x4, axes):
    same(mesh2x4, lambda lax, v: {op: f(lax, v, axes) for op, f in TUPLE_OPS.items()},
         rand((N, 8, 2), "float32", 12))


# ------------------------------------------------------------------------------- dtypes

DTYPES = ["float32", "bfloat16", "float16", "float64", "int8", "int16", "int32", "int64", "uint8",
          "uint32", "bool", "complex64", "float8_e4m3fn"]


def _dtype_program(dtype):
    numeric = dtype != "bool"
    ordered = "complex" not in dtype and "float8" not in dtype  # XLA:CPU cannot max these

    def f(lax, v):
        out = {"gather": lax.all_gather(v, "x", axis=1), "a2a": lax.all_to_all(v, "x", 0, 0),
               "perm": lax.ppermute(v, "x", [(i, (i + 3) % 8) for i in range(8)]),
               "sum": lax.psum(v, "x")}
        if "float8" not in dtype and numeric:  # jax.lax.psum_scatter cannot add bools
            out["scatter"] = lax.psum_scatter(v, "x")
        if numeric and "float8" not in dtype:
            out["mean"] = lax.pmean(v, "x")
        if ordered:
            out["max"], out["min"] = lax.pmax(v, "x"), lax.pmin(v, "x")
        return out
    return f


def _dtype_data(dtype, seed):
    if "float8" in dtype:
        return (rand((N, 8, 3), "float32", seed) / 4).astype(jnp.dtype(dtype))
    return rand((N, 8, 3), dtype, seed)


# float16 sums and float8 / complex reductions are jax.lax's (see docs/lax.md).
DTYPE_PROGRAMS = {"served": [d for d in DTYPES if d not in X64 | {"float16", "complex64", "float8_e4m3fn"}],
                  "x64": [d for d in DTYPES if d in X64],
                  "partly jax.lax": ["float16", "complex64", "float8_e4m3fn"]}


@pytest.mark.parametrize("dtypes", DTYPE_PROGRAMS)
def test_every_dtype(mesh8, dtypes, request):
    if dtypes == "x64":
        request.getfixturevalue("x64")
    names = DTYPE_PROGRAMS[dtypes]
    same(mesh8, lambda lax, *xs: {d: _dtype_program(d)(lax, x) for d, x in zip(names, xs)},
         *(_dtype_data(d, 13 + i) for i, d in enumerate(names)), fast=dtypes != "partly jax.lax")


def test_negative_dimensions(mesh8):
    # jax.lax takes them for all_gather only (psum_scatter fails to lower, all_to_all
    # crashes XLA:CPU); jaxcomm.lax counts them from the end everywhere.
    def f(lax, v):
        neg = lax is jaxcomm.lax
        return {"gather": lax.all_gather(v, "x", axis=-1, tiled=True),
                "scatter": lax.psum_scatter(v, "x", scatter_dimension=-2 if neg else 1, tiled=True),
                "a2a": lax.all_to_all(v, "x", -2 if neg else 1, -3 if neg else 0, tiled=True)}
    same(mesh8, f, rand((N, 2, 8, 3), "float32", 26))


# ---------------------------------------------------------------------- Python scalars

def test_python_scalars(mesh8):
    def f(lax, v):
        return {"size": lax.psum(1, "x"), "sized": lax.psum(2.5, ("x",)), "mean": lax.pmean(3, "x"),
                "tree": lax.psum({"a": 1, "b": v}, "x"), "max": lax.pmax(1.0, "x"),
                "gather": lax.all_gather(2, "x"), "perm": lax.ppermute(1.5, "x", [(0, 1)]),
                "scaled": v * lax.psum(1, "x"), "index": lax.axis_index("x"), "n": lax.axis_size("x")}
    same(mesh8, f, rand((N, 3), "float32", 14))


def test_empty_axis_name_returns_operand(mesh8):
    same(mesh8, lambda lax, v: (lax.psum(v, ()), lax.all_gather(v, ()), lax.psum_scatter(v, ())),
         rand((N, 3), "float32", 15), fast=False)


# ---------------------------------------------------------------------------- gradients

def _loss(lax, params, data):
    mean = lax.pmean(jax.tree.map(lambda p: p * data[: p.shape[0]], params), "dp")
    return sum(jnp.sum(jnp.sin(m) * m) for m in jax.tree.leaves(mean))


@pytest.mark.parametrize("check_vma", [True, False])
def test_grad_through_pytree_pmean(mesh2x4, check_vma):
    params = {"w": rand((N, 4, 3), "float32", 16), "b": (rand((N, 3), "float32", 17),)}
    data = rand((N, 4, 3), "float32", 18)

    def f(lax, w, b, d):
        return jax.grad(lambda p: _loss(lax, p, d))({"w": w, "b": (b,)})
    same(mesh2x4, f, params["w"], params["b"][0], data, check_vma=check_vma)


def test_check_grads_pytree_pmean():
    # Forward values match jax.lax exactly (above); here the gradient of the jaxcomm.lax
    # side against finite differences, through shard_map, first and second order. (Auto
    # axes: check_grads perturbs unsharded copies of the arguments.)
    mesh = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    spec = P(("dp", "ep"))
    w, b, d = (jnp.asarray(rand((N, 4, 3), "float32", s)) for s in (19, 20, 21))

    @jax.jit
    def global_loss(w, b):
        f = jax.shard_map(lambda w, b, d: _loss(jaxcomm.lax, {"w": w, "b": (b[0],)}, d)[None],
                          mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        return jnp.sum(f(w, b, d))
    jax.test_util.check_grads(global_loss, (w, b), order=2, modes=("rev",), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------- pbroadcast

@pytest.mark.parametrize("source", [0, 2, -1])
def test_pbroadcast(mesh2x4, source):
    # jax.lax.pbroadcast has no CPU lowering: compare with its definition (psum of the
    # source's value) and with its type (varying), which jax.lax traces fine.
    x = rand((N, 3), "float32", 22)

    def ref(v):
        me = jax.lax.axis_index("ep")
        return jax.lax.pcast(jax.lax.psum(jnp.where(me == source % 4, v, 0), "ep"), "ep", to="varying")
    run = lambda f: np.asarray(jax.jit(jax.shard_map(lambda v: f(v[0])[None], mesh=mesh2x4,
                                                     in_specs=P(("dp", "ep")), out_specs=P(("dp", "ep"))))(
        jax.device_put(x, NamedSharding(mesh2x4, P(("dp", "ep"))))))
    assert_identical(run(lambda v: jaxcomm.lax.pbroadcast(v, "ep", source)), run(ref))
    typed = lambda lib: jax.make_jaxpr(jax.shard_map(
        lambda v: lib.pbroadcast(v, ("ep",), source), mesh=mesh2x4, in_specs=P(("dp", "ep")),
        out_specs=P(("dp", "ep"))))(_abstract(mesh2x4, (N, 3), P(("dp", "ep")))).out_avals
    assert typed(jaxcomm.lax) == typed(jax.lax)


# ---------------------------------------------------------------------- ragged_all_to_all

@pytest.mark.parametrize("groups", [None, [[0, 2], [3, 1]]])
def test_ragged_all_to_all(groups):
    # jax.lax.ragged_all_to_all has no CPU implementation: the reference is jaxcomm's pure
    # JAX one (all_gather + gather), itself checked in test_ragged.py.
    mesh = jax.make_mesh((4,), ("x",))
    R = 2 if groups else 4
    rng = np.random.default_rng(23)
    sizes = rng.integers(0, 3, size=(4, R))
    io = np.concatenate([np.zeros((4, 1), int), np.cumsum(sizes, 1)[:, :-1]], 1)
    members = groups or [[0, 1, 2, 3]]
    oo, rs = np.zeros_like(sizes), np.zeros_like(sizes)
    for g in members:  # rank s sends sizes[s, j] rows to the group's j-th member,
        for s_pos, s in enumerate(g):  # which stacks them in the order of their senders
            for d_pos, d in enumerate(g):
                oo[s, d_pos] = sum(sizes[g[k], d_pos] for k in range(s_pos))
                rs[d, s_pos] = sizes[s, d_pos]
    operand = rand((4, 8, 2), "float32", 24)
    args = [operand, np.zeros((4, 8, 2), np.float32)] + [a.astype(np.int32) for a in (io, sizes, oo, rs)]

    def run(fn):
        spec = P("x")
        f = jax.jit(jax.shard_map(lambda *a: fn(*(v[0] for v in a), axis_name="x",
                                                 axis_index_groups=groups)[None],
                                  mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))
        return np.asarray(f(*(jax.device_put(a, NamedSharding(mesh, spec)) for a in args)))
    got = run(jaxcomm.lax.ragged_all_to_all)
    want = run(lambda *a, axis_name, axis_index_groups: ragged_ops.ragged_xla(
        *a, axis_name=axis_name, axis_index_groups=groups and tuple(map(tuple, groups))))
    assert_identical(got, want)
    assert np.count_nonzero(got) > 0


# ------------------------------------------------------------------------------ mistakes

MISTAKES = {
    "psum unbound axis": lambda lax, v: lax.psum(v, "nope"),
    "pmax unbound axis": lambda lax, v: lax.pmax(v, "nope"),
    "all_gather unbound axis": lambda lax, v: lax.all_gather(v, "nope"),
    "psum_scatter unbound axis": lambda lax, v: lax.psum_scatter(v, "nope"),
    "ppermute unbound axis": lambda lax, v: lax.ppermute(v, "nope", [(0, 1)]),
    "all_gather tiled scalar": lambda lax, v: lax.all_gather(v[0, 0], "x", tiled=True),
    "all_gather axis out of range": lambda lax, v: lax.all_gather(v, "x", axis=3),
    "all_gather bad to": lambda lax, v: lax.all_gather(v, "x", to="bogus"),
    "all_to_all size mismatch": lambda lax, v: lax.all_to_all(v[:3], "x", 0, 0),
    "all_to_all not divisible": lambda lax, v: lax.all_to_all(v[:3], "x", 0, 0, tiled=True),
    "psum_scatter size mismatch": lambda lax, v: lax.psum_scatter(v[:3], "x"),
    "psum_scatter not divisible": lambda lax, v: lax.psum_scatter(v[:3], "x", tiled=True),
    "psum_scatter of bool": lambda lax, v: lax.psum_scatter(v > 0, "x"),
    "groups not a cover": lambda lax, v: lax.all_gather(v, "x", axis_index_groups=[[0, 1], [1, 2]]),
    "pmax groups not a cover": lambda lax, v: lax.pmax(v, "x", axis_index_groups=[[0, 1, 2, 3],
                                                                                 [3, 4, 5, 6]]),
    "ppermute duplicate source": lambda lax, v: lax.ppermute(v, "x", [(0, 1), (8, 2)]),
    "ppermute index out of range": lambda lax, v: lax.ppermute(v, "x", [(9, 1)]),
    "pshuffle not a permutation": lambda lax, v: lax.pshuffle(v, "x", [1, 2, 3]),
    "ragged float offsets": lambda lax, v: lax.ragged_all_to_all(
        v, v, v[:, 0], v[:, 0].astype(jnp.int32), v[:, 0].astype(jnp.int32),
        v[:, 0].astype(jnp.int32), axis_name="x"),
    "ragged 2-D sizes": lambda lax, v: lax.ragged_all_to_all(
        v, v, *(jnp.zeros((8, 1), jnp.int32),) * 4, axis_name="x"),
    "ragged unbound axis": lambda lax, v: lax.ragged_all_to_all(
        v, v, *(jnp.zeros((8,), jnp.int32),) * 4, axis_name="nope"),
}


def _error(lib, mesh, f, x):
    flat = lambda v: jax.tree.map(lambda a: jnp.ravel(a)[None], f(lib, v))
    try:
        jax.jit(jax.shard_map(flat, mesh=mesh, in_specs=P("x"), out_specs=P("x"))).lower(x)
    except Exception as e:  # noqa: BLE001
        return e
    return None


@pytest.mark.parametrize("case", MISTAKES)
def test_mistakes_raise_jax_lax_types(mesh8, case):
    x = jax.ShapeDtypeStruct((N * 8, 3), jnp.float32, sharding=NamedSharding(mesh8, P("x")))
    theirs = _error(jax.lax, mesh8, MISTAKES[case], x)
    ours = _error(jaxcomm.lax, mesh8, MISTAKES[case], x)
    assert theirs is not None, "jax.lax accepted it"
    assert ours is not None, f"jaxcomm.lax accepted what jax.lax refused with {theirs!r}"
    assert isinstance(ours, type(theirs)), f"{type(ours).__mro__} is not a {type(theirs)}: {ours}"
    assert "jaxcomm" in str(ours), f"not jaxcomm's message: {ours}"


# ---------------------------------------------------------------------- fallback logging

def test_fallback_is_logged_once(mesh8, caplog):
    route.log_fallback.cache_clear()
    f = jax.shard_map(lambda v: jaxcomm.lax.pmax(v.astype(jnp.complex64), "x"), mesh=mesh8,
                      in_specs=P("x"), out_specs=P())
    with caplog.at_level(logging.WARNING, logger="jaxcomm"):
        for _ in range(2):
            jax.make_jaxpr(f)(_abstract(mesh8, (N, 2), P("x")))
    lines = [r.getMessage() for r in caplog.records
             if "jaxcomm.lax.pmax computed by jax.lax" in r.getMessage()]
    assert len(lines) == 1 and "complex" in lines[0], lines


# ------------------------------------------------------------------------------ switch

def _step(v):
    # Written against jax.lax, looked up by name when traced.
    return jax.lax.pmean({"g": v, "h": (v * 2,)}, "x"), jax.lax.all_gather(v, "x")


def _prims(mesh):
    f = jax.shard_map(_step, mesh=mesh, in_specs=P("x"), out_specs=(P(), P()), check_vma=False)
    return primitives(jax.make_jaxpr(f)(_abstract(mesh, (N, 2), P("x"))).jaxpr)


def _abstract(mesh, shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def test_use_for_lax_context_manager(mesh8):
    x = rand((N, 2), "float32", 25)
    run = lambda: jax.tree.map(np.asarray, jax.jit(jax.shard_map(
        _step, mesh=mesh8, in_specs=P("x"), out_specs=(P(), P("x"))))(
        jax.device_put(x, NamedSharding(mesh8, P("x")))))
    want = run()
    assert _prims(mesh8) & LAX_COLLECTIVE_PRIMS
    with jaxcomm.use_for_lax() as switch:
        assert jax.lax.pmean is jaxcomm.lax.pmean and switch.active
        names = _prims(mesh8)
        assert not names & LAX_COLLECTIVE_PRIMS and "jaxcomm_all_reduce" in names
        got = run()
    assert not switch.active and jax.lax.pmean is compat.jax_lax.pmean
    assert _prims(mesh8) & LAX_COLLECTIVE_PRIMS
    assert_identical(got, want)


def test_use_for_lax_call_and_undo(mesh8):
    from jax.lax import psum as captured  # taken before the switch: stays jax.lax's
    switch = jaxcomm.use_for_lax("pmean", "psum")
    try:
        assert jax.lax.psum is jaxcomm.lax.psum and jax.lax.all_gather is compat.jax_lax.all_gather
        assert captured is compat.jax_lax.psum
        names = _prims(mesh8)
        assert "jaxcomm_all_reduce" in names and "all_gather" in names
        inner = jaxcomm.use_for_lax()
        inner.undo()
        assert jax.lax.psum is jaxcomm.lax.psum and jax.lax.all_gather is compat.jax_lax.all_gather
    finally:
        switch.undo()
    switch.undo()  # idempotent
    assert all(getattr(jax.lax, n) is getattr(compat.jax_lax, n) for n in collectives.COLLECTIVES)
    with pytest.raises(ValueError, match="jaxcomm.use_for_lax.*'dot'"):
        jaxcomm.use_for_lax("dot")


# -------------------------------------------------------------------------- processes

_TWO_PROCESSES = """
from jax.sharding import NamedSharding
mesh = jax.make_mesh((2, 2), ("a", "b"))  # a: the process, b: its devices
spec = P(("a", "b"))
rng = np.random.default_rng(0)
x = rng.integers(-8, 8, size=(4, 4, 3)).astype(np.float32)
place = lambda v: jax.make_array_from_callback(v.shape, NamedSharding(mesh, spec), lambda i: v[i])
groups = [[0, 3], [2, 1]]

def program(lax, v):
    v = v[0]
    mean = lax.pmean({"f": v, "i": v.astype(jnp.int32)}, ("a", "b"))
    out = {"pmean_f": mean["f"], "pmean_i": mean["i"],
           "pmax": lax.pmax(jnp.where(v > 5, jnp.nan, v), "a"),
           "gather": lax.all_gather(v, ("a", "b"), axis_index_groups=groups, tiled=True),
           "scatter": lax.psum_scatter(v.astype(jnp.int32), ("b", "a"), tiled=True),
           "perm": lax.ppermute(v, ("b", "a"), [(0, 3), (3, 2), (2, 0)])}
    return jax.tree.map(lambda a: jnp.ravel(a)[None], out)

results = {}
for name, lib in (("lax", jax.lax), ("jaxcomm", jaxcomm.lax)):
    f = jax.jit(jax.shard_map(lambda v: program(lib, v), mesh=mesh, in_specs=spec, out_specs=spec))
    out = f(place(x))
    results[name] = {k: np.asarray(a.addressable_shards[0].data).tolist() for k, a in out.items()}
    if name == "jaxcomm":
        jaxpr = str(jax.make_jaxpr(jax.shard_map(lambda v: program(lib, v), mesh=mesh, in_specs=spec,
                                                 out_specs=spec))(place(x)))
        results["prims"] = sorted(set(re.findall(r"= ([a-z_]+)\\[", jaxpr)))
print("RESULT", json.dumps(results))
"""


def test_two_processes():
    # Groups that span processes, through jaxcomm's cross-process transport. Float sums may
    # differ from gloo's in the last bits (docs/lax.md); these inputs are integers.
    from mp_util import assert_ok, results, run_script
    res = run_script("import json, re\n" + _TWO_PROCESSES, n=2, devices=2, timeout_s=120)
    assert_ok(res)
    per_rank = results(res)
    assert set(per_rank) == {0, 1}
    for rank, r in per_rank.items():
        assert not set(r["prims"]) & LAX_COLLECTIVE_PRIMS and "jaxcomm_all_reduce" in r["prims"], r["prims"]
        for key in r["lax"]:
            want, got = np.asarray(r["lax"][key], float), np.asarray(r["jaxcomm"][key], float)
            if key == "pmax":  # a NaN sits at the start of gloo's order or not (docs/lax.md)
                ok = ~np.isnan(want)
                np.testing.assert_array_equal(got[ok], want[ok], err_msg=f"rank {rank} {key}")
                continue
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} {key}")
