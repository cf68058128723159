"""jaxcomm.ragged_all_to_all against a NumPy model of jax.lax.ragged_all_to_all's documented
semantics; its VJP against the exact transpose of that linear map; bounds errors; vmap;
the pure-JAX fallback (JAXCOMM_BACKEND=xla)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import test_util as jtu
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from conftest import per_device


def _mesh(r: int):
    return jax.make_mesh((r,), ("x",), devices=jax.devices()[:r])


def per_rank(f, r, *args):
    """Rank k of a 1-D mesh of r devices gets args[i][k]; returns f's outputs stacked."""
    return per_device(f, _mesh(r), *args)


def rat(operand, output, io, ss, oo, rs):
    return jaxcomm.ragged_all_to_all(operand, output, io, ss, oo, rs, axis_name="x")


# ------------------------------------------------------------------------- NumPy model

def np_writers(io, ss, oo, n_out):
    """For each receiver d and output row: the (source, source row) that wrote it last, as
    jax.lax documents it (receiver loops over slices i with source i // m), or None."""
    R, N = io.shape
    m = N // R
    writers = [[None] * n_out for _ in range(R)]
    for d in range(R):
        for s in range(R):
            for q in range(m):
                i = d * m + q
                for k in range(ss[s, i]):
                    writers[d][oo[s, i] + k] = (s, io[s, i] + k)
    return writers


def np_ragged(operand, output, io, ss, oo):
    res = np.array(output, copy=True)
    for d, rows in enumerate(np_writers(io, ss, oo, output.shape[1])):
        for row, w in enumerate(rows):
            if w is not None:
                res[d, row] = operand[w[0], w[1]]
    return res


def np_vjp(ct, operand_shape, io, ss, oo):
    """The exact transpose: output rows written by a slice get no cotangent; operand rows
    accumulate the cotangent of every output row they ended up in."""
    d_operand = np.zeros(operand_shape, ct.dtype)
    d_output = np.array(ct, copy=True)
    for d, rows in enumerate(np_writers(io, ss, oo, ct.shape[1])):
        for row, w in enumerate(rows):
            if w is not None:
                d_operand[w[0], w[1]] += ct[d, row]
                d_output[d, row] = 0
    return d_operand, d_output


def random_case(R, m, n_op, n_out, seed, max_size=3, overlap=False):
    """Valid offsets/sizes: each receiver lays out its incoming slices with gaps, the
    sources in a random order (in rank order, the last ranks' slices found the rows taken
    and were cut to zero rows), overlapping if ``overlap``; zero-size slices included."""
    rng = np.random.default_rng(seed)
    N = R * m
    ss = rng.integers(0, max_size + 1, size=(R, N))
    ss[rng.random((R, N)) < 0.2] = 0
    io = np.zeros((R, N), np.int32)
    oo = np.zeros((R, N), np.int32)
    for s in range(R):
        for i in range(N):
            io[s, i] = rng.integers(0, n_op - ss[s, i] + 1)
    for d in range(R):
        cursor = 0
        for s in rng.permutation(R):
            for q in range(m):
                i = d * m + q
                if overlap:
                    oo[s, i] = rng.integers(0, n_out - ss[s, i] + 1)
                else:
                    cursor += rng.integers(0, 2)
                    if cursor + ss[s, i] > n_out:
                        ss[s, i] = 0
                    oo[s, i] = min(cursor, n_out - ss[s, i])
                    cursor += ss[s, i]
    rs = np.zeros((R, N), np.int32)
    for d in range(R):
        for s in range(R):
            for q in range(m):
                rs[d, s * m + q] = ss[s, d * m + q]
    return io, ss.astype(np.int32), oo, rs


# ---------------------------------------------------------------------------- forward

def test_doc_example():
    operand = np.array([[1, 2, 2], [3, 4, 0]], np.float32)
    output = np.zeros((2, 4), np.float32)
    io = np.array([[0, 1], [0, 1]], np.int32)
    ss = np.array([[1, 2], [1, 1]], np.int32)
    oo = np.array([[0, 0], [1, 2]], np.int32)
    rs = np.array([[1, 1], [2, 1]], np.int32)
    got = per_rank(rat, 2, operand, output, io, ss, oo, rs)
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])
    np.testing.assert_array_equal(got, np_ragged(operand, output, io, ss, oo))


