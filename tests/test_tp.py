"""jaxcomm.tp: one-sided puts and the collective matmuls, in one process (8 devices).

References: jax.lax.ppermute for the puts; the unfused jax.lax compositions
(all_gather then matmul, matmul then psum_scatter) for the matmuls, and for exactness in
float32 the same ring written with jax.lax (same chunk products, same order of additions);
jax.grad of the unfused compositions and jax.test_util.check_grads for the gradients.
"""

from __future__ import annotations

import os
import re
from functools import partial

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jaxcomm
from conftest import rand, run_sharded
from example_util import run_example
from slow_util import slow

RING8 = [(i, (i + 1) % 8) for i in range(8)]


# ------------------------------------------------------------------------------ puts

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, slow(jnp.int8), slow(jnp.int64)])
@pytest.mark.parametrize("perm", [RING8, [(0, 3), (3, 0), (5, 6)]], ids=["ring", "partial"])
def test_put_equals_ppermute(mesh8, dtype, perm):
    if dtype == jnp.int64:
        jax.config.update("jax_enable_x64", True)
    try:
        x = rand((8 * 3, 5), dtype)
        a = rand((8 * 4, 4), jnp.float32, seed=1)

        def body(v, a):
            pending = jaxcomm.tp.put_start(v, "x", perm)
            h = a @ a.T                      # overlapped with the put
            return jaxcomm.tp.put_done(pending), jax.lax.ppermute(v, "x", perm), h

        got, want, h = run_sharded(body, mesh8, (P("x"), P("x")), (P("x"), P("x"), P("x")), x, a)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_put_runs_between_start_and_done(mesh8):
    """XLA schedules work that does not depend on the received block between the halves."""
    def body(v, a):
        pending = jaxcomm.tp.put_start(v, "x", RING8)
        h = a @ a.T
        return jaxcomm.tp.put_done(pending) + h.sum()

    shard = jax.sharding.NamedSharding(mesh8, P("x"))
    x = jax.device_put(jnp.ones((64, 64)), shard)
    f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=(P("x"), P("x")), out_specs=P("x")))
    text = f.lower(x, x).compile().as_text()
    order = [m.group(0) for m in re.finditer(r"jaxcomm_put_start|jaxcomm_put_done|\bdot\(|convolution\(", text)]
    assert order.index("jaxcomm_put_start") < len(order) - 1 - order[::-1].index("jaxcomm_put_done")
    assert any("dot" in o or "convolution" in o for o in order), text


def test_put_gradient_and_vmap(mesh8):
    x = rand((8 * 2, 3), jnp.float32)

    def put(v):
        return jaxcomm.tp.put_done(jaxcomm.tp.put_start(v, "x", RING8))

    def body(v):
        g = jax.grad(lambda u: (put(u) * jnp.arange(3.0)).sum())(v)
        g_ref = jax.grad(lambda u: (jax.lax.ppermute(u, "x", RING8) * jnp.arange(3.0)).sum())(v)
        batched = jax.vmap(put, in_axes=1, out_axes=1)(v)
        return g, g_ref, batched, jax.lax.ppermute(v, "x", RING8)

    g, g_ref, batched, want = run_sharded(body, mesh8, P("x"), (P("x"),) * 4, x)
    np.testing.assert_array_equal(g, g_ref)
    np.testing.assert_array_equal(batched, want)


def test_put_bad_input(mesh8):
    with pytest.raises(ValueError, match=r"jaxcomm.tp.put_start: perm \(\(0, 1\), \(2, 1\)\) is not a permutation"):
        run_sharded(lambda v: jaxcomm.tp.put_done(jaxcomm.tp.put_start(v, "x", [(0, 1), (2, 1)])),
                    mesh8, P("x"), P("x"), np.ones(8, np.float32))
    with pytest.raises(TypeError, match="jaxcomm.tp.put_done: expects what jaxcomm.tp.put_start returned, got ndarray"):
        jaxcomm.tp.put_done(np.ones(3))

    def twice(v):
        pending = jaxcomm.tp.put_start(v, "x", RING8)
        jaxcomm.tp.put_done(pending)
        return jaxcomm.tp.put_done(pending)
    with pytest.raises(ValueError, match="jaxcomm.tp.put_done: this PendingPut was already completed"):
        run_sharded(twice, mesh8, P("x"), P("x"), np.ones(8, np.float32))


