"""MoE dispatch/combine on the CUDA backend: through jax.jit on one GPU (a one-rank
expert-parallel group) against the host backend, and the loopback kernels (R logical
ranks on one GPU) against the host backend's R-device results for the same inputs."""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from jaxcomm._src import cuda_loopback


def routing(R, T, K, E, seed=0):
    ids = cuda_loopback.random_routing(R, T, K, E, seed)
    w = np.random.default_rng(seed + 1).random((R, T, K), dtype=np.float32)
    return ids, w


def tokens(R, T, H, dtype, seed=2):
    x = np.random.default_rng(seed).integers(-4, 5, size=(R, T, H)).astype(np.float32) / 4
    return x.astype(dtype)


def moe_program(padded: bool, E: int, axis: str, capacity=None):
    def f(x, ids, w):
        if padded:
            ex, sizes, h = jaxcomm.moe.dispatch_padded(x, ids, num_experts=E, axis_name=axis,
                                                       capacity=capacity)
            y = jaxcomm.moe.combine_padded(ex, h, w)
            ex = ex.reshape(-1, ex.shape[-1])
        else:
            ex, sizes, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name=axis,
                                               capacity=capacity)
            y = jaxcomm.moe.combine(ex, h, w)
        return ex, sizes, y
    return f


def run_mesh(f, mesh, axis, *args):
    """jit(shard_map(f)) on ``mesh``. On a CPU mesh the program is traced as on a CPU-only
    process, so that it takes the host backend's own (fused) transports."""
    placed = [jax.device_put(a, NamedSharding(mesh, P(axis))) for a in args]
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(axis),) * len(args),
                              out_specs=P(axis), check_vma=False))
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    with mock.patch.object(jax, "default_backend", lambda: "cpu") if on_cpu else contextlib.nullcontext():
        out = jax.tree.map(np.asarray, g(*placed))
        return out, g.lower(*placed).as_text()


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_one_gpu_dispatch_combine_match_host(gpu_mesh, cpu_mesh, padded, dtype):
    T, H, K, E = 24, 16, 3, 8
    ids, w = routing(1, T, K, E)
    x = tokens(1, T, H, dtype)
    f = moe_program(padded, E, "x")
    args = (x.reshape(T, H), ids.reshape(T, K), w.reshape(T, K))
    got, hlo = run_mesh(f, gpu_mesh, "x", *args)
    assert "jaxcomm_moe_transport" in hlo
    host, _ = run_mesh(f, cpu_mesh, "x", *args)
    ex, sizes, y = got
    np.testing.assert_array_equal(np.asarray(ex, np.float32), np.asarray(host[0], np.float32))
    np.testing.assert_array_equal(sizes, host[1])
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(host[2], np.float32),
                               rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6)


def test_one_gpu_gradients_match_host(gpu_mesh, cpu_mesh):
    T, H, K, E = 16, 8, 2, 4
    ids, w = routing(1, T, K, E, seed=5)
    x = tokens(1, T, H, np.float32)

    def grads(x, ids, w):
        def loss(x, w):
            ex, _, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="x")
            y = jaxcomm.moe.combine(jnp.tanh(ex) * 2, h, w)
            return jnp.sum(y * y)
        gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
        return gx, gw

    args = (x.reshape(T, H), ids.reshape(T, K), w.reshape(T, K))
    got, _ = run_mesh(grads, gpu_mesh, "x", *args)
    host, _ = run_mesh(grads, cpu_mesh, "x", *args)
    for g, h in zip(got, host):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-6)


_host_results: dict = {}


@pytest.mark.parametrize("H", [64, 36], ids=["vector", "scalar"])
@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tight", [False, True], ids=["no-drop", "drops"])
@pytest.mark.parametrize("per_rank", [False, True], ids=["fused", "per-rank"])
def test_loopback_matches_host_backend(gpu_mesh, cpu_mesh8, H, padded, dtype, tight, per_rank):
    R, T, K, E = 8, 16, 4, 32
    ids, w = routing(R, T, K, E, seed=11)
    ids[0, 0, :] = -1  # a token with no expert
    ids[1, 2, 1] = 99  # an invalid id: treated as -1 and counted
    x = tokens(R, T, H, dtype)
    cap = cuda_loopback.smallest_capacity(ids, E, padded)
    if tight:
        cap = max(1, cap // 2)
    res = cuda_loopback.run(x, ids, w, num_experts=E, capacity=cap, padded=padded, iters=1,
                            return_expert_x=True, per_rank=per_rank)
    key = (H, padded, np.dtype(dtype).name, tight)
    if key not in _host_results:  # the same for both launch modes: compute once
        f = moe_program(padded, E, "ep", capacity=cap)
        _host_results[key] = run_mesh(f, cpu_mesh8, "ep", x.reshape(R * T, H),
                                      ids.reshape(R * T, K), w.reshape(R * T, K))[0]
    ex, sizes, y = _host_results[key]
    np.testing.assert_array_equal(res["sizes"].reshape(-1), sizes.reshape(-1))
    np.testing.assert_array_equal(res["expert_x"].reshape(-1, H).astype(np.float32),
                                  ex.reshape(-1, H).astype(np.float32))
    # Same float32 operations in the same order as ffi/cpu/moe_kernels.cc: equal up to
    # the host compiler's choices (one bfloat16 ulp at most).
    np.testing.assert_allclose(res["y"].reshape(-1, H).astype(np.float32),
                               y.reshape(-1, H).astype(np.float32),
                               rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6, atol=1e-6)
    assert res["stats"][1, 1] == 1  # the invalid id
    if tight:
        assert res["stats"][:, 0].sum() > 0


def test_loopback_benchmark_small(gpu_mesh):
    r = cuda_loopback.benchmark(R=8, T=64, H=256, K=8, E=64, iters=2)
    assert r["checks"]["sizes_match"] and r["checks"]["combine_ok"]
    assert r["checks"]["dropped"] == 0 and r["checks"]["recv_dropped"] == 0
    assert r["dispatch_ms"] > 0 and r["memcpy_GBps"] > 0
