"""jaxcomm's collectives against their jax.lax counterparts, run in the same shard_map.

Every check runs one small jit(shard_map) program that returns both jaxcomm's result and
jax.lax's, per device; data movement must match bit for bit, reductions to within the
rounding of the dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from conftest import per_device, rand, run_sharded

N = 8  # devices of mesh8

X64_DTYPES = {"float64", "int64"}
ALL_DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int32", "int64", "uint8",
              "uint32", "bool", "complex64"]
NUMERIC_DTYPES = [d for d in ALL_DTYPES if d not in ("bool", "complex64")]


@pytest.fixture(params=ALL_DTYPES)
def dtype(request):
    """Every dtype; float64/int64 with jax_enable_x64 on for the test (restored after)."""
    if request.param in X64_DTYPES:
        with jax.enable_x64(True):
            yield request.param
    else:
        yield request.param


@pytest.fixture(params=NUMERIC_DTYPES + ["complex64"])
def reduce_dtype(request):
    if request.param in X64_DTYPES:
        with jax.enable_x64(True):
            yield request.param
    else:
        yield request.param


# ------------------------------------------------------------------------------- helpers

def _as_comparable(a):
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return a.astype(np.float32)
    return a


def assert_same(got, want, err_msg=""):
    """Bit-exact equality, same dtype and shape."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (err_msg, got.dtype, want.dtype)
    assert got.shape == want.shape, (err_msg, got.shape, want.shape)
    np.testing.assert_array_equal(_as_comparable(got), _as_comparable(want), err_msg=err_msg)


def _tolerance(dtype):
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16:
        return 2e-2
    if dtype == jnp.float16:
        return 4e-3
    if jnp.issubdtype(dtype, jnp.inexact):
        return 1e-5
    return 0