# ------------------------------------------------------------------------ references

def lax_agm(x, w, axis, g):
    return jax.lax.all_gather(x, axis, axis=g, tiled=True) @ w


def lax_mrs(x, w, axis, g):
    return jax.lax.psum_scatter(x @ w, axis, scatter_dimension=g, tiled=True)


def lax_ring_mrs(x, w, axis, g, R):
    """matmul_reduce_scatter's one-way ring written with jax.lax: the same products, added
    in the same order (block b: rank b+1's share first)."""
    me = jax.lax.axis_index(axis)
    mb = x.shape[g] // R
    perm = [(i, (i + 1) % R) for i in range(R)]

    def share(s):
        return jax.lax.dynamic_slice_in_dim(x, ((me - 1 - s) % R) * mb, mb, g) @ w
    acc = share(0)
    for s in range(1, R):
        acc = jax.lax.ppermute(acc, axis, perm) + share(s)
    return acc


def _specs(ndim, g, axis="x"):
    spec = [None] * ndim
    spec[g] = axis
    return P(*spec)


# ------------------------------------------------------------------------ matmul values

CASES = [  # (x shape per rank, gather/scatter axis, N, keywords)
    ((4, 16), 0, 8, {}),                                           # small: no ring by default
    ((4, 16), 0, 8, {"direction": "bidirectional"}),
    slow((4, 16), 0, 8, {"direction": "one_way"}),
    ((5, 16), 0, 8, {"direction": "bidirectional", "chunks": 3}),   # uneven pieces: 2, 2, 1
    ((2, 3, 16), 1, 8, {"direction": "bidirectional"}),            # a leading batch dimension
    slow((3, 2, 4, 16), 1, 8, {"direction": "one_way", "chunks": 2}),
]


@pytest.mark.parametrize("shape,g,N,kw", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_all_gather_matmul_exact(mesh8, shape, g, N, kw, dtype):
    x = rand((shape[0] * 8,) + shape[1:] if g == 0 else shape[:g] + (shape[g] * 8,) + shape[g + 1:], dtype)
    w = rand((shape[-1], N * 8), dtype, seed=1)
    spec = _specs(len(shape), g)
    wspec = P(None, "x")
    got, want = run_sharded(lambda x, w: (jaxcomm.tp.all_gather_matmul(x, w, "x", gather_axis=g, **kw),
                                          lax_agm(x, w, "x", g)),
                            mesh8, (spec, wspec), (_specs(len(shape), len(shape) - 1), ) * 2, x, w)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape,g,N,kw", CASES)
def test_matmul_reduce_scatter(mesh8, shape, g, N, kw):
    full = shape[:g] + (shape[g] * 8,) + shape[g + 1:]
    xs = P(*([None] * (len(shape) - 1) + ["x"]))
    x_i, w_i = rand(full[:-1] + (full[-1] * 8,), jnp.int32), rand((shape[-1] * 8, N), jnp.int32, seed=1)
    got, want = run_sharded(lambda x, w: (jaxcomm.tp.matmul_reduce_scatter(x, w, "x", scatter_dimension=g, **kw),
                                          lax_mrs(x, w, "x", g)),
                            mesh8, (xs, P("x")), (_specs(len(shape), g),) * 2, x_i, w_i)
    np.testing.assert_array_equal(got, want)     # integers: exact
    x_f = np.random.default_rng(2).normal(size=x_i.shape).astype(np.float32)
    w_f = np.random.default_rng(3).normal(size=w_i.shape).astype(np.float32)
    got, want = run_sharded(lambda x, w: (jaxcomm.tp.matmul_reduce_scatter(x, w, "x", scatter_dimension=g, **kw),
                                          lax_mrs(x, w, "x", g)),
                            mesh8, (xs, P("x")), (_specs(len(shape), g),) * 2, x_f, w_f)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_matmul_reduce_scatter_float32_same_order_exact(mesh8):
    x = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32)
    w = np.random.default_rng(1).normal(size=(64, 12)).astype(np.float32)
    got, want = run_sharded(lambda x, w: (jaxcomm.tp.matmul_reduce_scatter(x, w, "x", direction="one_way"),
                                          lax_ring_mrs(x, w, "x", 0, 8)),
                            mesh8, (P(None, "x"), P("x")), (P("x"), P("x")), x, w)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, slow(jnp.float16)])
