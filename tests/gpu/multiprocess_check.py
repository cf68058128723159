"""The body of a job of several processes sharing one GPU (tests/gpu/test_multiprocess_gpu.py,
scripts/gpu_check.sh): every jaxcomm op and MoE dispatch/combine over a mesh of one GPU
per process, checked against NumPy references of the global data.

Every group of this job has two or more ranks on one GPU, which NCCL refuses ("Duplicate
GPU detected"): jaxcomm routes them to its own kernels and copies, reading the peers'
buffers through CUDA IPC (ffi/cuda/routes.h). Each process rebuilds the global data from
the seed and checks its own shard. Prints "CHECKED <name>" per case; raises on the first
mismatch. With JAXCOMM_MP_FIGURES=1 it then times dispatch+combine at the size of
JAXCOMM_MP_FIGURE (T,H,K,E) against a device-to-device copy of the same tokens in the
same run, and rank 0 prints "FIGURE <json>"; with JAXCOMM_MP_FIGURES=only it times that
alone, without the checks.

Run under tests/mp_util.py's prologue (RANK, NPROC, np, jax, jnp, P, jaxcomm defined).
"""

import json
import os
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxcomm

sys.path.insert(0, os.environ["JAXCOMM_TESTS_DIR"])
from gpu import moe_reference  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("ep",))
R = mesh.devices.size
spec = P("ep")
sharding = NamedSharding(mesh, spec)
mine = [i for i, d in enumerate(mesh.devices.reshape(-1)) if d.process_index == jax.process_index()]


def global_array(X):
    """X [R, ...] with row p on partition p (this process feeds its own rows)."""
    block = X.shape[1:]
    shards = [jax.device_put(X[p][None], mesh.devices.reshape(-1)[p]) for p in mine]
    return jax.make_array_from_single_device_arrays((R, *block), sharding, shards)


def run(f, *arrays):
    g = jax.jit(jax.shard_map(lambda *xs: f(*(x[0] for x in xs)), mesh=mesh, in_specs=(spec,) * len(arrays),
                              out_specs=spec, check_vma=False))
    return g(*arrays)


def local(out):
    """{partition: numpy block} of this process's shards."""
    flat = list(mesh.devices.reshape(-1))
    return {flat.index(s.device): np.asarray(s.data) for s in out.addressable_shards}


def check(name, out, expected, rtol=1e-6):
    for p, block in local(out).items():
        np.testing.assert_allclose(block, expected(p), rtol=rtol, atol=1e-6, err_msg=f"{name} on rank {p}")
    print("CHECKED", name, flush=True)


