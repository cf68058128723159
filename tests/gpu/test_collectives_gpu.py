"""Every jaxcomm op through jax.jit on one GPU, against jax.lax on that GPU and NumPy.
Skipped without a GPU (see conftest.py)."""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from jaxcomm import _jaxcomm
from jaxcomm._src import cuda_runtime

from gpu import moe_reference

DTYPES = [np.float32, jnp.bfloat16, np.int32]


def run(f, mesh, *args):
    """jit(shard_map(f)) over axis "x" of ``mesh``, every arg split on its first dim."""
    placed = [jax.device_put(a, NamedSharding(mesh, P("x"))) for a in args]
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * len(args), out_specs=P("x"),
                              check_vma=False))
    return jax.tree.map(np.asarray, g(*placed)), g.lower(*placed).as_text()


def data(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(-8, 8, size=shape)).astype(dtype)


# On one rank every op returns its operand (a copy, or NCCL with JAXCOMM_CUDA_ONE_RANK).
OPS = {
    "all_reduce_sum": (lambda v: jaxcomm.all_reduce(v, "x"), lambda v: jax.lax.psum(v, "x")),
    "all_reduce_max": (lambda v: jaxcomm.all_reduce(v, "x", op="max"), lambda v: jax.lax.pmax(v, "x")),
    "all_gather": (lambda v: jaxcomm.all_gather(v, "x", axis=1, tiled=True),
                   lambda v: jax.lax.all_gather(v, "x", axis=1, tiled=True)),
    "reduce_scatter": (lambda v: jaxcomm.reduce_scatter(v, "x", scatter_dimension=1, tiled=True),
                       lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=1, tiled=True)),
    "all_to_all": (lambda v: jaxcomm.all_to_all(v, "x", 1, 2, tiled=True),
                   lambda v: jax.lax.all_to_all(v, "x", 1, 2, tiled=True)),
    "ppermute": (lambda v: jaxcomm.ppermute(v, "x", [(0, 0)]),
                 lambda v: jax.lax.ppermute(v, "x", [(0, 0)])),
    "broadcast": (lambda v: jaxcomm.broadcast(v, "x", root=0), lambda v: v),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", sorted(OPS))
def test_op_matches_lax_and_numpy(gpu_mesh, name, dtype):
    ours, theirs = OPS[name]
    x = data((1, 6, 4, 3), dtype)
    got, hlo = run(ours, gpu_mesh, x)
    assert "jaxcomm_" in hlo, "the op lowered to jax.lax instead of jaxcomm's CUDA handler"
    np.testing.assert_array_equal(got, run(theirs, gpu_mesh, x)[0])
    np.testing.assert_array_equal(got, np.asarray(x))


def test_gradients_match_lax(gpu_mesh):
    def loss(ar, ag, pp):
        def f(v):
            y = ag(ar(v * v, "x"), "x", tiled=True)
            return jnp.sum(pp(y, "x", [(0, 0)]) ** 2)
        return f

    x = data((1, 8), np.float32)
    got, _ = run(jax.grad(loss(jaxcomm.all_reduce, jaxcomm.all_gather, jaxcomm.ppermute)), gpu_mesh, x)
    want, _ = run(jax.grad(loss(jax.lax.psum, jax.lax.all_gather, jax.lax.ppermute)), gpu_mesh, x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got, 4 * np.asarray(x) ** 3, rtol=1e-6)  # d/dx sum(x^4)


def test_donated_all_reduce_in_place(gpu_mesh):
    x = jax.device_put(data((1, 1024), np.float32), NamedSharding(gpu_mesh, P("x")))
    want = np.asarray(x)
    f = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, "x"), mesh=gpu_mesh,
                              in_specs=P("x"), out_specs=P("x"), check_vma=False),
                donate_argnums=0)
    np.testing.assert_array_equal(np.asarray(f(x)), want)


def _ragged_args():
    operand = jnp.arange(12.0).reshape(6, 2)
    output = jnp.full((8, 2), -1.0)
    io = jnp.array([0, 2, 3], jnp.int32)
    ss = jnp.array([2, 0, 3], jnp.int32)
    oo = jnp.array([4, 4, 0], jnp.int32)
    return operand[None], output[None], io[None], ss[None], oo[None], ss[None]


