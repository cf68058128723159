"""The CUDA kernels' index, routing and layout logic (ffi/cuda/kernel_logic.h), run on the
host, against the host backend's results: the part of the CUDA backend that CI can prove
without a GPU. The kernels call the same functions on the device (kernels.cu); what the
GPU alone can show (the warp-parallel ranking, the data movement) the GPU tests check.

Routings cover uneven loads, ranks that receive nothing, every token to one expert,
invalid ids, repeated experts in a token, and capacities that drop.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxcomm
from jaxcomm import _jaxcomm

from jaxcomm._src.moe import fused
from moe_reference import np_quantize_fp8  # tests/moe_reference.py: jaxcomm's FP8 format in NumPy

GATHER_COPY, GATHER_SCALED, REDUCE, DOT = 0, 1, 2, 3  # core/moe_modes.h
GATHER_SPARSE, GATHER_DEQUANT, GATHER_DEQUANT_SPARSE = 4, 5, 6
FLOAT_CODES = {np.dtype(np.float32): 0, np.dtype(jnp.bfloat16): 1, np.dtype(np.float16): 2}  # logic_host.h


def cpu_mesh(n: int) -> Mesh:
    devices = jax.devices("cpu")
    if len(devices) < n:
        pytest.skip(f"needs {n} CPU devices")
    return Mesh(np.array(devices[:n]), ("ep",))


def run(f, mesh, *args):
    """jit(shard_map(f)) with every arg split on dim 0, traced as in a CPU-only process
    (the host backend's own transports, even where a GPU is present)."""
    placed = [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in args]
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * len(args), out_specs=P("ep"),
                              check_vma=False))
    with mock.patch.object(jax, "default_backend", lambda: "cpu"):
        return jax.tree.map(np.asarray, g(*placed))


# ---------------------------------------------------------------------------- routings

