"""Every jaxcomm op through jax.jit on one GPU, against jax.lax on that GPU and against
the host backend's single-device group. Skipped without a GPU (see conftest.py)."""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from jaxcomm._src import cuda_runtime

DTYPES = [np.float32, jnp.bfloat16, np.int32]


def run(f, mesh, *args):
    """jit(shard_map(f)) over axis "x" of ``mesh``, every arg split on its first dim; on a
    CPU mesh traced as in a CPU-only process (the host backend's own paths)."""
    placed = [jax.device_put(a, NamedSharding(mesh, P("x"))) for a in args]
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * len(args), out_specs=P("x"),
                              check_vma=False))
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    with mock.patch.object(jax, "default_backend", lambda: "cpu") if on_cpu else contextlib.nullcontext():
        return jax.tree.map(np.asarray, g(*placed)), g.lower(*placed).as_text()


def data(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(-8, 8, size=shape)).astype(dtype)


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
def test_op_matches_lax_and_host_backend(gpu_mesh, cpu_mesh, name, dtype):
    ours, theirs = OPS[name]
    x = data((1, 6, 4, 3), dtype)
    got, hlo = run(ours, gpu_mesh, x)
    assert "jaxcomm_" in hlo, "the op lowered to jax.lax instead of jaxcomm's CUDA handler"
    want, _ = run(theirs, gpu_mesh, x)
    host, _ = run(ours, cpu_mesh, x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, host)


def test_gradients_match_host_backend(gpu_mesh, cpu_mesh):
    def loss(v):
        y = jaxcomm.all_gather(jaxcomm.all_reduce(v * v, "x"), "x", tiled=True)
        return jnp.sum(jaxcomm.ppermute(y, "x", [(0, 0)]) ** 2)

    x = data((1, 8), np.float32)
    got, _ = run(jax.grad(loss), gpu_mesh, x)
    host, _ = run(jax.grad(loss), cpu_mesh, x)
    np.testing.assert_allclose(got, host, rtol=1e-6)


def test_donated_all_reduce_in_place(gpu_mesh):
    x = jax.device_put(data((1, 1024), np.float32), NamedSharding(gpu_mesh, P("x")))
    f = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, "x"), mesh=gpu_mesh,
                              in_specs=P("x"), out_specs=P("x"), check_vma=False),
                donate_argnums=0)
    want = np.asarray(x)
    np.testing.assert_array_equal(np.asarray(f(x)), want)


def _ragged_args():
    operand = jnp.arange(12.0).reshape(6, 2)
    output = jnp.full((8, 2), -1.0)
    io = jnp.array([0, 2, 3], jnp.int32)
    ss = jnp.array([2, 0, 3], jnp.int32)
    oo = jnp.array([4, 4, 0], jnp.int32)
    return operand[None], output[None], io[None], ss[None], oo[None], ss[None]


def test_ragged_all_to_all_matches_lax_and_host(gpu_mesh, cpu_mesh):
    def ours(op, out, io, ss, oo, rs):
        return jaxcomm.ragged_all_to_all(op[0], out[0], io[0], ss[0], oo[0], rs[0], axis_name="x")[None]

    def theirs(op, out, io, ss, oo, rs):
        return jax.lax.ragged_all_to_all(op[0], out[0], io[0], ss[0], oo[0], rs[0], axis_name="x")[None]

    args = _ragged_args()
    got, hlo = run(ours, gpu_mesh, *args)
    assert "jaxcomm_ragged_all_to_all" in hlo
    np.testing.assert_array_equal(got, run(theirs, gpu_mesh, *args)[0])
    np.testing.assert_array_equal(got, run(ours, cpu_mesh, *args)[0])


def test_ragged_all_to_all_gradient_matches_host(gpu_mesh, cpu_mesh):
    def grads(op, out, io, ss, oo, rs):
        def loss(a, b):
            y = jaxcomm.ragged_all_to_all(a, b, io[0], ss[0], oo[0], rs[0], axis_name="x")
            return jnp.sum(y * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))
        ga, gb = jax.grad(loss, argnums=(0, 1))(op[0], out[0])
        return jnp.concatenate([ga, gb])[None]

    args = _ragged_args()
    np.testing.assert_array_equal(run(grads, gpu_mesh, *args)[0], run(grads, cpu_mesh, *args)[0])


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
        from jaxcomm import _jaxcomm
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
    assert comms and all(c["size"] == 1 for c in comms)
    assert all(c["create_ms"] >= 0 for c in comms)
