"""MoE dispatch/combine on the CUDA backend against NumPy references (moe_reference.py):
through jax.jit on one GPU (a one-rank expert-parallel group), and the loopback kernels
(R logical ranks on one GPU). Skipped without a GPU (see conftest.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from jaxcomm._src import cuda_loopback

from gpu import moe_reference


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
            y = jaxcomm.moe.combine_padded(ex * 2, h, w)
            ex = ex.reshape(-1, ex.shape[-1])
        else:
            ex, sizes, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name=axis, capacity=capacity)
            y = jaxcomm.moe.combine(ex * 2, h, w)
        return ex, sizes, y
    return f


def run_mesh(f, mesh, axis, *args):
    placed = [jax.device_put(a, NamedSharding(mesh, P(axis))) for a in args]
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(axis),) * len(args),
                              out_specs=P(axis), check_vma=False))
    return jax.tree.map(np.asarray, g(*placed)), g.lower(*placed).as_text()


@pytest.mark.parametrize("capacity", [None, 20], ids=["no-drop", "drops"])
@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_one_gpu_dispatch_combine_match_numpy(gpu_mesh, padded, dtype, capacity):
    T, H, K, E = 24, 16, 3, 8
    cap = None if capacity is None else (4 if padded else capacity)
    ids, w = routing(1, T, K, E)
    ids[0, 1, 2] = 99  # an invalid id: treated as -1
    x = tokens(1, T, H, dtype)
    (ex, sizes, y), hlo = run_mesh(moe_program(padded, E, "x", cap), gpu_mesh, "x",
                                   x.reshape(T, H), ids.reshape(T, K), w.reshape(T, K))
    assert "jaxcomm_moe_transport" in hlo
    ref = moe_reference.dispatch(x.astype(np.float32), ids, E, cap, padded)
    np.testing.assert_array_equal(np.asarray(ex, np.float32), ref.expert_x[0])
    np.testing.assert_array_equal(sizes, ref.sizes[0])
    want = moe_reference.combine(2 * ref.expert_x, ref, w)[0]
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6)
    if capacity is not None:
        assert ref.dropped.sum() > 0


def test_one_gpu_gradients_match_numpy(gpu_mesh):
    T, H, K, E = 16, 8, 2, 4
    ids, w = routing(1, T, K, E, seed=5)
    x = tokens(1, T, H, np.float32)

    def grads(x, ids, w):
        def loss(x, w):
            ex, _, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="x")
            y = jaxcomm.moe.combine(jnp.tanh(ex) * 2, h, w)
            return jnp.sum(y * y)
        return jax.grad(loss, argnums=(0, 1))(x, w)

    (gx, gw), _ = run_mesh(grads, gpu_mesh, "x", x.reshape(T, H), ids.reshape(T, K), w.reshape(T, K))
    # One rank, nothing dropped: y[t] = s[t] * 2 tanh(x[t]) with s[t] = sum_k w[t, k].
    x2, w2 = x.reshape(T, H).astype(np.float64), w.reshape(T, K).astype(np.float64)
    s = w2.sum(1, keepdims=True)
    y = s * 2 * np.tanh(x2)
    np.testing.assert_allclose(gx, 2 * y * s * 2 * (1 - np.tanh(x2) ** 2), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw, np.repeat((2 * y * 2 * np.tanh(x2)).sum(1, keepdims=True), K, 1),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("H", [64, 36], ids=["vector", "scalar"])
@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tight", [False, True], ids=["no-drop", "drops"])
@pytest.mark.parametrize("per_rank", [False, True], ids=["fused", "per-rank"])
def test_loopback_matches_numpy(gpu_mesh, H, padded, dtype, tight, per_rank):
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
    ref = moe_reference.dispatch(x.astype(np.float32), ids, E, cap, padded)
    np.testing.assert_array_equal(res["sizes"], ref.sizes)
    np.testing.assert_array_equal(res["expert_x"].astype(np.float32), ref.expert_x)
    np.testing.assert_array_equal(res["stats"][:, 0], ref.dropped)
    np.testing.assert_array_equal(res["stats"][:, 1], ref.invalid)
    np.testing.assert_array_equal(res["stats"][:, 2], ref.recv_dropped)
    want = moe_reference.combine(ref.expert_x, ref, w)  # identity experts
    np.testing.assert_allclose(res["y"].astype(np.float32), want,
                               rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6, atol=1e-6)
    assert res["stats"][1, 1] == 1
    if tight:
        assert res["stats"][:, 0].sum() > 0


def test_loopback_benchmark_small(gpu_mesh):
    r = cuda_loopback.benchmark(R=8, T=64, H=256, K=8, E=64, iters=2)
    assert r["checks"]["sizes_match"] and r["checks"]["combine_ok"]
    assert r["checks"]["dropped"] == 0 and r["checks"]["recv_dropped"] == 0
    assert r["dispatch_ms"] > 0 and r["memcpy_GBps"] > 0