def routing(kind: str, R: int, T: int, K: int, E: int, seed: int) -> np.ndarray:
    """[R, T, K] int32 expert ids of one kind of routing."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return np.stack([[rng.choice(E, K, replace=False) for _ in range(T)] for _ in range(R)]).astype(np.int32)
    if kind == "skewed":  # a few hot experts, repeats inside a token allowed
        p = 1.0 / np.arange(1, E + 1) ** 1.5
        return rng.choice(E, size=(R, T, K), p=p / p.sum()).astype(np.int32)
    if kind == "one_expert":
        return np.full((R, T, K), E // 2 + 1, np.int32)
    if kind == "empty_ranks":  # rank 1's experts never chosen; rank 2 routes nothing
        El = E // R
        allowed = np.array([e for e in range(E) if e // El != 1])
        ids = rng.choice(allowed, size=(R, T, K)).astype(np.int32)
        ids[2] = -1
        return ids
    if kind == "invalid":  # -1, and ids outside [0, E): counted, treated as -1
        ids = rng.integers(0, E, size=(R, T, K)).astype(np.int32)
        bad = rng.random((R, T, K))
        ids[bad < 0.15] = -1
        ids[(bad >= 0.15) & (bad < 0.25)] = E
        ids[(bad >= 0.25) & (bad < 0.3)] = -7
        ids[(bad >= 0.3) & (bad < 0.33)] = 2**30
        return ids
    raise ValueError(kind)


def host_moe(x, ids, w, E, capacity, padded):
    """The host backend's dispatch (expert_x, sizes, stats) and combine of
    expert_y = 2 * expert_x + 1, with its gradients towards expert_y and the weights for
    the cotangent `ct`."""
    R, T, H = x.shape

    def f(x, ids, w, ct):
        disp = jaxcomm.moe.dispatch_padded if padded else jaxcomm.moe.dispatch
        comb = jaxcomm.moe.combine_padded if padded else jaxcomm.moe.combine
        ex, sizes, h = disp(x, ids, num_experts=E, axis_name="ep", capacity=capacity)
        ey = ex * 2 + 1
        y = comb(ey, h, w)
        g_ey, g_w = jax.grad(lambda ey, w: jnp.sum(comb(ey, h, w) * ct), argnums=(0, 1))(ey, w)
        stats = jnp.stack([h.dropped, h.invalid, h.recv_dropped])
        flat = lambda a: a.reshape(-1, H)
        return flat(ex)[None], sizes[None], stats[None], y[None], flat(g_ey)[None], g_w[None]

    ct = np.random.default_rng(5).integers(-3, 4, size=(R, T, H)).astype(np.float32)
    flat = lambda a: a.reshape(R * T, *a.shape[2:])
    outs = run(f, cpu_mesh(R), flat(x), flat(ids), flat(w), flat(ct))
    return outs, ct


CASES = [
    ("uniform", False, None), ("uniform", True, None),
    ("uniform", False, "tight"), ("uniform", True, "tight"),
    ("skewed", False, "tight"), ("skewed", True, "tight"),
    ("one_expert", False, None), ("one_expert", True, "tight"),
    ("empty_ranks", False, None), ("empty_ranks", True, "tight"),
    ("invalid", False, None), ("invalid", True, "tight"),
]


@pytest.mark.parametrize("kind,padded,capacity", CASES, ids=lambda v: str(v))
def test_routing_and_moe_logic_match_host_backend(kind, padded, capacity):
    R, T, K, E, H = 4, 12, 3, 16, 8
    El = E // R
    ids = routing(kind, R, T, K, E, seed=sum(map(ord, kind)))
    rng = np.random.default_rng(1)
    # Distinct token rows: expert_x then pins every assignment's place.
    x = (np.arange(R * T)[:, None] * 16 + np.arange(H)).reshape(R, T, H).astype(np.float32)
    w = rng.integers(1, 8, size=(R, T, K)).astype(np.float32) / 8
    cap = None if capacity is None else (3 if padded else 9)
    (ex, sizes, stats, y, g_ey, g_w), ct = host_moe(x, ids, w, E, cap, padded)

    rows = El * (cap if cap is not None else R * T) if padded else (cap if cap is not None else R * T * min(K, El))
    dest, pos, my_sizes, my_stats = _jaxcomm.cuda_logic_route(ids.reshape(-1).tolist(), R, T, K, E, rows, padded)
    dest = np.asarray(dest, np.int32).reshape(R, T, K)
    pos = np.asarray(pos, np.int32).reshape(R, T, K)
    np.testing.assert_array_equal(np.asarray(my_sizes).reshape(R, El), sizes.reshape(R, El))
    np.testing.assert_array_equal(np.asarray(my_stats).reshape(R, 3), stats.reshape(R, 3))
    if capacity is not None and kind != "empty_ranks":
        assert np.asarray(my_stats).reshape(R, 3)[:, 0].sum() > 0, "the tight case must drop"

    def moe(mode, src, row_bytes, g=None):
        out = _jaxcomm.cuda_logic_moe(
            mode, T, K, H, rows, row_bytes, [s.tobytes() for s in src],
            [d.reshape(-1).tolist() for d in dest], [p.reshape(-1).tolist() for p in pos],
            [a.reshape(-1).tolist() for a in w], [] if g is None else [a.reshape(-1).tolist() for a in g])
        return np.stack([np.frombuffer(o, np.float32) for o in out])

    my_ex = moe(GATHER_COPY, x, H * 4).reshape(R, rows, H)
    np.testing.assert_array_equal(my_ex, ex.reshape(R, rows, H))
    ey = my_ex * 2 + 1
    # Same float32 operations in the same order as the host backend: equal.
    np.testing.assert_array_equal(moe(REDUCE, ey, H * 4).reshape(R, T, H), y.reshape(R, T, H))
    np.testing.assert_array_equal(moe(GATHER_SCALED, ct, H * 4).reshape(R, rows, H), g_ey.reshape(R, rows, H))
    # The kernel sums a dot product in another order: equal up to rounding.
    g = ct.reshape(R, T * H)
    np.testing.assert_allclose(moe(DOT, ey, H * 4, g=g).reshape(R, T, K), g_w.reshape(R, T, K), rtol=1e-6)


def test_route_logic_places_assignments_in_source_token_slot_order():
    # Independent of the host backend: two ranks, one expert per rank, packed.
    ids = np.array([[[0], [1], [0]], [[0], [-1], [1]]], np.int32)  # R=2, T=3, K=1, E=2
    dest, pos, sizes, stats = _jaxcomm.cuda_logic_route(ids.reshape(-1).tolist(), 2, 3, 1, 2, 2, False)
    # Expert 0 (rank 0): rank 0's tokens 0, 2, then rank 1's token 0 -> rows 0, 1, dropped.
    assert list(dest) == [0, 1, 0, -1, -1, 1]
    assert list(pos) == [0, 0, 1, -1, -1, 1]
    assert list(sizes) == [2, 2]
    assert list(stats) == [0, 0, 1, 1, 0, 0]  # rank 0: one arrival past capacity; rank 1: one dropped


# -------------------------------------------- low latency, FP8, half precision combine

def host_transport(mode, src, dest, pos, w, g, rows, out_dtype):
    """The host backend's transport ``mode`` over R ranks (every arg [R, ...])."""
    R = src.shape[0]

    def f(src, dest, pos, w, g):
        return fused.transport(mode, src, dest, pos, "ep", w=w, g=g, rows=rows, out_dtype=out_dtype)
    out = run(f, cpu_mesh(R), *(a.reshape((-1,) + a.shape[2:]) for a in (src, dest, pos, w, g)))
    return out.reshape((R, -1) + out.shape[1:])