@pytest.mark.parametrize("R,m,dtype", [(8, 1, np.float32), (4, 3, np.int32), (8, 2, jnp.bfloat16),
                                       (5, 2, np.float32), (6, 1, np.int32), (7, 1, np.float32)])
def test_random_against_numpy(R, m, dtype):
    n_op, n_out, h = 10, 16, 3
    io, ss, oo, rs = random_case(R, m, n_op, n_out, seed=R * 10 + m)
    rng = np.random.default_rng(1)
    operand = rng.integers(-50, 50, size=(R, n_op, h)).astype(dtype)
    output = rng.integers(-50, 50, size=(R, n_out, h)).astype(dtype)
    got = per_rank(rat, R, operand, output, io, ss, oo, rs)
    np.testing.assert_array_equal(got, np_ragged(operand, output, io, ss, oo))


def test_overlapping_slices_later_wins():
    R, m = 4, 2
    io, ss, oo, rs = random_case(R, m, 6, 5, seed=3, overlap=True)
    operand = np.arange(R * 6, dtype=np.float32).reshape(R, 6) + 1
    output = -np.ones((R, 5), np.float32)
    got = per_rank(rat, R, operand, output, io, ss, oo, rs)
    np.testing.assert_array_equal(got, np_ragged(operand, output, io, ss, oo))


def test_int64_indices_under_x64():
    R, m = 4, 1
    io, ss, oo, rs = random_case(R, m, 5, 8, seed=7)
    operand = np.random.default_rng(0).normal(size=(R, 5, 2))
    output = np.zeros((R, 8, 2))
    with jax.enable_x64(True):
        args = [operand, output] + [a.astype(np.int64) for a in (io, ss, oo, rs)]
        got = per_rank(rat, R, *args)
        assert got.dtype == np.float64
    np.testing.assert_array_equal(got, np_ragged(operand, output, io, ss, oo))


@pytest.mark.parametrize("bad", ["input", "output", "negative", "recv"])
def test_out_of_range_is_an_error(bad):
    R = 4
    io, ss, oo, rs = random_case(R, 1, 4, 6, seed=11, max_size=2)
    ss[:, :] = np.maximum(ss, 1)
    io[:, :] = 0
    oo[:, :] = 0
    rs[:, :] = 1
    ss[:, :] = 1
    if bad == "input":
        io[2, 1] = 4  # one past the operand
    elif bad == "output":
        oo[1, 3] = 10**6
    elif bad == "negative":
        ss[0, 0], rs[0, 0] = -1, -1
    else:
        rs[3, 0] = 2
    operand = np.ones((R, 4, 2), np.float32)
    output = np.zeros((R, 6, 2), np.float32)
    with pytest.raises(Exception, match=r"ragged_all_to_all.*(outside|negative|differs)"):
        per_rank(rat, R, operand, output, io, ss, oo, rs)


# ---------------------------------------------------------------------------- gradients

