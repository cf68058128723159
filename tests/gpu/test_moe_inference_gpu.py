"""jaxcomm.moe's inference features on the CUDA backend against NumPy references
(tests/moe_reference.py): the FP8 quantize kernel, the dequantizing gathers, the
low-latency layout (rows past the counts never written), the half precision combine
(float32 sums in the kernel's order, rounded once) and the split-phase halves (their
movement on jaxcomm's stream), through jax.jit on one GPU (a one-rank group) and in the
loopback (R logical ranks on one GPU). Skipped without a GPU (see conftest.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from jaxcomm._src import cuda_loopback
from jaxcomm._src.moe import fp8 as fp8_format
from moe_reference import np_combine_f32, np_dequantize_fp8, np_dispatch, np_quantize_fp8

HALF = [jnp.bfloat16, np.float16]


def _tokens(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape) * np.exp(rng.normal(size=shape[:-1] + (1,)) * 2)
    return x.astype(dtype)


def _routing(R, T, K, E, seed):
    ids = cuda_loopback.random_routing(R, T, K, E, seed)
    ids[0, 0, :] = -1  # a token with no expert
    w = np.random.default_rng(seed + 1).random((R, T, K), dtype=np.float32)
    return ids, w


def _ll_valid(ex, counts):
    """Rows of a low-latency expert_x [R, El, S, H] below each expert's count, zeros elsewhere."""
    rows = np.arange(ex.shape[2])[None, None, :, None]
    return np.where(rows < counts[:, :, None, None], ex, 0)


def _on_gpu(f, mesh, *args):
    placed = [jax.device_put(a, NamedSharding(mesh, P("x"))) for a in args]
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * len(args), out_specs=P("x"),
                              check_vma=False))
    return jax.tree.map(np.asarray, g(*placed)), g.lower(*placed).as_text()


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("H", [7168, 300], ids=["full-blocks", "partial-block"])
def test_fp8_quantize_kernel_matches_numpy(gpu_mesh, dtype, H):
    x = _tokens((33, H), dtype, seed=H)
    x[1, :128] = 0  # an all-zero block: the minimum amax
    f = jax.jit(fp8_format.quantize_rows)
    q, s = f(jax.device_put(x, jax.devices("gpu")[0]))
    assert "jaxcomm_moe_fp8_quantize" in f.lower(x).as_text()
    want_q, want_s = np_quantize_fp8(x.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s), want_s)


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("fp8", [None, "dequantize"], ids=["no-fp8", "fp8"])
@pytest.mark.parametrize("dtype", [np.float32, *HALF], ids=["f32", "bf16", "f16"])
def test_one_gpu_low_latency_fp8_half_combine_split_match_numpy(gpu_mesh, dtype, fp8, split):
    T, H, K, E, MAX = 24, 256, 3, 8, 32
    ids, w = _routing(1, T, K, E, seed=21)
    x = _tokens((1, T, H), dtype, seed=22)

    def f(x, ids, w):
        kw = dict(num_experts=E, axis_name="x", max_tokens=MAX, fp8=fp8)
        if split:
            ex, counts, h = jaxcomm.moe.dispatch_recv(jaxcomm.moe.dispatch_send(x, ids, layout="low_latency", **kw))
            y = jaxcomm.moe.combine_recv(jaxcomm.moe.combine_send(ex * 2, h, w))
        else:
            ex, counts, h = jaxcomm.moe.dispatch_low_latency(x, ids, **kw)
            y = jaxcomm.moe.combine_low_latency(ex * 2, h, w)
        return ex[None], counts[None], y[None]

    (ex, counts, y), hlo = _on_gpu(f, gpu_mesh, x[0], ids[0], w[0])
    assert ("jaxcomm_moe_transport_send" in hlo) == split
    if fp8:
        assert "jaxcomm_moe_fp8_quantize" in hlo
    delivered = x if fp8 is None else np_dequantize_fp8(*np_quantize_fp8(x.astype(np.float32)), dtype)
    want_ex, sizes, row_of, _ = np_dispatch(delivered, ids, E, padded=True, slab=MAX)
    np.testing.assert_array_equal(counts, sizes)
    np.testing.assert_array_equal(_ll_valid(ex.astype(np.float32), counts), want_ex.astype(np.float32))
    ey = (want_ex.astype(np.float32) * 2).astype(dtype)  # exact: doubling
    np.testing.assert_array_equal(y.astype(np.float32),
                                  np_combine_f32(ey, row_of, w, T, H, dtype).astype(np.float32))