def logic_moe(mode, src, dest, pos, w, g, rows, row_bytes, src_type=np.float32, out_type=np.float32):
    R, T, K = dest.shape
    H = src.shape[-1]
    out = _jaxcomm.cuda_logic_moe(mode, T, K, H, rows, row_bytes, [a.tobytes() for a in src],
                                  [d.reshape(-1).tolist() for d in dest], [p.reshape(-1).tolist() for p in pos],
                                  [a.reshape(-1).tolist() for a in w], [a.reshape(-1).tolist() for a in g],
                                  src_type=FLOAT_CODES[np.dtype(src_type)],
                                  out_type=FLOAT_CODES[np.dtype(out_type)])
    return [bytes(o) for o in out]


@pytest.mark.parametrize("kind,padded", [("uniform", True), ("skewed", False), ("empty_ranks", True),
                                         ("invalid", False)])
def test_low_latency_fp8_and_half_modes_match_host_backend(kind, padded):
    """GATHER_SPARSE (writes only the arriving rows), the dequantizing gathers and the half
    precision REDUCE: the kernels' logic against the host backend's transports, bit for bit."""
    R, T, K, E, H = 4, 10, 3, 16, 200
    El = E // R
    ids = routing(kind, R, T, K, E, seed=sum(map(ord, kind)) + 7)
    rows = El * 3 if padded else 9
    dest, pos, _, _ = _jaxcomm.cuda_logic_route(ids.reshape(-1).tolist(), R, T, K, E, rows, padded)
    dest = np.asarray(dest, np.int32).reshape(R, T, K)
    pos = np.asarray(pos, np.int32).reshape(R, T, K)
    rng = np.random.default_rng(3)
    w = rng.random((R, T, K)).astype(np.float32)
    x = (rng.normal(size=(R, T, H)) * np.exp(rng.normal(size=(R, T, 1)) * 3)).astype(np.float32)
    written = np.zeros((R, rows), bool)
    for r in range(R):
        for d, p in zip(dest[r].reshape(-1), pos[r].reshape(-1)):
            if d >= 0:
                written[d, p] = True

    # GATHER_SPARSE: the arriving rows as GATHER_COPY writes them; the others untouched.
    xb = x.astype(jnp.bfloat16)
    copy = np.stack([np.frombuffer(o, jnp.bfloat16).reshape(rows, H) for o in
                     logic_moe(GATHER_COPY, xb, dest, pos, w, np.zeros((R, T, 1), np.float32), rows, H * 2)])
    sparse = np.stack([np.frombuffer(o, np.uint8).reshape(rows, H * 2) for o in
                       logic_moe(GATHER_SPARSE, xb, dest, pos, w, np.zeros((R, T, 1), np.float32), rows, H * 2)])
    np.testing.assert_array_equal(sparse[written], copy.view(np.uint8).reshape(R, rows, H * 2)[written])
    assert (sparse[~written] == 0x7F).all()
    np.testing.assert_array_equal(copy, host_transport(GATHER_COPY, xb, dest, pos, w, np.zeros((R, T, 1), np.float32),
                                                       rows, jnp.bfloat16))

    # The dequantizing gathers: the host's FP8 format of x, delivered in each float type.
    q, scales = np_quantize_fp8(x)
    for out_dtype in (np.float32, jnp.bfloat16, np.float16):
        item = np.dtype(out_dtype).itemsize
        got = np.stack([np.frombuffer(o, out_dtype).reshape(rows, H) for o in
                        logic_moe(GATHER_DEQUANT, q.view(np.uint8), dest, pos, w, scales, rows, H * item, out_type=out_dtype)])
        want = host_transport(GATHER_DEQUANT, q, dest, pos, w, scales, rows, out_dtype)
        np.testing.assert_array_equal(got.view(np.uint8), np.asarray(want).view(np.uint8))
        got = np.stack([np.frombuffer(o, np.uint8).reshape(rows, H * item) for o in
                        logic_moe(GATHER_DEQUANT_SPARSE, q.view(np.uint8), dest, pos, w, scales, rows, H * item,
                                  out_type=out_dtype)])
        np.testing.assert_array_equal(got[written], np.asarray(want).view(np.uint8).reshape(R, rows, -1)[written])
        assert (got[~written] == 0x7F).all()

    # REDUCE in half precision: float32 sums in the kernel's order, rounded once.
    ey = (np.stack([np.frombuffer(o, jnp.bfloat16).reshape(rows, H) for o in
                    logic_moe(GATHER_COPY, xb, dest, pos, w, np.zeros((R, T, 1), np.float32), rows, H * 2)])
          .astype(np.float32) * 0.75).astype(np.float32)
    for dtype in (jnp.bfloat16, np.float16):
        src = ey.astype(dtype)
        got = np.stack([np.frombuffer(o, dtype).reshape(T, H) for o in
                        logic_moe(REDUCE, src, dest, pos, w, np.zeros((R, T, 1), np.float32), rows, H * 2, dtype, dtype)])
        want = host_transport(REDUCE, src, dest, pos, w, np.zeros((R, T, 1), np.float32), 0, dtype)
        np.testing.assert_array_equal(got.view(np.uint16), np.asarray(want).view(np.uint16))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("H", [7168, 300, 7], ids=["full-blocks", "partial-block", "one-short-block"])
