"""kernels.cu's own kernels, compiled for the host against the SIMT layer, run on the
emulated CUDA runtime through the CUDA backend's loopback (ffi/cuda/loopback.cc: R
logical ranks on one device; routing, dispatch and combine), against the NumPy
references the GPU tests use (tests/gpu/moe_reference.py); and the emulated XLA seam's
scratch allocator under XLA:GPU's contract.

Issue 30's defects, each caught here before its fix (cudafix's branch):
- defect 2: the loopback polls an event (cudaErrorNotReady) and then launches; the
  launcher's cudaGetLastError() reported the poll's NotReady ("device not ready") on the
  first emulated run, before ffi/cuda/event_query.h cleared it;
- defect 1: XLA's scratch allocator refuses alignments above 16; the seam refuses them
  with XLA's message, and accepts what the handlers ask for.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from jaxcomm._src import cuda_loopback
from gpu import moe_reference


@pytest.fixture(scope="module")
def emu():
    from jaxcomm import _jaxcomm_emu
    return _jaxcomm_emu


def _inputs(R, T, K, E, H, dtype, seed=11):
    ids = cuda_loopback.random_routing(R, T, K, E, seed)
    ids[0, 0, :] = -1  # a token with no expert
    ids[1, 2, 1] = 99  # an invalid id: treated as -1 and counted
    w = np.random.default_rng(seed + 1).random((R, T, K), dtype=np.float32)
    x = (np.random.default_rng(seed + 2).integers(-4, 5, size=(R, T, H)).astype(np.float32) / 4).astype(dtype)
    return x, ids, w


# (H, padded, dtype, tight, per_rank): every value of each axis, and each pair of the
# non-dtype axes at least once (the full grid costs 32 emulated runs).
LOOPBACK_CASES = [
    (64, False, np.float32, False, False),
    (64, True, np.float32, True, False),
    (64, False, jnp.bfloat16, True, True),
    (64, True, jnp.bfloat16, False, True),
    (36, False, np.float32, True, False),
    (36, True, jnp.bfloat16, False, False),
    (36, False, jnp.bfloat16, False, True),
    (36, True, np.float32, True, True),
]


@pytest.mark.parametrize(
    "H,padded,dtype,tight,per_rank", LOOPBACK_CASES,
    ids=[f"H{c[0]}-{'padded' if c[1] else 'packed'}-{np.dtype(c[2]).name}-{'drops' if c[3] else 'no-drop'}-"
         f"{'per-rank' if c[4] else 'fused'}" for c in LOOPBACK_CASES])
def test_loopback_kernels_match_numpy(emu, H, padded, dtype, tight, per_rank):
    R, T, K, E = 8, 16, 4, 32
    x, ids, w = _inputs(R, T, K, E, H, dtype)
    cap = cuda_loopback.smallest_capacity(ids, E, padded)
    if tight:
        cap = max(1, cap // 2)
    # iters=1 runs every stage twice, polling its events in between (defect 2).
    res = cuda_loopback.run(x, ids, w, num_experts=E, capacity=cap, padded=padded, iters=1,
                            return_expert_x=True, per_rank=per_rank, module=emu)
    ref = moe_reference.dispatch(x.astype(np.float32), ids, E, cap, padded)
    np.testing.assert_array_equal(res["sizes"], ref.sizes)
    np.testing.assert_array_equal(res["expert_x"].astype(np.float32), ref.expert_x)
    np.testing.assert_array_equal(res["stats"][:, 0], ref.dropped)
    np.testing.assert_array_equal(res["stats"][:, 1], ref.invalid)
    np.testing.assert_array_equal(res["stats"][:, 2], ref.recv_dropped)
    want = moe_reference.combine(ref.expert_x, ref, w)
    np.testing.assert_allclose(res["y"].astype(np.float32), want,
                               rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6, atol=1e-6)
    if tight:
        assert res["stats"][:, 0].sum() > 0
    assert emu.emu_strict_violations() == []
    assert emu.emu_sticky_error() == ""


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_loopback_low_latency_writes_only_arriving_rows(emu, fp8):
    R, T, K, E, H = 4, 8, 2, 8, 128
    x, ids, w = _inputs(R, T, K, E, H, jnp.bfloat16, seed=5)
    cap = cuda_loopback.smallest_capacity(ids, E, True)
    res = cuda_loopback.run(x, ids, w, num_experts=E, capacity=cap, padded=True, iters=1,
                            return_expert_x=True, low_latency=True, fp8=fp8, module=emu)
    ref = moe_reference.dispatch(x.astype(np.float32), ids, E, cap, True)
    np.testing.assert_array_equal(res["sizes"], ref.sizes)
    got = res["expert_x"].astype(np.float32)
    El = E // R
    for r in range(R):
        for e in range(El):
            n = int(ref.sizes[r, e])
            rows = slice(e * cap, e * cap + n)
            if fp8:  # quantized per 128 channels: within the FP8 format's rounding
                np.testing.assert_allclose(got[r, rows], ref.expert_x[r, rows], rtol=0.07, atol=1e-2)
            else:
                np.testing.assert_array_equal(got[r, rows], ref.expert_x[r, rows])
            # Rows past the count keep the loopback's 0x7F fill (bfloat16 0x7F7F).
            untouched = res["expert_x"][r, e * cap + n:(e + 1) * cap].view(np.uint16)
            assert (untouched == 0x7F7F).all()
    assert emu.emu_strict_violations() == []


def test_scratch_alignment_follows_xla_gpu(emu):
    error, address = emu.emu_scratch_probe(4096)  # what the handlers ask for
    assert error == "" and address % 16 == 0
    for bad in (32, 256, 24):
        error, address = emu.emu_scratch_probe(4096, bad)
        assert address == 0
        assert error == (f"XLA's scratch allocator refused 4096 bytes at alignment {bad}: "
                         f"INVALID_ARGUMENT: Unsupported alignment: {bad}")
