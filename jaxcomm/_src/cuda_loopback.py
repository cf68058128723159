"""Loopback mode of the CUDA MoE kernels: R logical ranks on one GPU, outside XLA.

JAX sees one device on a one-GPU machine, so expert-parallel dispatch/combine over R
ranks cannot run through ``jax.jit`` there. The extension's ``cuda_moe_loopback`` runs
jaxcomm's routing, dispatch and combine kernels for R ranks whose "peer" buffers are
regions of one device's memory (ffi/cuda/loopback.h); this module feeds it, checks it
against the host backend's semantics and measures it:

    python -m jaxcomm._src.cuda_loopback --ranks 8 --tokens 4096 --hidden 7168 \\
        --topk 8 --experts 256 --dtype bfloat16 --json out.json

Bytes are counted as DeepEP does: one token row per (token, destination rank) pair that
keeps an assignment; the yardstick is a device-to-device copy measured in the same run
(counting what it reads plus what it writes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

#: Loopback ranks per launch (kMaxPeers in ffi/cuda/kernels.h).
MAX_RANKS = 16


def _bf16() -> Any:
    import ml_dtypes  # a jax dependency
    return np.dtype(ml_dtypes.bfloat16)


def random_routing(R: int, T: int, K: int, E: int, seed: int = 0) -> np.ndarray:
    """[R, T, K] int32: K distinct experts per token, uniformly at random (top-k-like)."""
    rng = np.random.default_rng(seed)
    scores = rng.random((R * T, E), dtype=np.float32)
    ids = np.argpartition(scores, -K, axis=1)[:, -K:]
    return ids.reshape(R, T, K).astype(np.int32)


def expert_totals(ids: np.ndarray, E: int) -> np.ndarray:
    """[E] rows each expert receives from all ranks (ids outside [0, E) ignored)."""
    flat = ids.reshape(-1)
    flat = flat[(flat >= 0) & (flat < E)]
    return np.bincount(flat, minlength=E).astype(np.int64)


def smallest_capacity(ids: np.ndarray, E: int, padded: bool) -> int:
    """The smallest capacity that drops nothing: rows per rank (packed) or per expert (padded)."""
    R = ids.shape[0]
    total = expert_totals(ids, E)
    if padded:
        return max(1, int(total.max()))
    return max(1, int(total.reshape(R, E // R).sum(axis=1).max()))


def run(x: np.ndarray, ids: np.ndarray, w: np.ndarray, *, num_experts: int, capacity: int,
        padded: bool = False, iters: int = 10, return_expert_x: bool = False,
        device: int = 0, per_rank: bool = False, low_latency: bool = False,
        fp8: bool = False, module: Any = None) -> dict[str, Any]:
    """Runs routing, dispatch and combine (identity experts) for R ranks on one GPU.

    Args:
      x: [R, T, H] bfloat16, float16 or float32 tokens of every rank.
      ids: [R, T, K] expert ids (-1: none). w: [R, T, K] combine weights.
      capacity: rows per rank (packed layout) or per expert slab (padded layout).
      per_rank: launch each rank's part separately, reading the others' buffers in place,
        as the multi-GPU path does (one launch for all ranks otherwise).
      low_latency: DeepEP's decode layout (``padded`` required): the dispatch writes only
        the arriving rows; every other row of expert_x keeps the 0x7F bytes the loopback
        fills it with first.
      fp8: the dispatch quantizes the tokens to jaxcomm's FP8 format, moves codes and
        scales, and dequantizes into x's dtype (expert_x holds the dequantized rows).
      module: the extension that runs it (default jaxcomm._jaxcomm; the CPU emulation of
        the CUDA backend: jaxcomm._jaxcomm_emu).

    Returns:
      y [R, T, H] (combine of the dispatched rows), sizes [R, E/R], stats [R, 3] (dropped,
      invalid, recv_dropped), dest/pos [R, T, K], expert_x [R, rows, H] when asked, and
      the median times (ms) of plan, dispatch, combine and a device-to-device copy.
    """
    from jaxcomm import _jaxcomm
    if module is None and not getattr(_jaxcomm, "has_cuda", lambda: False)():
        raise RuntimeError("jaxcomm was built without the CUDA backend")
    module = module or _jaxcomm
    R, T, H = x.shape
    K = ids.shape[2]
    bf16, f16 = x.dtype == _bf16(), x.dtype == np.float16
    if not (bf16 or f16) and x.dtype != np.float32:
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if low_latency and not padded:
        raise ValueError("the low-latency layout is padded")
    if R > MAX_RANKS:
        raise ValueError(f"at most {MAX_RANKS} loopback ranks, got {R}")
    res = dict(module.cuda_moe_loopback(
        np.ascontiguousarray(x).tobytes(), np.ascontiguousarray(ids, np.int32).tobytes(),
        np.ascontiguousarray(w, np.float32).tobytes(), R, T, H, K, num_experts, capacity,
        padded, bf16, iters, return_expert_x, device, per_rank, f16, low_latency, fp8))
    rows = int(res["rows"])
    res["y"] = np.frombuffer(res["y"], x.dtype).reshape(R, T, H)
    res["sizes"] = np.frombuffer(res["sizes"], np.int32).reshape(R, num_experts // R)
    res["stats"] = np.frombuffer(res["stats"], np.int32).reshape(R, 3)
    res["dest"] = np.frombuffer(res["dest"], np.int32).reshape(R, T, K)
    res["pos"] = np.frombuffer(res["pos"], np.int32).reshape(R, T, K)
    res["expert_x"] = (np.frombuffer(res["expert_x"], x.dtype).reshape(R, rows, H)
                       if return_expert_x else None)
    return res


def reference_y(x: np.ndarray, dest: np.ndarray, w: np.ndarray) -> np.ndarray:
    """combine(dispatch(x)) with identity experts: x * (sum of kept weights), float32."""
    kept = np.where(dest >= 0, w, 0.0).astype(np.float32).sum(axis=-1, keepdims=True)
    return x.astype(np.float32) * kept


def benchmark(R: int = 8, T: int = 4096, H: int = 7168, K: int = 8, E: int = 256,
              dtype: str = "bfloat16", padded: bool = False, iters: int = 10,
              seed: int = 0, check_tokens: int = 64, low_latency: bool = False,
              fp8: bool = False, module: Any = None) -> dict[str, Any]:
    """Loopback dispatch/combine at the smallest capacity that drops nothing (low latency:
    DeepEP's decode layout, R*T rows per expert), with checks.

    Returns a JSON-ready dict: the configuration, median times, DeepEP-counted bytes and
    GB/s, the device-to-device copy's GB/s, whether each stage reaches half of it (the
    issue's target), and the checks (per-expert sizes against a NumPy count, nothing
    dropped, combine of ``check_tokens`` tokens per rank against NumPy).
    """
    t0 = time.perf_counter()
    ids = random_routing(R, T, K, E, seed)
    rng = np.random.default_rng(seed + 1)
    w = rng.random((R, T, K), dtype=np.float32)
    if dtype == "bfloat16":
        # Finite bfloat16 values in [1, 2) x powers of two around 1, made from bits (fast).
        bits = rng.integers(0x3E00, 0x4080, size=(R, T, H), dtype=np.uint16)
        x = bits.view(_bf16())
    else:
        x = rng.standard_normal((R, T, H), dtype=np.float32).astype(dtype)
    padded = padded or low_latency
    capacity = R * T if low_latency else smallest_capacity(ids, E, padded)
    prep_s = time.perf_counter() - t0
    res = run(x, ids, w, num_experts=E, capacity=capacity, padded=padded, iters=iters,
              low_latency=low_latency, fp8=fp8)
    item = x.dtype.itemsize
    # The combine moves x's dtype; an FP8 dispatch moves codes and one scale per 128.
    counted = int(res["pairs"]) * H * item
    dispatched = int(res["pairs"]) * (H + 4 * -(-H // 128)) if fp8 else counted
    copy_gbps = res["memcpy_bytes"] / (res["memcpy_ms"] * 1e6)
    out: dict[str, Any] = dict(
        ranks=R, tokens=T, hidden=H, topk=K, experts=E, dtype=dtype, fp8=fp8,
        layout="low_latency" if low_latency else "padded" if padded else "packed", capacity=capacity,
        rows_per_rank=int(res["rows"]), pairs=int(res["pairs"]), bytes_deepep=counted,
        dispatch_bytes_deepep=dispatched,
        plan_ms=res["plan_ms"], dispatch_ms=res["dispatch_ms"], combine_ms=res["combine_ms"],
        memcpy_ms=res["memcpy_ms"], memcpy_GBps=copy_gbps,
        dispatch_GBps=dispatched / (res["dispatch_ms"] * 1e6),
        combine_GBps=counted / (res["combine_ms"] * 1e6),
    )
    out["dispatch_vs_half_copy"] = out["dispatch_GBps"] / (0.5 * copy_gbps)
    out["combine_vs_half_copy"] = out["combine_GBps"] / (0.5 * copy_gbps)
    out["target_met"] = bool(out["dispatch_vs_half_copy"] >= 1 and out["combine_vs_half_copy"] >= 1)
    total = expert_totals(ids, E).reshape(R, E // R)
    want_sizes = np.minimum(total, capacity) if padded else total
    n = min(check_tokens, T)
    xs = x[:, :n]
    if fp8:  # what the dispatch delivers: x through jaxcomm's FP8 format
        from jaxcomm._src.moe import fp8 as fp8_format
        q, sc = (np.asarray(a) for a in fp8_format.quantize(xs.reshape(-1, H).astype(np.float32)))
        xs = np.asarray(fp8_format.dequantize(q, sc, np.float32)).reshape(xs.shape).astype(x.dtype)
    ref = reference_y(xs, res["dest"][:, :n], w[:, :n])
    got = res["y"][:, :n].astype(np.float32)
    err = float(np.max(np.abs(got - ref) / (np.abs(ref) + 1e-3)))
    out["checks"] = dict(
        sizes_match=bool(np.array_equal(res["sizes"], want_sizes)),
        dropped=int(res["stats"][:, 0].sum()), recv_dropped=int(res["stats"][:, 2].sum()),
        combine_max_rel_err=err, combine_ok=bool(err < (1e-5 if dtype == "float32" else 2e-2)),
    )
    out["prep_s"] = prep_s
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--layouts", default="packed,padded", help="packed, padded, low_latency")
    p.add_argument("--fp8", choices=("no", "yes", "both"), default="no",
                   help="FP8 dispatch (quantize, move codes and scales, dequantize)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    results = []
    runs = [(layout, fp8) for layout in a.layouts.split(",")
            for fp8 in {"no": (False,), "yes": (True,), "both": (False, True)}[a.fp8]]
    for layout, fp8 in runs:
        r = benchmark(a.ranks, a.tokens, a.hidden, a.topk, a.experts, a.dtype,
                      padded=layout == "padded", iters=a.iters, low_latency=layout == "low_latency",
                      fp8=fp8)
        results.append(r)
        print(f"{layout}{' fp8' if fp8 else ''}: dispatch {r['dispatch_ms']:.3f} ms {r['dispatch_GBps']:.0f} GB/s, "
              f"combine {r['combine_ms']:.3f} ms {r['combine_GBps']:.0f} GB/s, "
              f"copy {r['memcpy_GBps']:.0f} GB/s (read+write), target met: {r['target_met']}, "
              f"checks {r['checks']}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