def figure():
    """Times dispatch+combine against a device-to-device copy; rank 0 prints FIGURE."""
    T, H, K, E = (int(v) for v in os.environ.get("JAXCOMM_MP_FIGURE", "4096,7168,8,256").split(","))
    iters = 10
    rng = np.random.default_rng(RANK)
    ids = np.stack([np.argpartition(rng.random((T, E), dtype=np.float32), -K, axis=1)[:, -K:]
                    for _ in range(R)]).astype(np.int32)
    tok = np.random.default_rng(5).integers(-4, 4, size=(R, T, H)).astype(jnp.bfloat16)
    wts = np.full((R, T, K), 1.0 / K, np.float32)
    xs, ids_a, w_a = global_array(tok), global_array(ids), global_array(wts)

    def layer(v, i, w):
        ex, _, h = jaxcomm.moe.dispatch(v, i, num_experts=E, axis_name="ep")
        return jaxcomm.moe.combine(ex, h, w)[None]

    moe_f = jax.jit(jax.shard_map(lambda v, i, w: layer(v[0], i[0], w[0]), mesh=mesh,
                                  in_specs=(spec,) * 3, out_specs=spec, check_vma=False))
    copy_f = jax.jit(lambda v: v * 1)  # a device-to-device copy (not donated: XLA copies)

    def timed(f, *args):
        jax.block_until_ready(f(*args))
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            out.append(time.perf_counter() - t0)
        return float(np.median(out))

    t_moe, t_copy = [], []
    for _ in range(3):  # alternate the sides
        t_moe.append(timed(moe_f, xs, ids_a, w_a))
        t_copy.append(timed(copy_f, xs))
    # DeepEP's byte count per rank: one token row per (token, destination rank) pair kept,
    # each way (dispatch and combine).
    El = E // R
    pairs = sum(len({int(e) // El for e in ids[p, t]}) for p in mine for t in range(T))
    moved = 2 * pairs * H * 2
    res = dict(ranks=R, T=T, H=H, K=K, E=E, dtype="bfloat16", moe_ms=1e3 * min(t_moe),
               copy_ms=1e3 * min(t_copy), moe_GBps=moved / min(t_moe) / 1e9,
               copy_GBps=2 * tok[0].nbytes / min(t_copy) / 1e9, rounds=len(t_moe), iters=iters,
               note="per process, all processes at once on one GPU; copy counts read+write")
    if RANK == 0:
        print("FIGURE", json.dumps(res), flush=True)


# JAXCOMM_MP_FIGURES=only: the figure alone, timed whether or not the checks below pass
# (scripts/gpu_check.sh's figure stage; the tests stage runs the checks).
if os.environ.get("JAXCOMM_MP_FIGURES") == "only":
    figure()
    sys.exit(0)


X = np.random.default_rng(7).integers(-8, 8, size=(R, 2 * R, 3, 2 * R)).astype(np.float32)
x = global_array(X)
one = lambda f: (lambda v: f(v)[None])  # noqa: E731  (a rank's block back with its leading 1)
check("all_reduce sum", run(one(lambda v: jaxcomm.all_reduce(v, "ep")), x), lambda p: X.sum(0)[None])
check("all_reduce max", run(one(lambda v: jaxcomm.all_reduce(v, "ep", op="max")), x), lambda p: X.max(0)[None])
check("all_gather axis 1", run(one(lambda v: jaxcomm.all_gather(v, "ep", axis=1, tiled=True)), x),
      lambda p: np.concatenate(list(X), axis=1)[None])
check("reduce_scatter dim 2", run(one(lambda v: jaxcomm.reduce_scatter(v, "ep", scatter_dimension=2, tiled=True)), x),
      lambda p: np.split(X.sum(0), R, axis=2)[p][None])
# Every way the peer route lays blocks out: a contiguous source block, a contiguous
# destination block, and both strided (through a staging block).
for split, concat in ((0, 2), (2, 0), (2, 2)):
    check(f"all_to_all {split}->{concat}",
          run(one(lambda v, s=split, c=concat: jaxcomm.all_to_all(v, "ep", s, c, tiled=True)), x),
          lambda p, s=split, c=concat: np.concatenate([np.split(X[j], R, axis=s)[p] for j in range(R)], axis=c)[None])
ring = [(i, (i + 1) % R) for i in range(R)]
check("ppermute ring", run(one(lambda v: jaxcomm.ppermute(v, "ep", ring)), x), lambda p: X[(p - 1) % R][None])
check("ppermute partial", run(one(lambda v: jaxcomm.ppermute(v, "ep", [(0, 1)])), x),
      lambda p: (X[0] if p == 1 else np.zeros_like(X[0]))[None])
check("broadcast root 2", run(one(lambda v: jaxcomm.broadcast(v, "ep", root=min(2, R - 1))), x),
      lambda p: X[min(2, R - 1)][None])


def body(f):
    """f over a loop of three iterations: every rank's calls of one instruction must meet
    the same iteration's (peers.h keys calls by execution)."""
    return lambda v: jax.lax.fori_loop(0, 3, lambda i, c: f(c), v)


check("all_reduce in a loop", run(one(body(lambda v: jaxcomm.all_reduce(v, "ep") / R)), x),
      lambda p: (X.sum(0) / R)[None], rtol=1e-5)

# MoE dispatch + combine through jaxcomm's own kernels across the processes.
T, H, K, E = 24, 16, 3, 4 * R
ids = np.stack([[np.random.default_rng(r * 100 + t).choice(E, K, replace=False) for t in range(T)]
                for r in range(R)]).astype(np.int32)
ids[0, 0, 1] = 10**6  # an invalid id
wts = np.random.default_rng(3).integers(1, 8, size=(R, T, K)).astype(np.float32) / 8
tok = np.random.default_rng(4).integers(-8, 8, size=(R, T, H)).astype(np.float32)
for padded, capacity in ((False, None), (False, 2 * T), (True, None), (True, T // 2)):
    def moe(v, i, w, padded=padded, capacity=capacity):
        disp = jaxcomm.moe.dispatch_padded if padded else jaxcomm.moe.dispatch
        comb = jaxcomm.moe.combine_padded if padded else jaxcomm.moe.combine
        ex, sizes, h = disp(v, i, num_experts=E, axis_name="ep", capacity=capacity)
        y = comb(ex * 2, h, w)
        return jnp.concatenate([ex.reshape(-1), sizes.astype(jnp.float32), y.reshape(-1)])[None]

    out = run(moe, global_array(tok), global_array(ids), global_array(wts))
    ref = moe_reference.dispatch(tok, ids, E, capacity, padded)
    y_ref = moe_reference.combine(2 * ref.expert_x, ref, wts)
    tag = f"moe {'padded' if padded else 'packed'} capacity {capacity}"
    check(tag, out, lambda p: np.concatenate([ref.expert_x[p].reshape(-1), ref.sizes[p], y_ref[p].reshape(-1)])[None])

# The split-phase halves (each rank's movement on jaxcomm's stream, handed to its receive
# half by events, peers' included), the low-latency layout (rows past the counts never
# read) and FP8 dequantized on delivery, across the processes.
from moe_reference import np_combine, np_dequantize_fp8, np_dispatch, np_quantize_fp8  # noqa: E402

MAX = T


def split_low_latency_fp8(v, i, w):
    pending = jaxcomm.moe.dispatch_send(v, i, num_experts=E, axis_name="ep", layout="low_latency",
                                        max_tokens=MAX, fp8="dequantize")
    ex, counts, h = jaxcomm.moe.dispatch_recv(pending)
    y = jaxcomm.moe.combine_recv(jaxcomm.moe.combine_send(ex * 2, h, w))
    valid = jnp.where(jnp.arange(ex.shape[1])[None, :, None] < counts[:, None, None], ex, 0)
    return jnp.concatenate([valid.reshape(-1), counts.astype(jnp.float32), y.reshape(-1)])[None]


out = run(split_low_latency_fp8, global_array(tok), global_array(ids), global_array(wts))
want_ex, want_sizes, row_of, _ = np_dispatch(np_dequantize_fp8(*np_quantize_fp8(tok), np.float32), ids, E,
                                             padded=True, slab=R * MAX)
y_ref = np_combine(2 * want_ex, row_of, wts, T, H)
check("moe split low-latency fp8", out,
      lambda p: np.concatenate([want_ex[p].reshape(-1), want_sizes[p], y_ref[p].reshape(-1)])[None])


if os.environ.get("JAXCOMM_MP_FIGURES") == "1":
    figure()