def test_half_precision(mesh8, dtype):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 64)).astype(dtype)
    w = (rng.normal(size=(64, 64)) / 8).astype(dtype)
    f32 = np.float32

    def body(x, w, hx, hw):
        kw = dict(direction="bidirectional")
        return (jaxcomm.tp.all_gather_matmul(x, w, "x", **kw), jaxcomm.tp.matmul_reduce_scatter(hx, hw, "x", **kw))
    agm, mrs = run_sharded(body, mesh8, (P("x"), P(None, "x"), P(None, "x"), P("x")), (P(None, "x"), P("x")),
                           x, w, x, w)
    assert agm.dtype == dtype and mrs.dtype == dtype
    exact = x.astype(f32) @ w.astype(f32)
    # One rounding of a float32 sum: within half an ulp of the exact product's dtype.
    np.testing.assert_allclose(agm.astype(f32), exact.astype(dtype).astype(f32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(mrs.astype(f32), exact.astype(dtype).astype(f32), rtol=1e-2, atol=1e-2)


def test_groups_of_a_2d_mesh(mesh2x4):
    """Over "ep" of a ("dp", "ep") mesh: one ring per dp index."""
    x, w = rand((2 * 4 * 3, 8), jnp.int32), rand((8, 4 * 5), jnp.int32, seed=1)
    got, want = run_sharded(lambda x, w: (jaxcomm.tp.all_gather_matmul(x, w, "ep", direction="bidirectional"),
                                          lax_agm(x, w, "ep", 0)),
                            mesh2x4, (P(("dp", "ep")), P(None, "ep")), (P("dp", "ep"),) * 2, x, w)
    np.testing.assert_array_equal(got, want)


def test_degenerate_shapes():
    one = jax.make_mesh((1,), ("x",))
    x, w = rand((3, 4), jnp.float32), rand((4, 5), jnp.float32, seed=1)
    got = run_sharded(lambda x, w: (jaxcomm.tp.all_gather_matmul(x, w, "x"),
                                    jaxcomm.tp.matmul_reduce_scatter(x, w, "x")),
                      one, (P("x"), P()), (P("x"), P("x")), x, w)
    np.testing.assert_array_equal(got[0], x @ w)
    np.testing.assert_array_equal(got[1], x @ w)
    mesh = jax.make_mesh((8,), ("x",))
    z = np.zeros((0, 4), np.float32)
    got = run_sharded(lambda x, w: (jaxcomm.tp.all_gather_matmul(x, w, "x"),
                                    jaxcomm.tp.matmul_reduce_scatter(x, w, "x")),
                      mesh, (P("x"), P()), (P("x"), P("x")), z, w)
    assert got[0].shape == (0, 5) and got[1].shape == (0, 5)


# ------------------------------------------------------------------------ gradients

def _mlp(tp_ops, x, w1, w2, axis="x", g=0, direction=None):
    if tp_ops:
        h = jaxcomm.tp.all_gather_matmul(x, w1, axis, gather_axis=g, direction=direction)
        return jaxcomm.tp.matmul_reduce_scatter(jnp.tanh(h), w2, axis, scatter_dimension=g, direction=direction)
    return lax_mrs(jnp.tanh(lax_agm(x, w1, axis, g)), w2, axis, g)


@pytest.mark.parametrize("direction", [slow("one_way"), "bidirectional", "none"])
def test_gradients_match_unfused(mesh8, direction):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype(np.float32)
    w1 = rng.normal(size=(6, 8 * 3)).astype(np.float32)
    w2 = rng.normal(size=(8 * 3, 6)).astype(np.float32)
    rep = rng.normal(size=(6, 6)).astype(np.float32)

    def loss(tp_ops, x, w1, w2, rep):
        # rep is replicated (invariant): its gradient is summed over the ranks.
        y = _mlp(tp_ops, x, w1, w2) if not tp_ops else (
            jaxcomm.tp.matmul_reduce_scatter(jnp.tanh(jaxcomm.tp.all_gather_matmul(x, w1, "x", direction=direction)),
                                             w2, "x", direction=direction))
        y2 = (jaxcomm.tp.all_gather_matmul(y, rep, "x", direction=direction) if tp_ops else lax_agm(y, rep, "x", 0))
        return jax.lax.psum((y2 ** 2).sum(), "x")

    def body(x, w1, w2, rep):
        return (jax.grad(partial(loss, True), argnums=(0, 1, 2, 3))(x, w1, w2, rep),
                jax.grad(partial(loss, False), argnums=(0, 1, 2, 3))(x, w1, w2, rep))

    specs = (P("x"), P(None, "x"), P("x"), P())
    got, want = run_sharded(body, mesh8, specs, (specs, specs), x, w1, w2, rep)
    for a, b in zip(got, want):
        # Float32 sums of different orders: within a few ulps of the largest entry.
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


@pytest.mark.parametrize("direction", ["bidirectional", slow("none")])
def test_check_grads(x64, direction):
    # Auto axes: check_grads perturbs the arguments without their sharding.
    mesh8 = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 16, 4))
    w1 = rng.normal(size=(4, 16))
    w2 = rng.normal(size=(16, 4))

    f = jax.jit(jax.shard_map(lambda x, w1, w2: _mlp(True, x, w1, w2, g=1, direction=direction), mesh=mesh8,
                              in_specs=(P(None, "x"), P(None, "x"), P("x")), out_specs=P(None, "x")))
    args = [jax.device_put(a, NamedSharding(mesh8, s))
            for a, s in zip((x, w1, w2), (P(None, "x"), P(None, "x"), P("x")))]
    check_grads(f, args, order=1, modes=["rev"], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------ vmap

def test_vmap_inside_shard_map(mesh8):
    x, w = rand((3, 16, 4), jnp.int32), rand((3, 4, 8 * 2), jnp.int32, seed=1)
    kw = dict(direction="bidirectional")
    vm = jax.vmap(lambda x, w: (jaxcomm.tp.all_gather_matmul(x, w, "x", **kw),
                                jaxcomm.tp.matmul_reduce_scatter(jaxcomm.tp.all_gather_matmul(x, w, "x", **kw), w.T,
                                                                 "x", **kw)))
    ref = jax.vmap(lambda x, w: (lax_agm(x, w, "x", 0), lax_mrs(lax_agm(x, w, "x", 0), w.T, "x", 0)))
    got, want = run_sharded(lambda x, w: (vm(x, w), ref(x, w)), mesh8, (P(None, "x"), P(None, None, "x")),
                            ((P(None, None, "x"), P(None, "x")),) * 2, x, w)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("call,error,message", [
    (lambda x, w: jaxcomm.tp.all_gather_matmul(x[0], w, "x"), ValueError,
     "jaxcomm.tp.all_gather_matmul: x must have at least 2 dimensions ([..., rows, K]), got shape (4,)"),
    (lambda x, w: jaxcomm.tp.all_gather_matmul(x, w[None], "x"), ValueError,
     "jaxcomm.tp.all_gather_matmul: w must have 2 dimensions ([K, N]), got shape (1, 4, 8)"),
    (lambda x, w: jaxcomm.tp.all_gather_matmul(x, w.T, "x"), ValueError,
     "jaxcomm.tp.all_gather_matmul: x's last dimension (4) must equal w's first (8); shapes (1, 4) and (8, 4)"),
    (lambda x, w: jaxcomm.tp.all_gather_matmul(x, w.astype(jnp.int32), "x"), TypeError,
     "jaxcomm.tp.all_gather_matmul: x and w must have one dtype, got float32 and int32"),
    (lambda x, w: jaxcomm.tp.all_gather_matmul(x, w, "x", gather_axis=1), ValueError,
     "jaxcomm.tp.all_gather_matmul: gather_axis=1 names x's contracted (last) dimension; it must name a row "
     "dimension (use jaxcomm.all_gather and a dot otherwise)"),
    (lambda x, w: jaxcomm.tp.all_gather_matmul(x, w, "x", gather_axis=2), ValueError,
     "jaxcomm.tp.all_gather_matmul: gather_axis=2 is out of range for x of shape (1, 4)"),
    (lambda x, w: jaxcomm.tp.all_gather_matmul(x, w, "x", direction="ring"), ValueError,
     "jaxcomm.tp.all_gather_matmul: direction must be one of ('one_way', 'bidirectional', 'none'), got 'ring'"),
    (lambda x, w: jaxcomm.tp.all_gather_matmul(x, w, "x", direction="bidirectional", chunks=1), ValueError,
     "jaxcomm.tp.all_gather_matmul: chunks must be at least 2 for direction 'bidirectional', got 1"),
    (lambda x, w: jaxcomm.tp.matmul_reduce_scatter(x, w, "x"), ValueError,
     "jaxcomm.tp.matmul_reduce_scatter: x's dimension 0 (1) is not divisible by the group size 8"),
    (lambda x, w: jaxcomm.tp.matmul_reduce_scatter(x, w, "y"), NameError,
     "jaxcomm.tp.matmul_reduce_scatter: axis 'y' is not bound by an enclosing shard_map, and x has no "
     "NamedSharding over a mesh with that axis"),
], ids=["x1d", "w3d", "K", "dtype", "contracted", "range", "direction", "chunks", "divisible", "axis"])
def test_bad_input(mesh8, call, error, message):
    x, w = np.ones((8, 4), np.float32), np.ones((4, 8), np.float32)
    with pytest.raises(error, match=re.escape(message)):
        run_sharded(call, mesh8, (P("x"), P()), P("x"), x, w)


# ------------------------------------------------------------------------ docs, example

@pytest.mark.parametrize("name", ["all_gather_matmul", "matmul_reduce_scatter", "put_start"])
def test_docstring_examples(name):
    """The >>> examples of jaxcomm.tp's docstrings (tests/test_docs.py's namespace)."""
    import doctest
    globs = dict(jax=jax, jnp=jnp, np=np, P=P, NamedSharding=NamedSharding, jaxcomm=jaxcomm)
    (test,) = doctest.DocTestFinder(recurse=False).find(getattr(jaxcomm.tp, name), name, globs=globs)
    assert test.examples
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.failures == 0 and runner.tries > 0


@pytest.mark.parametrize("direction", ["bidirectional", slow("one_way")])
def test_tp_mlp_example_runs(direction):
    """examples/tp_mlp.py checks itself against the single-device reference, then trains."""
    stdout, losses = run_example("tp_mlp.py", "--steps", "3", "--direction", direction)
    assert "match the single-device reference" in stdout
    assert len(losses) == 3 and losses[2] < losses[0]


def test_put_deadline_names_the_missing_rank(mesh8):
    """A rank that never starts its put: the others' put_done fails at the deadline, naming
    the op, axis, call site and the rank; the process stays usable."""
    def body(v):
        def with_put(v):
            return jaxcomm.tp.put_done(jaxcomm.tp.put_start(v, "x", RING8, timeout_s=1))
        return jax.lax.cond(jax.lax.axis_index("x") == 0, lambda v: v, with_put, v)

    with pytest.raises(Exception, match=r"DEADLINE_EXCEEDED: jaxcomm.put_start over axis 'x' \(group 0 = "
                       r"partitions \[0 1 2 3 4 5 6 7\]\), rank \d \(partition \d\), call site "
                       r"test_tp.py:\d+ \(with_put\).* timed out after 1 s .* waiting for ranks \[0\]"):
        run_sharded(body, mesh8, P("x"), P("x"), np.ones(8, np.float32))
    got = run_sharded(lambda v: jaxcomm.tp.put_done(jaxcomm.tp.put_start(v, "x", RING8)), mesh8, P("x"), P("x"),
                      np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(got, np.roll(np.arange(8, dtype=np.float32), 1))


# ------------------------------------------------------------------------ global view

@pytest.mark.parametrize("direction,explicit", [("bidirectional", True), ("none", False), slow("one_way", True),
                                                slow("bidirectional", False), slow("none", True),
                                                slow("one_way", False)])
def test_global_view(direction, explicit):
    """Under jax.jit on NamedSharding arrays, no shard_map: x rows over ("dp", "tp"), w_up
    columns and w_down rows over "tp"; values and gradients against NumPy / jax.grad of the
    plain product, the layouts as stated, the puts in the program."""
    types = (jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=types)
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, size=(2, 16, 8)).astype(np.float32)
    w1 = rng.integers(-3, 3, size=(8, 12)).astype(np.float32)
    w2 = rng.integers(-3, 3, size=(12, 8)).astype(np.float32)
    specs = (P(None, ("dp", "tp")), P(None, "tp"), P("tp"))
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w1, w2), specs)]

    def block(x, w1, w2):
        h = jaxcomm.tp.all_gather_matmul(x, w1, "tp", gather_axis=1, direction=direction)
        return jaxcomm.tp.matmul_reduce_scatter(h * h, w2, "tp", scatter_dimension=1, direction=direction)

    f = jax.jit(block)
    np.testing.assert_array_equal(np.asarray(f(*args)), (x @ w1) ** 2 @ w2)
    if explicit:
        assert jax.typeof(f(*args)).sharding.spec == P(None, ("dp", "tp"), None)
    grads = jax.jit(jax.grad(lambda *a: (block(*a) ** 2).sum(), argnums=(0, 1, 2)))(*args)
    want = jax.grad(lambda x, w1, w2: ((((x @ w1) ** 2) @ w2) ** 2).sum(), argnums=(0, 1, 2))(x, w1, w2)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
    assert ("jaxcomm_put_start" in f.lower(*args).compile().as_text()) == (direction != "none")