def test_fp8_quantize_logic_matches_numpy_and_host_backend(dtype, H):
    """The quantize kernel's lanes and warp maximum, run on the host, against the NumPy
    format and the host backend's FP8 dispatch (delivered raw, one rank), bit for bit;
    blocks of zeros, subnormals, large values and a negative zero included."""
    T = 6
    rng = np.random.default_rng(H)
    x = rng.normal(size=(T, H)) * np.exp(rng.normal(size=(T, 1)) * 4)
    x[1, :min(H, 128)] = 0.0                      # an all-zero block: the minimum amax
    x[2] = rng.normal(size=H) * 1e-6              # tiny values (subnormal in FP8 after scaling)
    x[3, 0] = -0.0
    x[4, ::5] = 6e4 if dtype == np.float16 else 1e30
    x = x.astype(dtype)
    q, scales = _jaxcomm.cuda_logic_fp8_quantize(x.tobytes(), FLOAT_CODES[np.dtype(dtype)], T, H)
    q = np.frombuffer(q, np.uint8).reshape(T, H)
    scales = np.asarray(scales, np.float32).reshape(T, -1)
    want_q, want_s = np_quantize_fp8(x.astype(np.float32))
    np.testing.assert_array_equal(q, want_q.view(np.uint8))
    np.testing.assert_array_equal(scales, want_s)

    def f(x):  # every token to expert 0 of the one rank: expert rows = tokens in order
        (hq, hs), _, _ = jaxcomm.moe.dispatch(x[0], jnp.zeros((T, 1), jnp.int32), num_experts=1,
                                              axis_name="ep", fp8="raw")
        return hq.view(jnp.uint8)[None], hs[None]
    hq, hs = run(f, cpu_mesh(1), x[None])
    np.testing.assert_array_equal(q, hq[0][:T])
    np.testing.assert_array_equal(scales, hs[0][:T])


# ----------------------------------------------------------------------------- ragged

