"""Bad input fails while the program is traced, with a message that says what is wrong.

Every case traces ``jit(shard_map(f))`` without compiling or running it
(``jax.jit(...).trace``): the error must come from jaxcomm's Python layer.
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from conftest import per_device
from fresh_util import Command, run_fresh

N = 8


def trace(f, mesh, local_shape, dtype="float32", check_vma=True):
    """Traces f on one (local_shape, dtype) operand per device of ``mesh``; no compile."""
    spec = P(tuple(mesh.axis_names))
    arg = jax.ShapeDtypeStruct((mesh.size, *local_shape), jnp.dtype(dtype),
                               sharding=NamedSharding(mesh, spec))
    body = lambda v: jnp.expand_dims(f(v[0]), 0)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=check_vma)).trace(arg)


def exact(message):
    """A pytest ``match`` pattern for exactly ``message`` (jax may append its note on
    filtered traceback frames on the following lines)."""
    return r"\A" + re.escape(message) + r"(?:\n|\Z)"


def test_trace_helper_traces_valid_programs(mesh8):
    # The helper itself works: a valid program traces without error, so the raises
    # below come from the bad input.
    traced = trace(lambda v: jaxcomm.all_reduce(v, "x"), mesh8, (3,))
    assert "jaxcomm_all_reduce" in str(traced.jaxpr)


# ------------------------------------------------------------------------- axis names

ALL_OPS = {
    "all_reduce": lambda v, a: jaxcomm.all_reduce(v, a),
    "all_gather": lambda v, a: jaxcomm.all_gather(v, a),
    "reduce_scatter": lambda v, a: jaxcomm.reduce_scatter(v, a),
    "all_to_all": lambda v, a: jaxcomm.all_to_all(v, a, 0, 0),
    "ppermute": lambda v, a: jaxcomm.ppermute(v, a, [(0, 1), (1, 0)]),
    "broadcast": lambda v, a: jaxcomm.broadcast(v, a),
}


@pytest.mark.parametrize("op", list(ALL_OPS))
def test_unknown_axis_name(mesh8, op):
    msg = (f"jaxcomm.{op}: unknown axis name 'y'. jaxcomm collectives run inside "
           f"jax.shard_map, over the mesh axes it binds.")
    with pytest.raises(NameError, match=exact(msg)):
        trace(lambda v: ALL_OPS[op](v, "y"), mesh8, (N, 2))


def test_unknown_axis_in_tuple(mesh2x4):
    msg = ("jaxcomm.all_gather: unknown axis name 'tp'. jaxcomm collectives run inside "
           "jax.shard_map, over the mesh axes it binds.")
    with pytest.raises(NameError, match=exact(msg)):
        trace(lambda v: jaxcomm.all_gather(v, ("dp", "tp")), mesh2x4, (2,))


def test_empty_axis_name(mesh8):
    with pytest.raises(ValueError, match=exact(
            "jaxcomm.all_reduce: axis_name must name at least one mesh axis")):
        trace(lambda v: jaxcomm.all_reduce(v, ()), mesh8, (2,))


def test_repeated_axis_name(mesh8):
    with pytest.raises(ValueError, match=exact(
            "jaxcomm.all_reduce: axis_name ('x', 'x') repeats an axis")):
        trace(lambda v: jaxcomm.all_reduce(v, ("x", "x")), mesh8, (2,))


def test_integer_axis_name(mesh8):
    with pytest.raises(TypeError, match=exact(
            "jaxcomm.all_gather: axis_name must be mesh axis names, got the integer 0")):
        trace(lambda v: jaxcomm.all_gather(v, 0), mesh8, (2,))


@pytest.mark.parametrize("op", list(ALL_OPS))
def test_outside_shard_map(op):
    # Neither eagerly nor under a bare jit is an axis bound.
    x = jnp.ones((N, 2))
    msg = (f"jaxcomm.{op}: unknown axis name 'x'. jaxcomm collectives run inside "
           f"jax.shard_map, over the mesh axes it binds.")
    with pytest.raises(NameError, match=exact(msg)):
        ALL_OPS[op](x, "x")
    with pytest.raises(NameError, match=exact(msg)):
        jax.jit(lambda v: ALL_OPS[op](v, "x")).trace(x)


# ------------------------------------------------------------------------------ ppermute

@pytest.mark.parametrize("perm,bad", [
    ([(0, 1), (2, 1)], "((0, 1), (2, 1))"),   # two sources into rank 1
    ([(0, 1), (0, 2)], "((0, 1), (0, 2))"),   # rank 0 sends twice
])
def test_perm_not_a_permutation(mesh8, perm, bad):
    msg = (f"jaxcomm.ppermute: perm {bad} is not a permutation: a rank appears twice as a "
           f"source or twice as a destination")
    with pytest.raises(ValueError, match=exact(msg)):
        trace(lambda v: jaxcomm.ppermute(v, "x", perm), mesh8, (2,))


@pytest.mark.parametrize("pair", [(0, 8), (8, 0), (-1, 3)])
def test_perm_out_of_range(mesh8, pair):
    msg = f"jaxcomm.ppermute: perm pair {pair} is out of range for a group of 8 ranks"
    with pytest.raises(ValueError, match=exact(msg)):
        trace(lambda v: jaxcomm.ppermute(v, "x", [pair]), mesh8, (2,))


def test_perm_out_of_range_for_subgroup(mesh2x4):
    # Over "dp" a group has 2 ranks: 3 is out of range although the mesh has 8 devices.
    with pytest.raises(ValueError, match=exact(
            "jaxcomm.ppermute: perm pair (0, 3) is out of range for a group of 2 ranks")):
        trace(lambda v: jaxcomm.ppermute(v, "dp", [(0, 3)]), mesh2x4, (2,))


def test_perm_malformed(mesh8):
    with pytest.raises(TypeError, match=exact(
            "jaxcomm.ppermute: perm must be a sequence of (source, destination) pairs, "
            "got [(0, 1, 2)]")):
        trace(lambda v: jaxcomm.ppermute(v, "x", [(0, 1, 2)]), mesh8, (2,))


# ---------------------------------------------------------------------- axes and shapes

@pytest.mark.parametrize("which,split,concat,bad", [
    ("split_axis", 2, 0, 2), ("split_axis", -3, 0, -3),
    ("concat_axis", 0, 2, 2), ("concat_axis", 0, -3, -3),
])
def test_all_to_all_axis_out_of_range(mesh8, which, split, concat, bad):
    msg = f"jaxcomm.all_to_all: {which}={bad} is out of range [-2, 1] for an operand of rank 2"
    with pytest.raises(ValueError, match=exact(msg)):
        trace(lambda v: jaxcomm.all_to_all(v, "x", split, concat), mesh8, (N, 3))


def test_all_to_all_axis_not_int(mesh8):
    with pytest.raises(TypeError, match=exact(
            "jaxcomm.all_to_all: split_axis must be an integer, got 1.0")):
        trace(lambda v: jaxcomm.all_to_all(v, "x", 1.0, 0), mesh8, (N, N))


def test_all_to_all_not_divisible(mesh8):
    with pytest.raises(ValueError, match=exact(
            "jaxcomm.all_to_all: split_axis 0 of size 12 is not divisible by the group "
            "size 8 of axis 'x'")):
        trace(lambda v: jaxcomm.all_to_all(v, "x", 0, 1, tiled=True), mesh8, (12, 3))


def test_all_to_all_untiled_size_mismatch(mesh8):
    with pytest.raises(ValueError, match=exact(
            "jaxcomm.all_to_all: with tiled=False x.shape[split_axis] must equal the group "
            "size 8 of axis 'x', got 16")):
        trace(lambda v: jaxcomm.all_to_all(v, "x", 0, 1), mesh8, (16, 3))


def test_all_to_all_group_size_of_tuple(mesh2x4):
    with pytest.raises(ValueError, match=exact(
            "jaxcomm.all_to_all: split_axis 1 of size 6 is not divisible by the group size "
            "8 of axis ('dp', 'ep')")):
        trace(lambda v: jaxcomm.all_to_all(v, ("dp", "ep"), 1, 0, tiled=True), mesh2x4, (2, 6))


def test_reduce_scatter_not_divisible(mesh8):
    with pytest.raises(ValueError, match=exact(
            "jaxcomm.reduce_scatter: dimension 1 of size 12 is not divisible by the group "
            "size 8 of axis 'x'")):
        trace(lambda v: jaxcomm.reduce_scatter(v, "x", scatter_dimension=1, tiled=True),
              mesh8, (3, 12))


def test_reduce_scatter_untiled_size_mismatch(mesh8):
    with pytest.raises(ValueError, match=exact(
            "jaxcomm.reduce_scatter: with tiled=False dimension 0 must equal the group size "
            "8 of axis 'x', got 3")):
        trace(lambda v: jaxcomm.reduce_scatter(v, "x"), mesh8, (3, 8))


def test_reduce_scatter_dimension_out_of_range(mesh8):
    with pytest.raises(ValueError, match=exact(
            "jaxcomm.reduce_scatter: scatter_dimension=2 is out of range [-2, 1] for an operand "
            "of rank 2")):
        trace(lambda v: jaxcomm.reduce_scatter(v, "x", scatter_dimension=2), mesh8, (N, 3))


@pytest.mark.parametrize("op,msg", [
    ("reduce_scatter", "jaxcomm.reduce_scatter: the operand must have at least one dimension"),
    ("all_to_all", "jaxcomm.all_to_all: the operand must have at least one dimension"),
    ("all_gather", "jaxcomm.all_gather: tiled=True needs an operand with a dimension"),
])
def test_scalar_operand_rejected(mesh8, op, msg):
    f = {"reduce_scatter": lambda v: jaxcomm.reduce_scatter(v, "x"),
         "all_to_all": lambda v: jaxcomm.all_to_all(v, "x", 0, 0),
         "all_gather": lambda v: jaxcomm.all_gather(v, "x", tiled=True)}[op]
    with pytest.raises(ValueError, match=exact(msg)):
        trace(f, mesh8, ())


def test_all_gather_tiled_axis_out_of_range(mesh8):
    with pytest.raises(ValueError, match=exact(
            "jaxcomm.all_gather: axis=2 is out of range [-2, 1] for an operand of rank 2")):
        trace(lambda v: jaxcomm.all_gather(v, "x", axis=2, tiled=True), mesh8, (2, 3))


def test_all_gather_untiled_axis_out_of_range_names_operand_rank(mesh8):
    # tiled=False accepts axis in [-3, 2] for a rank-2 operand (the new dimension may go
    # last). The message must not call the rank-2 operand "rank 3".
    with pytest.raises(ValueError, match=r"^jaxcomm\.all_gather: axis=3 is out of range") as e:
        trace(lambda v: jaxcomm.all_gather(v, "x", axis=3), mesh8, (2, 3))
    assert "rank 2" in str(e.value), str(e.value)


# ----------------------------------------------------------------------- ops and dtypes

def test_unknown_op_all_reduce(mesh8):
    with pytest.raises(ValueError, match=exact(
            "jaxcomm.all_reduce: unknown op 'avg'; expected one of "
            "('sum', 'prod', 'min', 'max', 'mean')")):
        trace(lambda v: jaxcomm.all_reduce(v, "x", op="avg"), mesh8, (3,))


def test_unknown_op_reduce_scatter(mesh8):
    # psum_scatter has no mean; jaxcomm's reduce_scatter neither.
    with pytest.raises(ValueError, match=exact(
            "jaxcomm.reduce_scatter: unknown op 'mean'; expected one of "
            "('sum', 'prod', 'min', 'max')")):
        trace(lambda v: jaxcomm.reduce_scatter(v, "x", op="mean"), mesh8, (N,))


@pytest.mark.parametrize("op", ["min", "max"])
@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_complex_min_max_rejected(mesh8, op, dtype):
    ctx = jax.enable_x64(True) if dtype == "complex128" else jax.enable_x64(False)
    with ctx:
        with pytest.raises(TypeError, match=exact(
                f"jaxcomm.all_reduce: op={op!r} is not defined for complex dtype {dtype}")):
            trace(lambda v: jaxcomm.all_reduce(v, "x", op=op), mesh8, (3,), dtype)
        with pytest.raises(TypeError, match=exact(
                f"jaxcomm.reduce_scatter: op={op!r} is not defined for complex dtype {dtype}")):
            trace(lambda v: jaxcomm.reduce_scatter(v, "x", op=op), mesh8, (N,), dtype)


# One rule for what jaxcomm has no kernel for (README, "Dtypes"): jax.lax computes it and
# the jaxcomm logger says so (a WARNING, once per op and reason); JAXCOMM_BACKEND=jaxcomm
# makes it a TypeError naming the op.

@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_reduction_dtype_without_kernel_is_computed_by_lax(mesh8, dtype, caplog, monkeypatch):
    from jaxcomm._src import runtime
    runtime.log_fallback_once.cache_clear()  # said once per process: say it again here
    x = (np.arange(N * 8).reshape(N, 8) % 3).astype(jnp.dtype(dtype))
    with caplog.at_level(logging.WARNING, logger="jaxcomm"):
        got_ar, got_rs = per_device(lambda v: (jaxcomm.all_reduce(v, "x"),
                                               jaxcomm.reduce_scatter(v, "x", tiled=True)), mesh8, x)
    want_ar, want_rs = per_device(lambda v: (jax.lax.psum(v, "x"),
                                             jax.lax.psum_scatter(v, "x", tiled=True)), mesh8, x)
    np.testing.assert_array_equal(got_ar.astype(np.float32), want_ar.astype(np.float32))
    np.testing.assert_array_equal(got_rs.astype(np.float32), want_rs.astype(np.float32))
    for op in ("all_reduce", "reduce_scatter"):
        assert (f"jaxcomm.{op} lowers to its jax.lax equivalent: no host kernel reduces {dtype}"
                in caplog.text), caplog.text
    # Moving float8 needs no kernel of its own: jaxcomm's, no note.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxcomm"):
        traced = trace(lambda v: jaxcomm.all_gather(v, "x"), mesh8, (4,), dtype)
    assert "jaxcomm_all_gather" in str(traced.jaxpr) and caplog.text == "", caplog.text
    monkeypatch.setenv("JAXCOMM_BACKEND", "jaxcomm")
    with pytest.raises(TypeError, match=re.escape(
            f"jaxcomm.all_reduce: dtype {dtype} has no host reduction kernel; supported: ")):
        trace(lambda v: jaxcomm.all_reduce(v, "x"), mesh8, (4,), dtype)


# The child inherits the session's 8 CPU devices (tests/conftest.py sets XLA_FLAGS).
_SUBBYTE_CHILD = """
import logging, os
import numpy as np, jax, jax.numpy as jnp, jaxcomm
from jax.sharding import NamedSharding, PartitionSpec as P
logging.basicConfig(format="LOG %(message)s")
mesh = jax.make_mesh((8,), ("x",))
x = jax.device_put((np.arange(8 * 64).reshape(8, 64) % 7).astype(jnp.int4),
                   NamedSharding(mesh, P("x")))