def assert_close(got, want, err_msg=""):
    """Equal dtype and shape; values equal up to the dtype's rounding."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (err_msg, got.dtype, want.dtype)
    assert got.shape == want.shape, (err_msg, got.shape, want.shape)
    tol = _tolerance(got.dtype)
    if tol == 0:
        np.testing.assert_array_equal(got, want, err_msg=err_msg)
    else:
        np.testing.assert_allclose(_as_comparable(got), _as_comparable(want), rtol=tol,
                                   atol=tol, err_msg=err_msg)


def compare(mesh, ours, ref, *inputs, exact=True, check_vma=True):
    """Runs ``ours`` and ``ref`` on every device's slice of ``inputs``; compares them.

    jaxcomm's op and jax.lax's run as two programs over the same shard_map: in one program
    the two would be independent collectives, which XLA:CPU runs in different orders on
    different devices -- the case test_independent_jaxcomm_and_xla_collectives covers on
    its own (an optimization barrier does not order them: XLA drops it).
    """
    got = per_device(ours, mesh, *inputs, check_vma=check_vma)
    want = per_device(ref, mesh, *inputs, check_vma=check_vma)
    (assert_same if exact else assert_close)(got, want)
    return got


def lax_all_reduce(x, axis_name, op):
    if op == "prod":
        return jnp.prod(jax.lax.all_gather(x, axis_name), axis=0, dtype=x.dtype)
    if x.dtype == jnp.bool_ and op in ("sum", "mean"):
        x = x.astype(jnp.int32)
    return {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin,
            "mean": jax.lax.pmean}[op](x, axis_name)


def lax_reduce_scatter(x, axis_name, dim, op, tiled):
    if op == "sum":
        return jax.lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=tiled)
    full = lax_all_reduce(x, axis_name, op)
    size = jax.lax.psum(1, axis_name)
    blk = x.shape[dim] // size
    y = jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(axis_name) * blk, blk, dim)
    return y if tiled else jnp.squeeze(y, dim)


def lax_broadcast(x, axis_name, root):
    return jax.lax.all_gather(x, axis_name)[root]


def lax_ppermute_by_rank(x, axis_name, perm, size):
    """ppermute with perm's indices taken as ``lax.axis_index(axis_name)`` ranks, built
    from lax.all_gather: jax's documented semantics. jax.lax.ppermute itself numbers
    each group by sorted device id (``grp = sorted(grp)`` in
    jax/_src/lax/parallel.py:_pcollectives_lowering_common), which differs from
    axis_index when an axis tuple is not in mesh order, e.g. ("ep", "dp")."""
    src = np.full((size,), -1, np.int32)
    for s, d in perm:
        src[d] = s
    me_src = jnp.asarray(src)[jax.lax.axis_index(axis_name)]
    gathered = jax.lax.all_gather(x, axis_name)
    return jnp.where(me_src >= 0, gathered[jnp.maximum(me_src, 0)], jnp.zeros_like(x))


def ring(n, shift=1):
    return [(i, (i + shift) % n) for i in range(n)]


# --------------------------------------------------------------------------- all_reduce

REDUCE_OPS = ["sum", "prod", "min", "max", "mean"]


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_all_reduce_dtypes(mesh8, reduce_dtype, op):
    if reduce_dtype == "complex64" and op in ("min", "max"):
        pytest.skip("min/max are not defined for complex (see test_errors.py)")
    x = rand((N, 3, 5), reduce_dtype, seed=1)
    if op == "prod":  # keep |product| of 8 values small enough for float16/int8 ranges
        x = (x / 2).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x
    compare(mesh8, lambda v: jaxcomm.all_reduce(v, "x", op=op),
            lambda v: lax_all_reduce(v, "x", op), x, exact=False)


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_all_reduce_bool(mesh8, op):
    # bool sums (and means) like psum: as int32; min/max/prod are and/or/and.
    x = rand((N, 17), "bool", seed=2)
    got = compare(mesh8, lambda v: jaxcomm.all_reduce(v, "x", op=op),
                  lambda v: lax_all_reduce(v, "x", op), x, exact=False)
    if op in ("min", "prod"):
        assert_same(got[0], x.all(0))
    elif op == "max":
        assert_same(got[0], x.any(0))


def test_all_reduce_known_values(mesh8):
    # Independent of jax.lax: sum of ranks 0..7 is 28 on every device.
    x = np.arange(N, dtype=np.float32)
    got = per_device(lambda v: jaxcomm.all_reduce(v, "x"), mesh8, x)
    assert_same(got, np.full((N,), 28.0, np.float32))


@pytest.mark.parametrize("shape", [(), (0, 3), (3, 5, 7), (1,), (257,)],
                         ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("op", ["sum", "max", "mean"])
def test_all_reduce_shapes(mesh8, shape, op):
    x = rand((N, *shape), "float32", seed=3)
    compare(mesh8, lambda v: jaxcomm.all_reduce(v, "x", op=op),
            lambda v: lax_all_reduce(v, "x", op), x, exact=False)


def test_all_reduce_nan_propagates(mesh8):
    x = rand((N, 4), "float32")
    x[3, 1] = np.nan
    x[0, 2] = np.nan
    for op in ("max", "min", "sum"):
        got = per_device(lambda v: jaxcomm.all_reduce(v, "x", op=op), mesh8, x)
        assert np.isnan(got[:, 1]).all() and np.isnan(got[:, 2]).all(), op
        assert not np.isnan(got[:, [0, 3]]).any(), op


def test_all_reduce_invariant_result_out_specs_replicated(mesh8):
    # all_reduce's result is typed invariant: out_specs=P() is accepted under check_vma.
    x = rand((N, 6), "float32", seed=4)
    got = run_sharded(lambda v: jaxcomm.all_reduce(v, "x"), mesh8, P("x"), P(), x)
    np.testing.assert_allclose(got, x.sum(0, keepdims=True), rtol=1e-6)


# --------------------------------------------------------------------------- all_gather

def test_all_gather_dtypes(mesh8, dtype):
    x = rand((N, 3, 5), dtype, seed=5)
    compare(mesh8, lambda v: jaxcomm.all_gather(v, "x"), lambda v: jax.lax.all_gather(v, "x"), x)


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 1, 4)], ids=["3x5x7", "2x1x4"])
def test_all_gather_axes(mesh8, shape, axis, tiled):
    x = rand((N, *shape), "float32", seed=6)
    compare(mesh8, lambda v: jaxcomm.all_gather(v, "x", axis=axis, tiled=tiled),
            lambda v: jax.lax.all_gather(v, "x", axis=axis, tiled=tiled), x)


def test_all_gather_scalar(mesh8):
    x = rand((N,), "int32", seed=7)
    got = compare(mesh8, lambda v: jaxcomm.all_gather(v, "x"),
                  lambda v: jax.lax.all_gather(v, "x"), x)
    assert_same(got, np.broadcast_to(x, (N, N)))


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
@pytest.mark.parametrize("axis", [0, 1])
def test_all_gather_zero_size(mesh8, axis, tiled):
    # numpy reference: XLA's own all-gather rejects a zero-size gather dimension.
    x = np.zeros((N, 0, 3), np.float32)
    got = per_device(lambda v: jaxcomm.all_gather(v, "x", axis=axis, tiled=tiled), mesh8, x)
    one = (np.concatenate if tiled else np.stack)(list(x), axis=axis)
    assert_same(got, np.broadcast_to(one, (N, *one.shape)))


# ----------------------------------------------------------------------- reduce_scatter

def test_reduce_scatter_dtypes(mesh8, reduce_dtype):
    x = rand((N, N, 3), reduce_dtype, seed=8)
    compare(mesh8, lambda v: jaxcomm.reduce_scatter(v, "x"),
            lambda v: lax_reduce_scatter(v, "x", 0, "sum", False), x, exact=False)


@pytest.mark.parametrize("op", ["prod", "min", "max"])
@pytest.mark.parametrize("dt", ["float32", "int32", "uint8", "bfloat16"])
def test_reduce_scatter_ops(mesh8, dt, op):
    x = rand((N, 2 * N, 3), dt, seed=9)
    if op == "prod" and jnp.issubdtype(x.dtype, jnp.inexact):
        x = (x / 2).astype(x.dtype)
    compare(mesh8, lambda v: jaxcomm.reduce_scatter(v, "x", op=op, tiled=True),
            lambda v: lax_reduce_scatter(v, "x", 0, op, True), x, exact=False)


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_reduce_scatter_dims(mesh8, dim, tiled):
    shape = [3, 5, 7]
    shape[dim] = 2 * N if tiled else N
    x = rand((N, *shape), "float32", seed=10)
    compare(mesh8, lambda v: jaxcomm.reduce_scatter(v, "x", scatter_dimension=dim, tiled=tiled),
            lambda v: lax_reduce_scatter(v, "x", dim % 3, "sum", tiled), x, exact=False)


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_reduce_scatter_zero_size(mesh8, tiled):
    x = np.zeros((N, N, 0), np.float32)
    compare(mesh8, lambda v: jaxcomm.reduce_scatter(v, "x", tiled=tiled),
            lambda v: lax_reduce_scatter(v, "x", 0, "sum", tiled), x, exact=False)


def test_reduce_scatter_known_values(mesh8):
    # x on rank r: row i holds r * 10 + i; rank i receives sum_r (10 r + i) = 280 + 8 i.
    x = (10 * np.arange(N)[:, None] + np.arange(N)[None, :]).astype(np.int32)
    got = per_device(lambda v: jaxcomm.reduce_scatter(v, "x"), mesh8, x)
    assert_same(got, (280 + 8 * np.arange(N)).astype(np.int32))


# ----------------------------------------------------------------------------- all_to_all

def test_all_to_all_dtypes(mesh8, dtype):
    x = rand((N, 3, N), dtype, seed=11)
    compare(mesh8, lambda v: jaxcomm.all_to_all(v, "x", 1, 0),
            lambda v: jax.lax.all_to_all(v, "x", 1, 0), x)


A2A_CASES = [
    # (local shape, split_axis, concat_axis, tiled)
    ((8, 3, 5), 0, 0, False),
    ((8, 3, 5), 0, 1, False),
    ((8, 3, 5), 0, 2, False),
    ((3, 5, 8), 2, 0, False),
    ((3, 8, 5), 1, 1, False),
    ((3, 8, 5), 1, -1, False),
    ((3, 5, 8), -1, 1, False),
    ((16, 3, 5), 0, 0, True),
    ((16, 3, 5), 0, 1, True),
    ((3, 5, 16), 2, 0, True),
    ((3, 16, 5), 1, 1, True),
    ((3, 16, 5), 1, 2, True),
    ((3, 1, 24), 2, 1, True),
    ((8,), 0, 0, False),
    ((24,), 0, 0, True),
]


@pytest.mark.parametrize("shape,split,concat,tiled", A2A_CASES,
                         ids=[f"{'x'.join(map(str, s))}-s{a}-c{b}-{'t' if t else 'u'}"
                              for s, a, b, t in A2A_CASES])
def test_all_to_all_axes(mesh8, shape, split, concat, tiled):
    x = rand((N, *shape), "float32", seed=12)
    compare(mesh8, lambda v: jaxcomm.all_to_all(v, "x", split, concat, tiled=tiled),
            lambda v: jax.lax.all_to_all(v, "x", split % v.ndim, concat % v.ndim, tiled=tiled), x)


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_all_to_all_zero_size(mesh8, tiled):
    x = np.zeros((N, N, 0), np.float32)
    compare(mesh8, lambda v: jaxcomm.all_to_all(v, "x", 0, 1, tiled=tiled),
            lambda v: jax.lax.all_to_all(v, "x", 0, 1, tiled=tiled), x)


def test_all_to_all_known_values(mesh8):
    # Rank r sends element j to rank j: rank j receives [r * 8 + j for r in ranks].
    x = np.arange(N * N, dtype=np.int32).reshape(N, N)
    got = per_device(lambda v: jaxcomm.all_to_all(v, "x", 0, 0, tiled=True), mesh8, x)
    assert_same(got, x.T)


# ------------------------------------------------------------------------------- ppermute

def test_ppermute_dtypes(mesh8, dtype):
    x = rand((N, 3, 5), dtype, seed=13)
    compare(mesh8, lambda v: jaxcomm.ppermute(v, "x", ring(N)),
            lambda v: jax.lax.ppermute(v, "x", ring(N)), x)


PERMS = {
    "ring+1": ring(N),
    "ring-3": ring(N, -3),
    "identity": [(i, i) for i in range(N)],
    "reverse": [(i, N - 1 - i) for i in range(N)],
    "partial": [(0, 1), (2, 5), (7, 0), (4, 4)],
    "single": [(6, 2)],
    "empty": [],
}


@pytest.mark.parametrize("perm", list(PERMS.values()), ids=list(PERMS))
def test_ppermute_perms(mesh8, perm):
    x = rand((N, 3, 5, 7), "float32", seed=14)
    got = compare(mesh8, lambda v: jaxcomm.ppermute(v, "x", perm),
                  lambda v: jax.lax.ppermute(v, "x", perm), x)
    # Independent check: ranks nobody sends to receive zeros.
    want = np.zeros_like(x)
    for s, d in perm:
        want[d] = x[s]
    assert_same(got, want)


@pytest.mark.parametrize("shape", [(), (0, 3), (3, 5, 7)],
                         ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_ppermute_shapes(mesh8, shape):
    perm = PERMS["partial"]
    x = rand((N, *shape), "int32", seed=15)
    compare(mesh8, lambda v: jaxcomm.ppermute(v, "x", perm),
            lambda v: jax.lax.ppermute(v, "x", perm), x)


# ------------------------------------------------------------------------------ broadcast

def test_broadcast_dtypes(mesh8, dtype):
    x = rand((N, 3, 5), dtype, seed=16)
    got = compare(mesh8, lambda v: jaxcomm.broadcast(v, "x", root=5),
                  lambda v: lax_broadcast(v, "x", 5), x)
    assert_same(got, np.broadcast_to(x[5], x.shape))


@pytest.mark.parametrize("root", [0, 5, 7])
@pytest.mark.parametrize("shape", [(), (0, 3), (3, 5, 7)],
                         ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_broadcast_roots_shapes(mesh8, shape, root):
    x = rand((N, *shape), "float32", seed=17)
    got = compare(mesh8, lambda v: jaxcomm.broadcast(v, "x", root=root),
                  lambda v: lax_broadcast(v, "x", root), x)
    assert_same(got, np.broadcast_to(x[root], x.shape))


def test_broadcast_bits_preserved(mesh8):
    # A copy, not an arithmetic reduction: -0.0, NaN payloads and infinities survive.
    x = np.zeros((N, 4), np.float32)
    x[2] = [-0.0, np.inf, -np.inf, 1.5]
    x[2, 0] = np.float32(-0.0)
    x.view(np.uint32)[2, 3] = 0x7FC00123  # a NaN with a payload
    got = per_device(lambda v: jaxcomm.broadcast(v, "x", root=2), mesh8, x)
    np.testing.assert_array_equal(got.view(np.uint32), np.broadcast_to(x[2], x.shape).view(np.uint32))


def test_broadcast_invariant_result_out_specs_replicated(mesh8):
    x = rand((N, 6), "int32", seed=18)
    got = run_sharded(lambda v: jaxcomm.broadcast(v, "x", root=3), mesh8, P("x"), P(), x)
    assert_same(got, x[3:4])


# ------------------------------------------------------------ without check_vma, reruns

OPS = {
    "all_reduce": (lambda v: jaxcomm.all_reduce(v, "x"), lambda v: jax.lax.psum(v, "x"), (N, 4)),
    "all_gather": (lambda v: jaxcomm.all_gather(v, "x", axis=1),
                   lambda v: jax.lax.all_gather(v, "x", axis=1), (3, 4)),
    "reduce_scatter": (lambda v: jaxcomm.reduce_scatter(v, "x", scatter_dimension=1),
                       lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=1), (3, N)),
    "all_to_all": (lambda v: jaxcomm.all_to_all(v, "x", 1, 0),
                   lambda v: jax.lax.all_to_all(v, "x", 1, 0), (3, N)),
    "ppermute": (lambda v: jaxcomm.ppermute(v, "x", ring(N, 3)),
                 lambda v: jax.lax.ppermute(v, "x", ring(N, 3)), (3, 4)),
    "broadcast": (lambda v: jaxcomm.broadcast(v, "x", root=6),
                  lambda v: lax_broadcast(v, "x", 6), (3, 4)),
}


@pytest.mark.parametrize("name", list(OPS))
def test_without_check_vma(mesh8, name):
    ours, ref, shape = OPS[name]
    x = rand((N, *shape), "float32", seed=19)
    compare(mesh8, ours, ref, x, exact=False, check_vma=False)


@pytest.mark.parametrize("name", list(OPS))
def test_rerun_with_new_data(mesh8, name):
    # One compiled program, executed three times on different data: nothing stale.
    from jax.sharding import NamedSharding
    ours, ref, shape = OPS[name]
    spec = P("x")
    g, h = (jax.jit(jax.shard_map(lambda v, f=f: f(v[0])[None], mesh=mesh8, in_specs=spec,
                                  out_specs=spec)) for f in (ours, ref))
    for seed in range(3):
        x = jax.device_put(rand((N, *shape), "float32", seed=100 + seed),
                           NamedSharding(mesh8, spec))
        assert_close(g(x), h(x))


def _cut(v, shape):
    return v[:shape[0], :shape[1]]


def test_all_ops_in_one_program(mesh8):
    # Six independent jaxcomm collectives in one program (XLA may run them in any order).
    x = rand((N, N, N), "float32", seed=20)
    got = per_device(lambda v: tuple(ours(_cut(v, s)) for ours, _, s in OPS.values()), mesh8, x)
    want = per_device(lambda v: tuple(ref(_cut(v, s)) for _, ref, s in OPS.values()), mesh8, x)
    for name, a, b in zip(OPS, got, want):
        assert_close(a, b, err_msg=name)


def test_jaxcomm_result_feeds_xla_collective(mesh8):
    # Dependent chains in both directions: jaxcomm -> lax -> jaxcomm.
    x = np.arange(N, dtype=np.float32)
    got = per_device(lambda v: jaxcomm.all_reduce(jax.lax.psum(jaxcomm.all_reduce(v, "x") * 2,
                                                                "x"), "x", op="max"),
                     mesh8, x)
    assert_same(got, np.full((N,), 2 * 28 * N, np.float32))


# Programs run in a child process: a deadlock there ends in XLA aborting the process (its
# own collectives give up after 40 s), which must not take the test session with it. It
# inherits the session's 8 CPU devices (tests/conftest.py sets XLA_FLAGS).
_CHILD = """
import numpy as np, jax, jax.numpy as jnp, jaxcomm
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((8,), ("x",))
K, COLS, MIX = {k}, {cols}, {mix}
def f(v, lax_only):
    outs = []
    for i in range(K):
        w = v[0] + i
        if lax_only or (MIX and i % 2):
            outs.append(jax.lax.all_to_all(w, "x", 0, 1, tiled=True)[None])
        else:
            outs.append(jaxcomm.all_to_all(w, "x", 0, 1, tiled=True, timeout_s=10)[None])
    return tuple(outs) + (jnp.zeros((1,), jnp.int8),)