def host_ragged(operand, output, io, ss, oo, ct):
    """The host backend's one-rank ragged_all_to_all and its gradients for cotangent ct."""
    def f(op, out, io, ss, oo, ct):
        g = lambda a, b: jaxcomm.ragged_all_to_all(a, b, io[0], ss[0], oo[0], ss[0], axis_name="ep")
        y, vjp = jax.vjp(g, op[0], out[0])
        d_op, d_out = vjp(ct[0])
        return y[None], d_op[None], d_out[None]
    return run(f, cpu_mesh(1), operand[None], output[None], io[None], ss[None], oo[None], ct[None])


@pytest.mark.parametrize("seed", range(6))
def test_ragged_logic_matches_host_backend(seed):
    rng = np.random.default_rng(seed)
    S, D, n, E_ = 9, 11, 5, 3
    ss = rng.integers(0, 4, size=n)
    ss[rng.integers(n)] = 0  # a zero-size slice, possibly sharing an offset
    io = np.array([rng.integers(0, S - s + 1) for s in ss])
    oo = np.array([rng.integers(0, D - s + 1) for s in ss])  # overlaps allowed: later wins
    operand = rng.integers(-9, 9, size=(S, E_)).astype(np.float32)
    output = rng.integers(-9, 9, size=(D, E_)).astype(np.float32)
    ct = rng.integers(-9, 9, size=(D, E_)).astype(np.float32)
    y, d_op, d_out = host_ragged(operand, output, io.astype(np.int32), ss.astype(np.int32), oo.astype(np.int32), ct)

    def logic(mode, op, out):
        res = _jaxcomm.cuda_logic_ragged(mode, op.reshape(-1).tolist(), out.reshape(-1).tolist(), E_,
                                         S, D, io.tolist(), ss.tolist(), oo.tolist(), ss.tolist())
        return np.asarray(res, np.float32).reshape(out.shape)

    np.testing.assert_array_equal(logic(0, operand, output), y[0])
    np.testing.assert_array_equal(logic(1, ct, np.zeros_like(operand)), d_op[0])
    np.testing.assert_array_equal(logic(2, ct, ct), d_out[0])


@pytest.mark.parametrize("bad", ["past_end", "negative", "recv_disagrees"])
def test_ragged_logic_writes_nothing_for_an_invalid_call(bad):
    # On CUDA the offsets stay on the device: an invalid call leaves the output as it was.
    S, D = 6, 8
    io, ss, oo, rs = [0, 2], [2, 3], [0, 4], [2, 3]
    if bad == "past_end":
        oo = [0, 6]
    elif bad == "negative":
        io = [-1, 2]
    else:
        rs = [2, 2]
    operand = np.arange(S * 2, dtype=np.float32)
    output = -np.ones(D * 2, np.float32)
    res = _jaxcomm.cuda_logic_ragged(0, operand.tolist(), output.tolist(), 2, S, D, io, ss, oo, rs)
    np.testing.assert_array_equal(res, output)


# ------------------------------------------------------------------------ copy plans

MAX_PITCH = 2**31 - 1


def emulate(copies, dst: bytearray, src_of) -> None:
    """Carries out (dst, dpitch, src, spitch, width, height) copies; src_of(i) names the
    source buffer of copy i."""
    for i, (d, dp, s, sp, wdt, h) in enumerate(copies):
        src = src_of(i)
        for row in range(h):
            dst[d + row * dp: d + row * dp + wdt] = src[s + row * sp: s + row * sp + wdt]


def check_pitches(copies, max_pitch):
    for (_, dp, _, sp, wdt, h) in copies:
        assert h == 1 or (dp <= max_pitch and sp <= max_pitch), (dp, sp, h)
        assert wdt <= dp and wdt <= sp


SHAPES = [((2, 3, 4), 0), ((2, 3, 4), 1), ((2, 3, 4), 2), ((5, 1, 2), 1), ((1, 6), 1)]
# Group sizes of the copy plans: 4 and 5 besides 3, so that a plan that confuses blocks
# past the first few (1 and 2 swapped for R >= 4) fails here too, not only on 4+ GPUs.
GROUP_SIZES = [3, 4, 5]


def with_blocks(shape, axis, R):
    """``shape`` (written for R = 3) with dimension ``axis`` rescaled to split R ways."""
    out = list(shape)
    out[axis] = out[axis] // 3 * R
    return tuple(out)