run = lambda f: np.asarray(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"),
                                                 out_specs=P("x")))(x)).astype(np.int32)
cases = {
    "all_gather": (lambda v: jax.lax.all_gather(v[0], "x")[None],
                   lambda v: jaxcomm.all_gather(v[0], "x")[None]),
    "all_reduce": (lambda v: jax.lax.psum(v, "x"), lambda v: jaxcomm.all_reduce(v, "x")),
    "ppermute": (lambda v: jax.lax.ppermute(v, "x", [(0, 1)]),
                 lambda v: jaxcomm.ppermute(v, "x", [(0, 1)])),
}
for name, (lax_f, jaxcomm_f) in cases.items():
    np.testing.assert_array_equal(run(jaxcomm_f), run(lax_f))
    print("EQUAL", name, flush=True)
os.environ["JAXCOMM_BACKEND"] = "jaxcomm"
try:
    run(cases["all_gather"][1])
except TypeError as e:
    print("REFUSED:", e, flush=True)
"""


def test_subbyte_dtypes_are_computed_by_lax():
    # int4 operands: XLA:CPU packs two per byte, while the FFI buffer reports one byte per
    # element (xla/ffi/api/ffi.h ByteWidth). jax.lax computes them (never a copy past the
    # end of the buffers), or with JAXCOMM_BACKEND=jaxcomm the call is refused while
    # tracing. In a child process: a heap overflow aborts it.
    done = run_fresh({"int4": Command(code=_SUBBYTE_CHILD)})["int4"]
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    for op in ("all_gather", "all_reduce", "ppermute"):
        assert f"EQUAL {op}" in done.stdout, out[-3000:]
        assert f"LOG jaxcomm.{op} lowers to its jax.lax equivalent: sub-byte dtype int4" in done.stderr, (
            out[-3000:])
    assert ("REFUSED: jaxcomm.all_gather: no jaxcomm kernel takes the sub-byte dtype int4 "
            "(JAXCOMM_BACKEND=jaxcomm refuses to hand it to jax.lax)") in done.stdout, out[-3000:]


# ----------------------------------------------------------------------------- broadcast

@pytest.mark.parametrize("root", [8, -1, 100])
def test_broadcast_root_out_of_range(mesh8, root):
    with pytest.raises(ValueError, match=exact(
            f"jaxcomm.broadcast: root={root} is out of range for a group of 8 ranks over "
            f"axis 'x'")):
        trace(lambda v: jaxcomm.broadcast(v, "x", root=root), mesh8, (3,))


def test_broadcast_root_out_of_range_for_subgroup(mesh2x4):
    with pytest.raises(ValueError, match=exact(
            "jaxcomm.broadcast: root=2 is out of range for a group of 2 ranks over axis 'dp'")):
        trace(lambda v: jaxcomm.broadcast(v, "dp", root=2), mesh2x4, (3,))


@pytest.mark.parametrize("root", [1.0, True, "0"])
def test_broadcast_root_not_an_int(mesh8, root):
    with pytest.raises(TypeError, match=re.escape(f"jaxcomm.broadcast: root must be an integer, got {root!r}")):
        trace(lambda v: jaxcomm.broadcast(v, "x", root=root), mesh8, (3,))


def test_broadcast_numpy_integer_root(mesh8):
    # A numpy integer is a valid root (as lax accepts numpy integers for its int
    # arguments); it must not be reported as "out of range".
    x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
    got = per_device(lambda v: jaxcomm.broadcast(v, "x", root=np.int64(3)), mesh8, x)
    np.testing.assert_array_equal(got, np.broadcast_to(x[3], x.shape))


# ------------------------------------------------------------------------------- timeout

TIMED_OPS = {
    "all_reduce": lambda v, t: jaxcomm.all_reduce(v, "x", timeout_s=t),
    "all_gather": lambda v, t: jaxcomm.all_gather(v, "x", timeout_s=t),
    "reduce_scatter": lambda v, t: jaxcomm.reduce_scatter(v, "x", timeout_s=t),
    "all_to_all": lambda v, t: jaxcomm.all_to_all(v, "x", 0, 0, timeout_s=t),
    "ppermute": lambda v, t: jaxcomm.ppermute(v, "x", [(0, 1)], timeout_s=t),
    "broadcast": lambda v, t: jaxcomm.broadcast(v, "x", timeout_s=t),
    "ft.all_reduce": lambda v, t: jaxcomm.ft.all_reduce(v, "x", timeout_s=t)[0],
}


@pytest.mark.parametrize("op", sorted(TIMED_OPS))
def test_timeout_must_be_positive_and_finite(mesh8, op):
    for timeout_s in (0, -1.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=exact(
                f"jaxcomm.{op}: timeout_s must be a positive, finite number of seconds, "
                f"got {timeout_s!r}")):
            trace(lambda v: TIMED_OPS[op](v, timeout_s), mesh8, (N,))


@pytest.mark.parametrize("op", sorted(TIMED_OPS))
def test_timeout_must_be_a_number(mesh8, op):
    for timeout_s in ("5", True, [5]):
        with pytest.raises(TypeError, match=exact(
                f"jaxcomm.{op}: timeout_s must be a number of seconds, got {timeout_s!r}")):
            trace(lambda v: TIMED_OPS[op](v, timeout_s), mesh8, (N,))
    # Numbers of other types are seconds too: the call traces.
    for timeout_s in (5, 2.5, np.float32(0.5), np.int64(3)):
        trace(lambda v: TIMED_OPS[op](v, timeout_s), mesh8, (N,))