def test_one_gpu_fp8_raw_and_packed_dequantize_match_numpy(gpu_mesh):
    T, H, K, E = 20, 300, 2, 4
    ids, w = _routing(1, T, K, E, seed=31)
    x = _tokens((1, T, H), jnp.bfloat16, seed=32)

    def f(x, ids):
        (q, s), _, _ = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="x", fp8="raw")
        ex, _, _ = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="x", fp8="dequantize")
        return q.view(jnp.uint8)[None], s[None], ex[None]

    (q, s, ex), _ = _on_gpu(f, gpu_mesh, x[0], ids[0])
    ref_q, ref_s = np_quantize_fp8(x.astype(np.float32))
    want_q, _, _, _ = np_dispatch(ref_q.view(np.uint8), ids, E)
    want_s, _, _, _ = np_dispatch(ref_s, ids, E)
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(s, want_s)
    # The packed layout: zeros past the arriving rows.
    np.testing.assert_array_equal(ex, np_dequantize_fp8(want_q.view(ml_dtypes.float8_e4m3fn), want_s, jnp.bfloat16))


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "f16"])
def test_one_gpu_half_combine_gradients_match_numpy(gpu_mesh, dtype):
    """combine's gradients in half precision (GATHER_SCALED and DOT on half operands)."""
    T, H, K, E = 16, 64, 2, 4
    ids, w = _routing(1, T, K, E, seed=41)
    x = _tokens((1, T, H), dtype, seed=42)
    ct = _tokens((1, T, H), dtype, seed=43)

    def f(x, ids, w, ct):
        ex, _, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="x")
        g_ey, g_w = jax.grad(lambda ey, w: jnp.sum((jaxcomm.moe.combine(ey, h, w) * ct).astype(jnp.float32)),
                             argnums=(0, 1))(ex, w)
        return g_ey[None], g_w[None]

    (g_ey, g_w), _ = _on_gpu(f, gpu_mesh, x[0], ids[0], w[0], ct[0])
    want_ex, _, row_of, _ = np_dispatch(x, ids, E)
    want_gey = np.zeros(want_ex.shape, np.float32)
    want_gw = np.zeros(w.shape, np.float32)
    for (s, t, k), (d, row) in row_of.items():
        want_gey[d, row] = (np.float32(w[s, t, k]) * ct[s, t].astype(np.float32)).astype(dtype).astype(np.float32)
        want_gw[s, t, k] = np.dot(ct[s, t].astype(np.float64), want_ex[d, row].astype(np.float64))
    np.testing.assert_array_equal(g_ey.astype(np.float32), want_gey)
    np.testing.assert_allclose(g_w, want_gw, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("per_rank", [False, True], ids=["fused", "per-rank"])
@pytest.mark.parametrize("fp8", [False, True], ids=["no-fp8", "fp8"])
@pytest.mark.parametrize("dtype", [np.float32, *HALF], ids=["f32", "bf16", "f16"])
def test_loopback_low_latency_fp8_half_match_numpy(gpu_mesh, dtype, fp8, per_rank):
    R, T, K, E, H = 8, 16, 4, 32, 200
    ids, w = _routing(R, T, K, E, seed=51)
    x = _tokens((R, T, H), dtype, seed=52)
    res = cuda_loopback.run(x, ids, w, num_experts=E, capacity=R * T, padded=True, iters=1,
                            return_expert_x=True, per_rank=per_rank, low_latency=True, fp8=fp8)
    delivered = x if not fp8 else np_dequantize_fp8(*np_quantize_fp8(x.astype(np.float32)), dtype)
    want_ex, sizes, row_of, _ = np_dispatch(delivered, ids, E, padded=True, slab=R * T)
    np.testing.assert_array_equal(res["sizes"], sizes)
    ex = res["expert_x"].reshape(want_ex.shape)
    np.testing.assert_array_equal(_ll_valid(ex.astype(np.float32), sizes), want_ex.astype(np.float32))
    # Rows past the counts were never written: they keep the loopback's 0x7F fill.
    rows = np.arange(want_ex.shape[2])[None, None, :]
    past = ex.view(np.uint8).reshape(want_ex.shape[:3] + (-1,))[rows >= sizes[:, :, None]]
    assert past.size and (past == 0x7F).all()
    np.testing.assert_array_equal(res["y"].astype(np.float32),
                                  np_combine_f32(want_ex.astype(dtype), row_of, w, T, H, dtype).astype(np.float32))