def _vjp_case(R, m, io, ss, oo, rs, n_op, n_out, seed=0):
    rng = np.random.default_rng(seed)
    operand = rng.normal(size=(R, n_op, 2)).astype(np.float32)
    output = rng.normal(size=(R, n_out, 2)).astype(np.float32)
    ct = rng.normal(size=(R, n_out, 2)).astype(np.float32)

    def f(a, b, ct, *idx):
        _, pull = jax.vjp(lambda a, b: rat(a, b, *idx), a, b)
        return pull(ct)

    d_op, d_out = per_rank(f, R, operand, output, ct, io, ss, oo, rs)
    want_op, want_out = np_vjp(ct, operand.shape, io, ss, oo)
    np.testing.assert_allclose(d_op, want_op, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(d_out, want_out)


def test_vjp_random():
    R, m = 8, 2
    _vjp_case(R, m, *random_case(R, m, 6, 12, seed=5), 6, 12)


def test_vjp_zero_size_slice_sharing_offset():
    # Rank 0 receives an empty slice from rank 0 at row 2 and rows 2..4 from rank 1:
    # jax.lax's transpose cancels its mask at row 2 and leaks cotangent into rows 2..4.
    R = 2
    io = np.array([[0, 0], [0, 0]], np.int32)
    ss = np.array([[0, 1], [3, 1]], np.int32)
    oo = np.array([[2, 0], [2, 1]], np.int32)
    rs = np.array([[0, 3], [1, 1]], np.int32)
    _vjp_case(R, 1, io, ss, oo, rs, 4, 6)


def test_vjp_overlap_and_resend():
    # Overlapping received slices (the later one wins) and operand rows sent twice.
    R, m = 4, 2
    io, ss, oo, rs = random_case(R, m, 3, 4, seed=9, overlap=True)
    _vjp_case(R, m, io, ss, oo, rs, 3, 4)


def test_check_grads_second_order():
    R, m = 4, 1
    io, ss, oo, rs = random_case(R, m, 4, 6, seed=2)
    mesh = _mesh(R)
    idx = [jax.device_put(a, NamedSharding(mesh, P("x"))) for a in (io, ss, oo, rs)]

    def body(a, b, *ix):
        return rat(a[0], b[0], *(i[0] for i in ix))[None]

    g = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
    rng = np.random.default_rng(0)
    a = jax.device_put(rng.normal(size=(R, 4, 2)).astype(np.float32), NamedSharding(mesh, P("x")))
    b = jax.device_put(rng.normal(size=(R, 6, 2)).astype(np.float32), NamedSharding(mesh, P("x")))
    sh = NamedSharding(mesh, P("x"))
    # check_grads compares with g's own finite differences: g itself must be right too.
    np.testing.assert_array_equal(np.asarray(g(a, b, *idx)),
                                  np_ragged(np.asarray(a), np.asarray(b), io, ss, oo))
    jtu.check_grads(lambda a, b: g(jax.reshard(a, sh), jax.reshard(b, sh), *idx), (a, b), order=2, modes=["fwd", "rev"],
                              atol=1e-2, rtol=1e-2)


def test_vmap():
    R, m, B = 4, 1, 3
    cases = [random_case(R, m, 5, 7, seed=20 + b) for b in range(B)]
    io, ss, oo, rs = (np.stack([c[k] for c in cases], axis=1) for k in range(4))  # [R, B, N]
    rng = np.random.default_rng(4)
    operand = rng.normal(size=(R, B, 5, 2)).astype(np.float32)
    output = rng.normal(size=(R, B, 7, 2)).astype(np.float32)
    got = per_rank(jax.vmap(rat), R, operand, output, io, ss, oo, rs)
    for b in range(B):
        want = np_ragged(operand[:, b], output[:, b], io[:, b], ss[:, b], oo[:, b])
        np.testing.assert_array_equal(got[:, b], want)


# ---------------------------------------------------------------------------- fallback

def test_xla_fallback_matches(monkeypatch):
    monkeypatch.setenv("JAXCOMM_BACKEND", "xla")
    R, m = 4, 2
    io, ss, oo, rs = random_case(R, m, 5, 9, seed=13)
    rng = np.random.default_rng(6)
    operand = rng.normal(size=(R, 5, 2)).astype(np.float32)
    output = rng.normal(size=(R, 9, 2)).astype(np.float32)
    ct = rng.normal(size=(R, 9, 2)).astype(np.float32)

    def f(a, b, ct, *idx):  # a fresh function: the backend is chosen at trace time
        y, pull = jax.vjp(lambda a, b: rat(a, b, *idx), a, b)
        return (y, *pull(ct))

    y, d_op, d_out = per_rank(f, R, operand, output, ct, io, ss, oo, rs)
    np.testing.assert_array_equal(y, np_ragged(operand, output, io, ss, oo))
    want_op, want_out = np_vjp(ct, operand.shape, io, ss, oo)
    np.testing.assert_allclose(d_op, want_op, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(d_out, want_out)


def test_trace_time_errors():
    mesh = _mesh(4)

    def call(io_len=4, idx_dtype=np.int32, out_shape=(6, 2)):
        def body(a):
            idx = jnp.zeros((io_len,), idx_dtype)
            return rat(a[0], jnp.zeros(out_shape, a.dtype), idx, idx, idx, idx)[None]
        g = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        return g(jax.device_put(np.zeros((4, 3, 2), np.float32), NamedSharding(mesh, P("x"))))

    with pytest.raises(ValueError, match="multiple of the group size"):
        call(io_len=6)
    with pytest.raises(TypeError, match="integers"):
        call(idx_dtype=np.float32)
    with pytest.raises(ValueError, match="agree"):
        call(out_shape=(6, 3))