@pytest.mark.parametrize("R", GROUP_SIZES)
@pytest.mark.parametrize("max_pitch", [MAX_PITCH, 8], ids=["one_2d_copy", "pitch_limited"])
@pytest.mark.parametrize("shape,axis", SHAPES)
def test_all_gather_unpack_plan(shape, axis, max_pitch, R):
    xs = [np.arange(np.prod(shape), dtype=np.int32).reshape(shape) + 100 * r for r in range(R)]
    want = np.concatenate(xs, axis=axis)
    gathered = b"".join(x.tobytes() for x in xs)  # what NCCL's all_gather leaves: rank-major
    copies = _jaxcomm.cuda_logic_block_copies(list(want.shape), axis, R, 4, False, xs[0].nbytes, max_pitch)
    check_pitches(copies, max_pitch)
    out = bytearray(want.nbytes)
    emulate(copies, out, lambda i: gathered)
    np.testing.assert_array_equal(np.frombuffer(bytes(out), np.int32).reshape(want.shape), want)
    outer = int(np.prod(want.shape[:axis]))
    if max_pitch == 8 and outer > 1 and R * xs[0].nbytes // outer > 8:
        assert len(copies) == R * outer, "a pitch above the limit splits into one copy per row"


@pytest.mark.parametrize("R", GROUP_SIZES)
@pytest.mark.parametrize("max_pitch", [MAX_PITCH, 8], ids=["one_2d_copy", "pitch_limited"])
@pytest.mark.parametrize("shape,axis", [((2, 6, 2), 1), ((6, 3), 0), ((2, 3, 6), 2)])
def test_reduce_scatter_pack_plan(shape, axis, max_pitch, R):
    shape = with_blocks(shape, axis, R)
    xs = [np.random.default_rng(r).integers(-9, 9, size=shape).astype(np.int32) for r in range(R)]
    block = xs[0].nbytes // R
    packed = []
    for x in xs:
        copies = _jaxcomm.cuda_logic_block_copies(list(shape), axis, R, 4, True, block, max_pitch)
        check_pitches(copies, max_pitch)
        buf = bytearray(x.nbytes)
        emulate(copies, buf, lambda i, x=x: x.tobytes())
        packed.append(np.frombuffer(bytes(buf), np.int32))
    total = np.sum(packed, axis=0)  # NCCL's reduce-scatter over the packed buffers
    want = np.split(np.sum(xs, axis=0), R, axis=axis)
    for r in range(R):
        np.testing.assert_array_equal(total[r * block // 4:(r + 1) * block // 4], want[r].reshape(-1))


@pytest.mark.parametrize("max_pitch", [MAX_PITCH, 8], ids=["one_2d_copy", "pitch_limited"])
@pytest.mark.parametrize("shape,split,concat", [((2, 6, 4), 1, 2), ((6, 2, 3), 0, 1), ((2, 3, 6), 2, 0),
                                                ((3, 6), 1, 1)])
@pytest.mark.parametrize("R", GROUP_SIZES)
def test_all_to_all_pack_unpack_plan(shape, split, concat, max_pitch, R):
    shape = with_blocks(shape, split, R)
    xs = [np.arange(np.prod(shape), dtype=np.int32).reshape(shape) + 1000 * r for r in range(R)]
    block = xs[0].nbytes // R
    out_shape = list(shape)
    out_shape[split] //= R
    out_shape[concat] *= R
    pack = _jaxcomm.cuda_logic_block_copies(list(shape), split, R, 4, True, block, max_pitch)
    unpack = _jaxcomm.cuda_logic_block_copies(out_shape, concat, R, 4, False, block, max_pitch)
    check_pitches(pack + unpack, max_pitch)
    sent = []
    for x in xs:
        buf = bytearray(x.nbytes)
        emulate(pack, buf, lambda i, x=x: x.tobytes())
        sent.append(bytes(buf))
    for r in range(R):
        # NCCL's send/recv: block r of every rank j lands at block j of rank r.
        received = b"".join(sent[j][r * block:(r + 1) * block] for j in range(R))
        out = bytearray(len(received))
        emulate(unpack, out, lambda i: received)
        want = np.concatenate([np.split(x, R, axis=split)[r] for x in xs], axis=concat)
        np.testing.assert_array_equal(np.frombuffer(bytes(out), np.int32).reshape(want.shape), want)