x = np.random.default_rng(0).standard_normal((8, 8, COLS), dtype=np.float32)
x = jax.device_put(x, NamedSharding(mesh, P("x")))
run = lambda lax_only: jax.jit(jax.shard_map(lambda v: f(v, lax_only), mesh=mesh,
                                             in_specs=P("x"), out_specs=P("x")))
want = [np.asarray(a) for a in run(True)(x)]
g = run(False)
for rep in range(3):
    got = [np.asarray(a) for a in g(x)]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
print("CHILD-OK")
"""


def _run_child(k, cols, mix, timeout=300):
    # A deadlock ends in an error within about 40 s (jaxcomm's calls have a 10 s deadline,
    # XLA's own collectives abort after 40 s); the timeout is for a child that cannot
    # even start on a loaded machine (a fresh Python, jax and a compilation).
    import os
    import subprocess
    import sys
    code = _CHILD.format(k=k, cols=cols, mix=mix)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(
        os.path.abspath(jaxcomm.__file__))), env.get("PYTHONPATH")) if p)
    try:
        # cwd: not the repository root, whose jaxcomm/ (no extension built in place)
        # would shadow the installed package for `python -c`.
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=timeout,
                              cwd=os.path.dirname(os.path.abspath(__file__)))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{k} independent all_to_all calls ({cols} floats/row, mixed with "
                    f"jax.lax: {mix}) did not finish within {timeout} s")
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines()
             if "DEADLINE_EXCEEDED" in ln or ln.startswith(("F1", "Fatal", "jax.errors"))]
    assert proc.returncode == 0 and "CHILD-OK" in proc.stdout, (
        f"rc={proc.returncode}; " + "\n".join(lines[:3])[:1500])


def test_many_independent_jaxcomm_collectives():
    # 16 independent 256 KiB all_to_alls: XLA runs them concurrently, in a different
    # order on each device. Every one must complete.
    _run_child(k=16, cols=8192, mix=False)


def test_independent_jaxcomm_and_xla_collectives():
    # jaxcomm collectives next to independent jax.lax ones in one program.
    _run_child(k=4, cols=64, mix=True)


@pytest.mark.parametrize("name", ["all_reduce", "broadcast"])
def test_operand_survives_in_place_ops(mesh8, name):
    # all_reduce and broadcast may write their result over the operand's buffer; an
    # operand still used afterwards must keep its value.
    x = rand((N, 5), "float32", seed=25)
    ours = OPS[name][0]
    got, kept = per_device(lambda v: (ours(v), v * 1), mesh8, x)
    assert_same(kept, x)
    want = per_device(OPS[name][1], mesh8, x)
    assert_close(got, want)


# -------------------------------------------------------------------- 2x4 ("dp", "ep")

AXES_2X4 = ["ep", "dp", ("dp", "ep"), ("ep", "dp")]
AXES_IDS = ["ep", "dp", "dp,ep", "ep,dp"]
SIZES_2X4 = {"ep": 4, "dp": 2, ("dp", "ep"): 8, ("ep", "dp"): 8}


def _partial_perm(r):
    # Rank 0 -> last rank, last rank -> 1 (for r > 2); the other ranks receive zeros.
    return [(0, r - 1), (r - 1, 1)] if r > 2 else [(0, 1)]


def _mesh_cases(axes):
    r = SIZES_2X4[axes]
    return {
        "all_reduce_sum": (lambda v: jaxcomm.all_reduce(v, axes), lambda v: jax.lax.psum(v, axes),
                           (3, 5), False),
        "all_reduce_max": (lambda v: jaxcomm.all_reduce(v, axes, op="max"),
                           lambda v: jax.lax.pmax(v, axes), (3, 5), False),
        "all_gather": (lambda v: jaxcomm.all_gather(v, axes, axis=1),
                       lambda v: jax.lax.all_gather(v, axes, axis=1), (3, 5), True),
        "all_gather_tiled": (lambda v: jaxcomm.all_gather(v, axes, tiled=True),
                             lambda v: jax.lax.all_gather(v, axes, tiled=True), (3, 5), True),
        "reduce_scatter": (lambda v: jaxcomm.reduce_scatter(v, axes, scatter_dimension=1, tiled=True),
                           lambda v: jax.lax.psum_scatter(v, axes, scatter_dimension=1, tiled=True),
                           (3, 2 * r), False),
        "all_to_all": (lambda v: jaxcomm.all_to_all(v, axes, 1, 0),
                       lambda v: jax.lax.all_to_all(v, axes, 1, 0), (3, r), True),
        "ppermute": (lambda v: jaxcomm.ppermute(v, axes, ring(r)),
                     lambda v: lax_ppermute_by_rank(v, axes, ring(r), r), (3, 5), True),
        "ppermute_partial": (lambda v: jaxcomm.ppermute(v, axes, _partial_perm(r)),
                             lambda v: lax_ppermute_by_rank(v, axes, _partial_perm(r), r),
                             (3, 5), True),
        "broadcast": (lambda v: jaxcomm.broadcast(v, axes, root=1),
                      lambda v: lax_broadcast(v, axes, 1), (3, 5), True),
    }


MESH_OPS = list(_mesh_cases("ep"))


@pytest.mark.parametrize("axes", AXES_2X4, ids=AXES_IDS)
@pytest.mark.parametrize("name", MESH_OPS)
def test_mesh_2x4(mesh2x4, name, axes):
    ours, ref, shape, exact = _mesh_cases(axes)[name]
    x = rand((N, *shape), "float32", seed=21)
    compare(mesh2x4, ours, ref, x, exact=exact)


@pytest.mark.parametrize("axes", ["ep", "dp", ("dp", "ep")], ids=["ep", "dp", "dp,ep"])
def test_mesh_2x4_ppermute_vs_lax(mesh2x4, axes):
    # Where jax.lax.ppermute's sorted-device numbering equals axis_index's (axes in mesh
    # order), jaxcomm must match it exactly.
    r = SIZES_2X4[axes]
    perm = ring(r, -1)
    x = rand((N, 3, 5), "float32", seed=24)
    compare(mesh2x4, lambda v: jaxcomm.ppermute(v, axes, perm),
            lambda v: jax.lax.ppermute(v, axes, perm), x)


def test_ppermute_tuple_axes_follow_axis_index(mesh2x4):
    # Over ("ep", "dp") rank = ep * 2 + dp (lax.axis_index); a ring shift must deliver
    # rank r - 1's axis_index to rank r.
    axes = ("ep", "dp")
    x = np.zeros((N,), np.int32)
    got = per_device(lambda v: (jax.lax.axis_index(axes),
                                jaxcomm.ppermute(v + jax.lax.axis_index(axes), axes, ring(N))),
                     mesh2x4, x)
    rank, received = got
    assert_same(received, ((rank - 1) % N).astype(np.int32))


def test_mesh_2x4_groups_known_values(mesh2x4):
    # Device (dp, ep) holds 10 * dp + ep. Over "ep" each dp row sums its own 4 values.
    x = np.array([10 * d + e for d in range(2) for e in range(4)], np.int32)
    got = per_device(lambda v: (jaxcomm.all_reduce(v, "ep"), jaxcomm.all_reduce(v, "dp"),
                                jaxcomm.all_gather(v, ("ep", "dp"))), mesh2x4, x)
    assert_same(got[0], np.repeat(np.array([6, 46], np.int32), 4))
    assert_same(got[1], np.tile(np.array([10, 12, 14, 16], np.int32), 2))
    # ("ep", "dp"): rank = ep * 2 + dp.
    order = np.array([10 * d + e for e in range(4) for d in range(2)], np.int32)
    assert_same(got[2], np.broadcast_to(order, (N, N)))


# -------------------------------------------------------------------- large messages

MIB = 1 << 20


def _large_cases(elems):
    # `elems` float32 elements per device, shaped (N, elems // N + odd tail).
    cols = elems // N
    return {
        "all_reduce": (lambda v: jaxcomm.all_reduce(v, "x"), lambda v: jax.lax.psum(v, "x"),
                       (N, cols + 3), False),
        "all_gather": (lambda v: jaxcomm.all_gather(v, "x", axis=1, tiled=True),
                       lambda v: jax.lax.all_gather(v, "x", axis=1, tiled=True), (N, cols + 3),
                       True),
        "reduce_scatter": (lambda v: jaxcomm.reduce_scatter(v, "x", scatter_dimension=1, tiled=True),
                           lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=1, tiled=True),
                           (3, N * (cols // 3 + 1)), False),
        "all_to_all": (lambda v: jaxcomm.all_to_all(v, "x", 0, 1, tiled=True),
                       lambda v: jax.lax.all_to_all(v, "x", 0, 1, tiled=True), (N, cols + 3), True),
        "ppermute": (lambda v: jaxcomm.ppermute(v, "x", ring(N, 3)),
                     lambda v: jax.lax.ppermute(v, "x", ring(N, 3)), (N, cols + 3), True),
        "broadcast": (lambda v: jaxcomm.broadcast(v, "x", root=5),
                      lambda v: lax_broadcast(v, "x", 5), (N, cols + 3), True),
    }


@pytest.mark.parametrize("mib", [1, 4])
@pytest.mark.parametrize("name", list(_large_cases(1024)))
def test_large_messages(mesh8, name, mib):
    ours, ref, shape, exact = _large_cases(mib * MIB // 4)[name]
    x = rand((N, *shape), "float32", seed=22)
    assert x[0].nbytes >= mib * MIB
    compare(mesh8, ours, ref, x, exact=exact)


@pytest.mark.parametrize("dt", ["bfloat16", "int8"])
def test_large_all_reduce_narrow_types(mesh8, dt):
    x = rand((N, 2 * MIB // jnp.dtype(dt).itemsize + 5), dt, seed=23)
    compare(mesh8, lambda v: jaxcomm.all_reduce(v, "x"), lambda v: jax.lax.psum(v, "x"), x,
            exact=False)



@pytest.mark.parametrize("name", list(_large_cases(1024)))
def test_streaming_stores_give_the_same_results(mesh8, streaming_stores, name):
    # Rows of 67 float32s: results start and end off the stores' 16-byte alignment.
    ours, ref, shape, exact = _large_cases(8 * N)[name]
    x = rand((N, *shape), "float32", seed=27)
    compare(mesh8, ours, ref, x, exact=exact)


@pytest.mark.parametrize("dt", ["float32", "bfloat16", "int8", "complex64"])
@pytest.mark.parametrize("n", [0, 5, 4099])
def test_streaming_stores_reduce(mesh8, streaming_stores, dt, n):
    # float32: reduced into an L1 block, then streamed; bfloat16: rounded, then streamed;
    # complex64 over 8 inputs: the generic accumulator; 4099: several blocks and a tail.
    x = rand((N, n), dt, seed=28)
    compare(mesh8, lambda v: jaxcomm.all_reduce(v, "x"), lambda v: jax.lax.psum(v, "x"), x,
            exact=False)
    compare(mesh8, lambda v: jaxcomm.reduce_scatter(v.reshape(N, -1), "x", scatter_dimension=0,
                                                    tiled=True),
            lambda v: jax.lax.psum_scatter(v.reshape(N, -1), "x", scatter_dimension=0, tiled=True),
            rand((N, N * n), dt, seed=29), exact=False)


def test_nontemporal_bytes_setting_round_trips():
    from jaxcomm import _jaxcomm
    before = _jaxcomm.nontemporal_bytes()
    try:
        _jaxcomm.set_nontemporal_bytes(-5)  # negative: off, like 0
        assert _jaxcomm.nontemporal_bytes() == 0
        _jaxcomm.set_nontemporal_bytes(1 << 22)
        assert _jaxcomm.nontemporal_bytes() == 1 << 22
    finally:
        _jaxcomm.set_nontemporal_bytes(before)


@pytest.mark.parametrize("axes,name", [("ep", "all_reduce"), ("dp", "all_to_all"),
                                       (("ep", "dp"), "all_gather")])
def test_large_messages_2x4(mesh2x4, axes, name):
    # Several groups at once, each large enough to split its work over threads.
    r = SIZES_2X4[axes]
    cols = MIB // 4 // r
    ours, ref = {
        "all_reduce": (lambda v: jaxcomm.all_reduce(v, axes), lambda v: jax.lax.psum(v, axes)),
        "all_to_all": (lambda v: jaxcomm.all_to_all(v, axes, 0, 1, tiled=True),
                       lambda v: jax.lax.all_to_all(v, axes, 0, 1, tiled=True)),
        "all_gather": (lambda v: jaxcomm.all_gather(v, axes, axis=1, tiled=True),
                       lambda v: jax.lax.all_gather(v, axes, axis=1, tiled=True)),
    }[name]
    x = rand((N, r, cols + 1), "float32", seed=26)
    compare(mesh2x4, ours, ref, x, exact=name != "all_reduce")


# -------------------------------------------------------- groups of 5, 6 and 7 ranks

def _odd_group_cases(n):
    """name -> (jaxcomm on one device's block [2n, 3], NumPy: every device's result from
    the blocks X [n, 2n, 3]). Groups of 5-7 ranks take the reduction kernels' generic
    path (ffi/cpu/kernels.cc has fixed-width ones for 2, 3, 4 and 8 inputs)."""
    shift = ring(n, 2)
    partial = [(0, n - 1), (n - 1, 2), (3, 0)]

    def each(f):  # one NumPy result per device rank r
        return lambda X: np.stack([f(X, r) for r in range(n)])

    def permuted(X, perm):
        out = np.zeros_like(X)
        for s, d in perm:
            out[d] = X[s]
        return out

    def ragged(v):
        # Rank s sends rows [0, (s + d) % 3 + 1) of its block to rank d, at rows 3 s of d's output.
        r = jax.lax.axis_index("x")
        ks = jnp.arange(n, dtype=jnp.int32)
        sizes = (r + ks) % 3 + 1
        return jaxcomm.ragged_all_to_all(v, jnp.zeros((3 * n, 3), v.dtype), jnp.zeros((n,), jnp.int32),
                                         sizes, jnp.full((n,), 3 * r, jnp.int32), sizes, axis_name="x")

    def ragged_np(X, d):
        out = np.zeros((3 * n, 3), X.dtype)
        for s in range(n):
            k = (s + d) % 3 + 1
            out[3 * s:3 * s + k] = X[s][:k]
        return out

    as_int = lambda v: (v * 8).astype(jnp.int32)  # rand's multiples of 1/8 as integers
    return {
        "all_reduce sum": (lambda v: jaxcomm.all_reduce(v, "x"), each(lambda X, r: X.sum(0))),
        "all_reduce max": (lambda v: jaxcomm.all_reduce(v, "x", op="max"), each(lambda X, r: X.max(0))),
        "all_reduce min int32": (lambda v: jaxcomm.all_reduce(as_int(v), "x", op="min"),
                                 each(lambda X, r: (X * 8).astype(np.int32).min(0))),
        "all_reduce prod int32": (lambda v: jaxcomm.all_reduce(as_int(v) % 5 - 2, "x", op="prod"),
                                  each(lambda X, r: ((X * 8).astype(np.int32) % 5 - 2).prod(0, dtype=np.int32))),
        "all_reduce sum bfloat16": (
            lambda v: jaxcomm.all_reduce(v.astype(jnp.bfloat16), "x").astype(jnp.float32),
            each(lambda X, r: X.sum(0))),
        "all_gather tiled": (lambda v: jaxcomm.all_gather(v, "x", tiled=True),
                             each(lambda X, r: np.concatenate(X))),
        "all_gather axis 1": (lambda v: jaxcomm.all_gather(v, "x", axis=1),
                              each(lambda X, r: np.stack(list(X), axis=1))),
        "reduce_scatter": (lambda v: jaxcomm.reduce_scatter(v, "x", tiled=True),
                           each(lambda X, r: X.sum(0)[2 * r:2 * r + 2])),
        "reduce_scatter max": (lambda v: jaxcomm.reduce_scatter(v, "x", op="max", tiled=True),
                               each(lambda X, r: X.max(0)[2 * r:2 * r + 2])),
        "all_to_all": (lambda v: jaxcomm.all_to_all(v, "x", 0, 0, tiled=True),
                       each(lambda X, r: np.concatenate([X[s][2 * r:2 * r + 2] for s in range(n)]))),
        "all_to_all concat 1": (lambda v: jaxcomm.all_to_all(v, "x", 0, 1, tiled=True),
                                each(lambda X, r: np.concatenate([X[s][2 * r:2 * r + 2]
                                                                  for s in range(n)], axis=1))),
        "ppermute shift": (lambda v: jaxcomm.ppermute(v, "x", shift), lambda X: permuted(X, shift)),
        "ppermute partial": (lambda v: jaxcomm.ppermute(v, "x", partial),
                             lambda X: permuted(X, partial)),
        "broadcast": (lambda v: jaxcomm.broadcast(v, "x", root=n - 2),
                      each(lambda X, r: X[n - 2])),
        "ragged_all_to_all": (ragged, each(ragged_np)),
    }


@pytest.mark.parametrize("n", [5, 6, 7])
def test_groups_of_five_to_seven_ranks_match_numpy(n):
    # Every op in one program over the first n devices, against NumPy of the global data.
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    cases = _odd_group_cases(n)
    x = rand((n, 2 * n, 3), "float32", seed=30 + n)
    got = per_device(lambda v: tuple(f(v) for f, _ in cases.values()), mesh, x)
    for (name, (_, expected)), result in zip(cases.items(), got):
        assert_same(result, expected(x), err_msg=name)


# ------------------------------------------------------- half precision, rounded once

def narrow_half(shape, dtype, seed=0):
    """Half-precision values of magnitude 0.5 to 8: a sum of up to 8 of them is exact in
    float32 in any order, so rounding it once to ``dtype`` has one right answer, which an
    accumulator in half precision (rounding after every addition) often misses."""
    rng = np.random.default_rng(seed)
    mag = rng.uniform(0.5, 8.0, size=shape)
    return np.where(rng.random(shape) < 0.5, -mag, mag).astype(jnp.dtype(dtype))


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_half_precision_sums_are_rounded_once(mesh8, dt):
    # More than 2048 elements (the float32 accumulator's block in ffi/cpu/kernels.cc), both
    # for all_reduce and for each rank's share of a reduce_scatter.
    n = 3 * 2048 + 5
    x = narrow_half((N, N * n), dt, seed=31)
    exact = x.astype(np.float64).sum(0)
    want = exact.astype(x.dtype)
    # The data can tell: half-precision accumulation gets some of these sums wrong.
    acc = x[0]
    for row in x[1:]:
        acc = (acc.astype(np.float32) + row.astype(np.float32)).astype(x.dtype)
    assert (acc != want).sum() > N * n // 10
    got_ar, got_rs = per_device(lambda v: (jaxcomm.all_reduce(v, "x"),
                                           jaxcomm.reduce_scatter(v, "x", tiled=True)), mesh8, x)
    assert_same(got_ar, np.broadcast_to(want, x.shape))
    assert_same(got_rs, want.reshape(N, n))


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_half_precision_sums_over_groups_are_rounded_once(mesh2x4, dt):
    # The same rounding on other paths: two groups of 4 (over "ep" of a 2x4 mesh), the
    # mean (a sum, then one division), a reduce_scatter along dimension 1; every rank's
    # share past 2048 elements (the float32 accumulator's block).
    n = 2048 + 301
    x = narrow_half((8, 4, 4 * n), dt, seed=32)
    groups = x.reshape(2, 4, 4, 4 * n)  # [dp, ep, ...]: "ep" groups are the rows
    exact = groups.astype(np.float64).sum(1)  # [dp, 4, 4n]
    acc = groups[:, 0]
    for k in range(1, 4):
        acc = (acc.astype(np.float32) + groups[:, k].astype(np.float32)).astype(x.dtype)
    assert (acc != exact.astype(x.dtype)).sum() > acc.size // 20  # the data can tell
    got_sum, got_mean, got_rs = per_device(
        lambda v: (jaxcomm.all_reduce(v, "ep"), jaxcomm.all_reduce(v, "ep", op="mean"),
                   jaxcomm.reduce_scatter(v, "ep", scatter_dimension=1, tiled=True)),
        mesh2x4, x)
    want_sum = np.repeat(exact.astype(x.dtype), 4, axis=0)
    want_mean = np.repeat((exact / 4).astype(x.dtype), 4, axis=0)
    want_rs = np.concatenate([np.split(exact[d].astype(x.dtype), 4, axis=1) for d in range(2)])
    assert_same(got_sum, want_sum)
    assert_same(got_mean, want_mean)
    assert_same(got_rs, want_rs)