def test_ragged_all_to_all_matches_lax_and_numpy(gpu_mesh):
    def ours(op, out, io, ss, oo, rs):
        return jaxcomm.ragged_all_to_all(op[0], out[0], io[0], ss[0], oo[0], rs[0], axis_name="x")[None]

    def theirs(op, out, io, ss, oo, rs):
        return jax.lax.ragged_all_to_all(op[0], out[0], io[0], ss[0], oo[0], rs[0], axis_name="x")[None]

    args = _ragged_args()
    got, hlo = run(ours, gpu_mesh, *args)
    assert "jaxcomm_ragged_all_to_all" in hlo
    np.testing.assert_array_equal(got, run(theirs, gpu_mesh, *args)[0])
    a = [np.asarray(v[0]) for v in args]
    np.testing.assert_array_equal(got[0], moe_reference.ragged_all_to_all(a[0], a[1], a[2], a[3], a[4]))


def test_ragged_all_to_all_gradient_matches_numpy(gpu_mesh):
    def grads(op, out, io, ss, oo, rs):
        def loss(a, b):
            y = jaxcomm.ragged_all_to_all(a, b, io[0], ss[0], oo[0], rs[0], axis_name="x")
            return jnp.sum(y * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))
        ga, gb = jax.grad(loss, argnums=(0, 1))(op[0], out[0])
        return jnp.concatenate([ga, gb])[None]

    args = _ragged_args()
    got = run(grads, gpu_mesh, *args)[0][0]
    # Output rows 4..5 come from operand rows 0..1, rows 0..2 from operand rows 3..5.
    ct = np.arange(16.0).reshape(8, 2)
    want_op = np.zeros((6, 2))
    want_op[0:2] = ct[4:6]
    want_op[3:6] = ct[0:3]
    want_out = ct.copy()
    want_out[[0, 1, 2, 4, 5]] = 0
    np.testing.assert_array_equal(got, np.concatenate([want_op, want_out]))


def test_ragged_out_of_bounds_writes_nothing(gpu_mesh):
    # On CUDA the offsets stay on the device: a bad call writes nothing (no host check).
    def ours(op, out, io, ss, oo, rs):
        return jaxcomm.ragged_all_to_all(op[0], out[0], io[0], ss[0], oo[0], rs[0], axis_name="x")[None]

    operand, output, io, ss, oo, rs = _ragged_args()
    bad_oo = oo.at[0, 0].set(7)  # rows 7..8 of an 8-row output
    got, _ = run(ours, gpu_mesh, operand, output, io, ss, bad_oo, rs)
    np.testing.assert_array_equal(got, np.asarray(output))


def test_one_rank_group_through_nccl(gpu_mesh, monkeypatch):
    """JAXCOMM_CUDA_ONE_RANK=nccl sends one-rank groups through NCCL (read per executable)."""
    try:
        path = cuda_runtime.nccl_library_path()
        if path:
            _jaxcomm.cuda_set_nccl_path(path)
        _jaxcomm.cuda_nccl_version()
    except RuntimeError as e:
        pytest.skip(f"NCCL not loadable: {e}")
    monkeypatch.setenv("JAXCOMM_CUDA_ONE_RANK", "nccl")
    x = data((1, 5, 4), np.float32, seed=7)
    for name, (ours, theirs) in sorted(OPS.items()):
        fresh = lambda v, ours=ours: ours(v) + 0  # a new program: instantiated afresh
        got, _ = run(fresh, gpu_mesh, x)
        np.testing.assert_array_equal(got, run(theirs, gpu_mesh, x)[0], err_msg=name)
    comms = cuda_runtime.communicators()
    assert comms and all(c["size"] == 1 and c["failure"] == "" for c in comms)
    assert all(c["create_ms"] >= 0 for c in comms)


def test_flight_recorder_records_cuda_calls(gpu_mesh):
    if not _jaxcomm.trace_enabled():
        pytest.skip("the flight recorder is off (JAXCOMM_TRACE_ENTRIES=0)")
    x = data((1, 64), np.float32, seed=3)
    f = lambda v: jaxcomm.all_gather(jaxcomm.all_reduce(v, "x") * 3, "x", tiled=True)
    got, _ = run(f, gpu_mesh, x)
    np.testing.assert_array_equal(got, 3 * np.asarray(x))
    deadline = time.monotonic() + 5
    while _jaxcomm.cuda_watched_calls() and time.monotonic() < deadline:
        time.sleep(0.01)  # the watcher marks calls done from their events
    dump = json.loads(_jaxcomm.trace_json("test"))
    mine = [e for e in dump["entries"] if e.get("op") in ("all_reduce", "all_gather")
            and "test_collectives_gpu.py" in e.get("call_site", "")]
    assert {e["op"] for e in mine} == {"all_reduce", "all_gather"}, dump["entries"][-4:]
    assert all(e["state"] == "done" and e["algorithm"] == "cuda copy" for e in mine), mine
    assert all(e["execution"] >= 1 and e["bytes"] == 256 for e in mine), mine