def test_global_view_errors():
    mesh = jax.make_mesh((8,), ("tp",))
    x = jax.device_put(np.ones((12, 4), np.float32), NamedSharding(mesh, P()))
    with pytest.raises(ValueError, match=re.escape("jaxcomm.tp.all_gather_matmul: x's dimension 0 (12) is not "
                                                   "divisible by the 8 ranks of mesh axes ('tp',)")):
        jax.jit(lambda x: jaxcomm.tp.all_gather_matmul(x, jnp.ones((4, 8)), "tp"))(x)
    with pytest.raises(NameError, match=re.escape("jaxcomm.tp.all_gather_matmul: axis 'model' is not bound by an "
                                                  "enclosing shard_map")):
        jax.jit(lambda x: jaxcomm.tp.all_gather_matmul(x, jnp.ones((4, 8)), "model"))(x)


# ------------------------------------------------------------------------ benchmark

def test_bench_tp_derived_columns():
    from jaxcomm.bench import tp as bench_tp
    r = dict(tp=0.5, lax=1.0, ring=0.75, unfused=0.8, compute=0.4, comm=0.2)
    d = bench_tp.derived(r)
    assert (d["vs_lax"], d["vs_ring"], d["comm_share"]) == pytest.approx((2.0, 1.5, 1 / 3))
    assert d["hidden"] == pytest.approx(0.5)        # 0.4 + 0.2 - 0.5 of the 0.2 of communication


@pytest.mark.parametrize("case", [slow("small")])
def test_bench_tp_runs(case):
    """python -m jaxcomm.bench tp runs every side of every row."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxcomm.__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-m", "jaxcomm.bench", "tp", "--tp", "2", "--tokens", "64",
                           "--decode-tokens", "4", "--d-model", "32", "--d-ff", "16", "--rounds", "1", "--iters", "1"],
                          env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.abspath(__file__)))  # not the source tree's jaxcomm
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("2   4 ")]
    assert [(r[2], r[4]) for r in rows[-4:]] == [("train", "fwd"), ("train", "fwd+bwd"), ("decode", "fwd"),
                                                  ("decode", "fwd+bwd")]


def test_backend_xla_puts_are_ppermutes(mesh8, monkeypatch):
    """JAXCOMM_BACKEND=xla: the ring's puts are jax.lax.ppermute (same values, no jaxcomm call)."""
    monkeypatch.setenv("JAXCOMM_BACKEND", "xla")
    x, w = rand((8 * 4, 16), jnp.int32), rand((16, 8 * 3), jnp.int32, seed=1)

    def body(x, w):
        return jaxcomm.tp.all_gather_matmul(x, w, "x", direction="bidirectional"), lax_agm(x, w, "x", 0)
    f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=(P("x"), P(None, "x")), out_specs=(P(None, "x"),) * 2))
    args = [jax.device_put(a, NamedSharding(mesh8, s)) for a, s in zip((x, w), (P("x"), P(None, "x")))]
    got, want = f(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    text = f.lower(*args).compile().as_text()
    assert "jaxcomm_" not in text and "collective-permute" in text


# ------------------------------------------------------------------------ CUDA backend (emulated)

def test_put_on_the_emulated_cuda_backend():
    """The CUDA backend's put (ffi/cuda: ppermute's copy on jaxcomm's stream, put_done making
    XLA's stream wait) under the CPU emulation of the CUDA runtime: values equal jax.lax's,
    and jaxcomm.stats() names the CUDA route."""
    import importlib.util
    import subprocess
    import sys
    if importlib.util.find_spec("jaxcomm._jaxcomm_emu") is None:
        pytest.skip("this build has no CUDA emulation (_jaxcomm_emu)")
    script = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAXCOMM_EMULATE_CUDA"] = "1"
import numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxcomm
mesh = jax.make_mesh((4,), ("x",))
perm = [(0, 2), (2, 0), (1, 3)]                                  # rank 1 receives nothing: zeros
x = jax.device_put(np.arange(1200, dtype=np.float32).reshape(12, 100), NamedSharding(mesh, P("x")))
w = jax.device_put(np.arange(800, dtype=np.float32).reshape(100, 8) % 7, NamedSharding(mesh, P(None, "x")))
def body(v, w):
    pending = jaxcomm.tp.put_start(v, "x", perm)
    h = v @ v.T                                                  # XLA's stream runs this meanwhile
    return (jaxcomm.tp.put_done(pending), jax.lax.ppermute(v, "x", perm), jaxcomm.ppermute(v, "x", perm),
            jaxcomm.tp.all_gather_matmul(v, w, "x", direction="bidirectional"),
            jax.lax.all_gather(v, "x", tiled=True) @ w, h)
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=(P("x"),) * 3 + (P(None, "x"),) * 2 + (P("x"),)))
put, ref, permuted, agm, agm_ref, _ = f(x, w)
np.testing.assert_array_equal(np.asarray(put), np.asarray(ref))
np.testing.assert_array_equal(np.asarray(permuted), np.asarray(ref))      # ppermute's peer route, shared
np.testing.assert_array_equal(np.asarray(agm), np.asarray(agm_ref))
print("ROUTES", sorted({(s.op, s.algorithm) for s in jaxcomm.stats() if s.op.startswith("put")}))
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxcomm.__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXCOMM_BACKEND")}
    env["PYTHONPATH"] = root
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.abspath(__file__)))  # not the source tree's jaxcomm
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "('put_start', 'cuda (emulated): cuda peers in process')" in proc.stdout, proc.stdout
