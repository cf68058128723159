"""jaxcomm.moe for inference and overlap: half precision combine, the low-latency layout,
FP8 dispatch, split-phase calls and the bad-input rules, in both call forms (inside
shard_map and the global view), against the NumPy references of moe_reference.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import test_util as jtu
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from conftest import per_device
from moe_reference import (R, np_combine, np_combine_f32, np_dequantize_fp8, np_dispatch,
                           np_quantize_fp8, routing, tagged_x)

FORMS = ["shard_map", "global"]


def _mesh():
    return jax.make_mesh((R,), ("ep",), devices=jax.devices()[:R])


def run(form, f, *args):
    """f on per-rank arrays args[i][k] (shard_map) or on their concatenation (global view
    under jit); outputs as [R, per-rank shape...] NumPy arrays either way."""
    if form == "shard_map":
        return per_device(f, _mesh(), *args)
    sh = NamedSharding(_mesh(), P("ep"))
    out = jax.jit(f)(*[jax.device_put(a.reshape((-1,) + a.shape[2:]), sh) for a in args])

    def per_rank(o):
        o = np.asarray(o)
        return o if o.shape[0] == R else o.reshape((R, o.shape[0] // R) + o.shape[1:])
    return jax.tree.map(per_rank, out)


def _ll_valid(ex, counts):
    """The rows of a low-latency expert_x [R, El, S, H] below each expert's count (the
    others are unspecified), zeros elsewhere."""
    rows = np.arange(ex.shape[2])[None, None, :, None]
    return np.where(rows < counts[:, :, None, None], ex, 0)


def _bf16_case(T, K, E, H, seed):
    """(ids, x, weights, cotangent): bfloat16 tokens and cotangent, float32 weights."""
    rng = np.random.default_rng(seed + 1)
    return (routing(T, K, E, seed=seed), rng.normal(size=(R, T, H)).astype(jnp.bfloat16),
            rng.random((R, T, K)).astype(np.float32), rng.normal(size=(R, T, H)).astype(jnp.bfloat16))


def _differentiable(form, layer, x, ids, w):
    """(f(x, w), its arguments) for check_grads: ``layer(x, ids, w)`` in the call form, on
    global [R*T, ...] arrays, the ids fixed."""
    mesh = _mesh()
    sh = NamedSharding(mesh, P("ep"))
    flat = lambda a: a.reshape((R * a.shape[1],) + a.shape[2:])  # noqa: E731
    ids_d = jax.device_put(flat(ids), sh)
    if form == "shard_map":
        g = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    else:
        g = jax.jit(layer)
    f = lambda x, w: g(jax.reshard(x, sh), ids_d, jax.reshard(w, sh))  # noqa: E731
    return f, (jax.device_put(flat(x), sh), jax.device_put(flat(w), sh))


# ---------------------------------------------------------------- half precision combine

def _half_case(dtype, case):
    """(ids, x, w, E, T, H) of a combine case (test_combine_accumulates_half_precision_in_float32)."""
    if case in ("small", "special"):
        T, K, E, H = 6, 3, 16, 37 if case == "small" else 70  # H not a multiple of the vector width
        ids = routing(T, K, E, seed=50)
    else:
        T, K, E, H = 4, 12, 16, 4100
        ids = routing(T, K, E, seed=50, distinct=False)
        ids[:, 0, :6] = 0   # token 0: six slots on rank 0, the first rank it reaches
        ids[:, 1, 0] = 1    # token 1: one slot on rank 0, then six on rank 2
        ids[:, 1, 1:7] = 5
    rng = np.random.default_rng(51)
    x = rng.normal(size=(R, T, H)).astype(dtype)
    w = rng.random((R, T, K)).astype(np.float32)
    if case == "special":
        for col, v in enumerate([0.0, -0.0, np.inf, -np.inf, np.nan]):
            x[:, :, col::9] = v
        x[:, :, 5::9] = -0.0
        x[:, :, 7::9] = np.asarray([3e-6, -5e-7, 6e-8, 2e-5], np.float32)[rng.integers(0, 4, (R, T, 1))]
        x[:, ::2, 6::9] = 0.0       # every term of some columns a zero of either sign
        w[:, ::3, :] *= -1.0
        w[:, 1::4, 0] = 0.0
    return ids, x, w, E, T, H


def _dispatch_combine(E, expert_dtype=None):
    """dispatch then combine; the expert rows cast to `expert_dtype` first when given."""
    def f(x, ids, w):
        ex, _, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep")
        return ex, jaxcomm.moe.combine(ex if expert_dtype is None else ex.astype(expert_dtype), h, w)
    return f


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype,case", [(jnp.float32, "small"), (jnp.bfloat16, "small"),
                                        (jnp.float16, "small"), (jnp.bfloat16, "many_slots"),
                                        (jnp.float32, "special"), (jnp.bfloat16, "special"),
                                        (jnp.float16, "special")])
def test_combine_accumulates_half_precision_in_float32(dtype, case, form):
    """y equals the float32 sums in the kernels' order, rounded once to the token dtype.

    many_slots: tokens with several slots on one rank, on the first rank a token reaches
    and on later ones, and rows of 4100 columns (a tail after the host kernel's 16- or
    32-column blocks). special: zeros of both signs, infinities, NaNs and values that are
    subnormal in float16 in the expert rows, and negative and zero weights; compared bit
    for bit (signed zeros included), NaN where the reference has NaN."""
    ids, x, w, E, T, H = _half_case(dtype, case)
    ex, y = run(form, _dispatch_combine(E), x, ids, w)
    want_ex, _, row_of, _ = np_dispatch(x, ids, E)
    bits = np.uint16 if np.dtype(dtype).itemsize == 2 else np.uint32
    # Dispatch copies rows: the same bits, NaNs included (NumPy compares NaNs of ml_dtypes'
    # types as unequal before ml_dtypes 0.7).
    np.testing.assert_array_equal(ex.view(bits), want_ex.view(bits))
    assert y.dtype == np.dtype(dtype)
    with np.errstate(invalid="ignore"):  # inf * 0 in the special case
        want = np_combine_f32(want_ex, row_of, w, T, H, dtype)
    if case != "special":
        np.testing.assert_array_equal(y, want)
        return
    nan = np.isnan(want.astype(np.float32))
    zeros = want[~nan][want[~nan] == 0]
    assert nan.any() and np.signbit(zeros).any() and not np.signbit(zeros).all()
    np.testing.assert_array_equal(np.isnan(y.astype(np.float32)), nan)
    np.testing.assert_array_equal(y.view(bits)[~nan], want.view(bits)[~nan])


@pytest.mark.parametrize("case", ["small", "special", "many_slots"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_combine_in_streaming_stores_gives_the_same_bits(streaming_stores, dtype, case):
    """The combine written past the caches (the host kernel's streaming stores, which large
    results already in memory get) gives the NumPy reference's bits. Rows of 37 columns
    start off the stores' 16-byte alignment and take ordinary stores; of 4100, float32's all
    start on it and half precision's every other one."""
    ids, x, w, E, T, H = _half_case(dtype, case)
    y = np.asarray(run("shard_map", _dispatch_combine(E), x, ids, w)[1])
    want_ex, _, row_of, _ = np_dispatch(x, ids, E)
    with np.errstate(invalid="ignore"):  # inf * 0 in the special case
        want = np_combine_f32(want_ex, row_of, w, T, H, dtype)
    bits = np.uint16 if np.dtype(dtype).itemsize == 2 else np.uint32
    nan = np.isnan(want.astype(np.float32))
    assert nan.any() == (case == "special")
    np.testing.assert_array_equal(np.isnan(y.astype(np.float32)), nan)
    np.testing.assert_array_equal(y.view(bits)[~nan], want.view(bits)[~nan])


@pytest.fixture
def cpu_f16c():
    """Sets JAXCOMM_CPU_F16C for one test (jaxcomm._jaxcomm.set_cpu_f16c)."""
    from jaxcomm import _jaxcomm
    before = _jaxcomm.cpu_f16c()
    yield _jaxcomm.set_cpu_f16c
    _jaxcomm.set_cpu_f16c(before)


@pytest.mark.parametrize("case", ["small", "special", "many_slots"])
@pytest.mark.parametrize("tokens", [jnp.float16, jnp.float32])
def test_float16_combine_same_bits_with_and_without_f16c(cpu_f16c, tokens, case):
    """The combine's F16C kernels (moe_convert.h) and its portable ones give the same bits,
    NaNs included, for float16 expert rows and for float16 results of float32 rows: the
    suite's other float16 cases run whichever this CPU takes (F16C on x86-64 with AVX2)."""
    from jaxcomm import _jaxcomm
    ids, x, w, E, T, H = _half_case(tokens, case)
    # float32 tokens: float16 expert outputs combined into float32 results
    f = _dispatch_combine(E, jnp.float16 if tokens == jnp.float32 else None)
    got = {}
    for on in (True, False):
        cpu_f16c(on)
        got[on] = np.asarray(run("shard_map", f, x, ids, w)[1])
    assert got[False].dtype == np.dtype(jnp.float16) or tokens == jnp.float32
    np.testing.assert_array_equal(got[True].view(np.uint16 if got[True].itemsize == 2 else np.uint32),
                                  got[False].view(np.uint16 if got[False].itemsize == 2 else np.uint32))
    if case == "special":
        assert np.isnan(got[False].astype(np.float32)).any()
    if not _jaxcomm.has_f16c_kernels():
        pytest.skip("this build or CPU has no F16C kernels: only the portable ones ran")


def test_half_precision_combine_gradients():
    """combine's transposes on bfloat16 rows: towards expert_y a scaled dispatch of the
    cotangent (rounded once), towards the weights float32 dot products."""
    T, K, E, H = 4, 3, 16, 20
    ids, x, w, ct = _bf16_case(T, K, E, H, seed=52)

    def f(x, ids, w, ct):
        ex, _, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep")
        _, pull = jax.vjp(lambda ey, w: jaxcomm.moe.combine(ey, h, w), ex, w)
        d_ey, d_w = pull(ct)
        d_x = jax.grad(lambda v: jnp.sum(jaxcomm.moe.dispatch(v, ids, num_experts=E, axis_name="ep")[0]
                                         .astype(jnp.float32) * d_ey.astype(jnp.float32)))(x)
        return d_ey, d_w, d_x

    d_ey, d_w, d_x = per_device(f, _mesh(), x, ids, w, ct)
    want_ex, _, row_of, _ = np_dispatch(x, ids, E)
    want_ey = np.zeros(want_ex.shape, np.float32)
    want_w = np.zeros_like(w)
    for (s, t, k), (d, row) in row_of.items():
        want_ey[d, row] = np.float32(w[s, t, k]) * ct[s, t].astype(np.float32)
        want_w[s, t, k] = want_ex[d, row].astype(np.float64) @ ct[s, t].astype(np.float64)
    assert d_ey.dtype == jnp.bfloat16 and d_x.dtype == jnp.bfloat16
    np.testing.assert_array_equal(d_ey, want_ey.astype(jnp.bfloat16))
    np.testing.assert_allclose(d_w, want_w, rtol=1e-5, atol=1e-5)
    # dispatch's transpose sums each token's rows: here d_ey's, back to x's dtype.
    np.testing.assert_array_equal(d_x, np_combine_f32(d_ey, row_of, np.ones_like(w), T, H, jnp.bfloat16))


# ---------------------------------------------------------------- low-latency layout

@pytest.mark.parametrize("form", FORMS)
def test_low_latency_layout_and_combine(form):
    T, K, E, H, MAX = 5, 3, 16, 4, 7
    ids = routing(T, K, E, seed=54)
    x = tagged_x(T, H)
    w = np.random.default_rng(55).random((R, T, K)).astype(np.float32)

    def f(x, ids, w):
        ex, counts, h = jaxcomm.moe.dispatch_low_latency(x, ids, num_experts=E, axis_name="ep",
                                                         max_tokens=MAX)
        return ex, counts, jaxcomm.moe.combine_low_latency(2.0 * ex + 1.0, h, w), h.dropped, h.invalid

    ex, counts, y, dropped, invalid = run(form, f, x, ids, w)
    want_ex, want_sizes, row_of, _ = np_dispatch(x, ids, E, padded=True, slab=R * MAX)
    assert ex.shape == (R, E // R, R * MAX, H)
    np.testing.assert_array_equal(counts, want_sizes)
    np.testing.assert_array_equal(_ll_valid(ex, counts), want_ex)
    assert not dropped.any() and not invalid.any()
    np.testing.assert_allclose(y, np_combine(2.0 * want_ex + 1.0, row_of, w, T, H), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_low_latency_decode_loop_matches_numpy_every_step(dtype):
    """Steps of a `lax.scan` decode loop, each with its own routing: XLA reuses the
    low-latency result from step to step, so the rows past this step's counts hold the
    last step's rows (and the dispatch skips prefaulting pages already in memory). Rows of
    4 KiB or more (H=1024 in float32) make each expert's run whole pages."""
    S, T, K, E, H, MAX = 3, 16, 4, 16, 1024, 16
    rng = np.random.default_rng(60)
    ids = np.stack([routing(T, K, E, seed=61 + s, p_none=0.3 * s) for s in range(S)], axis=1)
    ids[:, 2, :, 0] = 0  # step 2: expert 0 takes more rows than in the steps before
    x = rng.normal(size=(R, S, T, H)).astype(dtype)
    w = rng.random((R, S, T, K)).astype(np.float32)

    def f(x, ids, w):
        def step(carry, xs):
            x, ids, w = xs
            ex, counts, h = jaxcomm.moe.dispatch_low_latency(x, ids, num_experts=E, axis_name="ep",
                                                             max_tokens=MAX)
            return carry, (counts, jaxcomm.moe.combine_low_latency(2.0 * ex + 1.0, h, w))
        return jax.lax.scan(step, 0, (x, ids, w))[1]

    counts, y = per_device(f, _mesh(), x, ids, w)
    for s in range(S):
        want_ex, want_sizes, row_of, _ = np_dispatch(x[:, s].astype(np.float32), ids[:, s], E, padded=True,
                                                    slab=R * MAX)
        np.testing.assert_array_equal(counts[:, s], want_sizes, err_msg=f"step {s}")
        want = np_combine(2.0 * want_ex + 1.0, row_of, w[:, s], T, H)
        tol = 1e-5 if dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(np.asarray(y[:, s], np.float32), want, rtol=tol, atol=tol,
                                   err_msg=f"step {s}")


@pytest.mark.parametrize("form", FORMS)
def test_low_latency_gradients(form):
    """Forward and reverse mode to second order; the rows past the counts, whatever they
    hold, never reach the result or the gradients."""
    T, K, E, H, MAX = 3, 2, 16, 2, 4
    ids = routing(T, K, E, seed=56, p_none=0.2)
    rng = np.random.default_rng(57)
    x = rng.normal(size=(R, T, H)).astype(np.float32)
    w = rng.random((R, T, K)).astype(np.float32)
    scale = (1.0 + np.arange(E // R, dtype=np.float32))[:, None, None]
    # Global view: expert_x [R*E_local, S, H], rank blocks one after another.
    scale_of = jnp.asarray(scale if form == "shard_map" else np.tile(scale, (R, 1, 1)))

    def layer(x, ids, w):
        ex, counts, h = jaxcomm.moe.dispatch_low_latency(x, ids, num_experts=E, axis_name="ep",
                                                         max_tokens=MAX)
        return jaxcomm.moe.combine_low_latency(jnp.tanh(ex) * scale_of, h, w)

    f, args = _differentiable(form, layer, x, ids, w)
    want_ex, _, row_of, _ = np_dispatch(x, ids, E, padded=True, slab=R * MAX)
    want = np_combine(np.tanh(want_ex) * scale, row_of, w, T, H)
    np.testing.assert_allclose(np.asarray(f(*args)).reshape(R, T, H), want, rtol=1e-5, atol=1e-6)
    jtu.check_grads(f, args, order=2 if form == "shard_map" else 1, modes=["fwd", "rev"],
                    atol=2e-2, rtol=2e-2)


def test_low_latency_on_the_composed_transport(monkeypatch):
    """JAXCOMM_BACKEND=xla: the same layout (there the rows past the counts are zero)."""
    monkeypatch.setenv("JAXCOMM_BACKEND", "xla")
    T, K, E, H, MAX = 4, 2, 16, 3, 6
    ids = routing(T, K, E, seed=58)
    x = tagged_x(T, H)
    w = np.random.default_rng(59).random((R, T, K)).astype(np.float32)

    def f(x, ids, w):
        ex, counts, h = jaxcomm.moe.dispatch_low_latency(x, ids, num_experts=E, axis_name="ep",
                                                         max_tokens=MAX)
        return ex, counts, jaxcomm.moe.combine_low_latency(ex, h, w)

    ex, counts, y = per_device(f, _mesh(), x, ids, w)
    want_ex, want_sizes, row_of, _ = np_dispatch(x, ids, E, padded=True, slab=R * MAX)
    np.testing.assert_array_equal(ex, want_ex)
    np.testing.assert_array_equal(counts, want_sizes)
    np.testing.assert_allclose(y, np_combine(want_ex, row_of, w, T, H), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- FP8

@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype,layout", [(jnp.bfloat16, "packed"), (jnp.float32, "padded"),
                                          (jnp.float16, "low_latency")])
def test_fp8_dispatch_matches_numpy_quantization(dtype, layout, form):
    """Both deliveries, bit for bit: "raw" (values, scales) rows are the NumPy quantization's
    rows; "dequantize" rows are values * scales rounded to x's dtype."""
    T, K, E, H = 4, 3, 16, 300  # three scale blocks, the last one short
    ids = routing(T, K, E, seed=60)
    x = (np.random.default_rng(61).normal(size=(R, T, H)) * np.geomspace(1e-3, 1e2, H)).astype(dtype)
    disp = {"packed": jaxcomm.moe.dispatch, "padded": jaxcomm.moe.dispatch_padded,
            "low_latency": lambda *a, **k: jaxcomm.moe.dispatch_low_latency(*a, max_tokens=T, **k)}[layout]

    def f(x, ids):
        (q, s), counts, _ = disp(x, ids, num_experts=E, axis_name="ep", fp8="raw")
        deq, _, _ = disp(x, ids, num_experts=E, axis_name="ep", fp8="dequantize")
        plain, _, _ = disp(x, ids, num_experts=E, axis_name="ep")
        return q.view(jnp.uint8), s, deq, plain, counts

    q, s, deq, plain, counts = run(form, f, x, ids)
    ref_q, ref_s = np_quantize_fp8(x.astype(np.float32))
    padded = layout != "packed"
    want_q, sizes, _, _ = np_dispatch(ref_q.view(np.uint8), ids, E, padded=padded)
    want_s, _, _, _ = np_dispatch(ref_s, ids, E, padded=padded)
    want_plain, _, _, _ = np_dispatch(x, ids, E, padded=padded)
    mask = (lambda a: _ll_valid(a, counts)) if layout == "low_latency" else (lambda a: a)
    np.testing.assert_array_equal(counts, sizes)
    np.testing.assert_array_equal(mask(q), want_q)
    np.testing.assert_array_equal(mask(s), want_s)
    want_deq = np_dequantize_fp8(want_q.view(ml_dtypes.float8_e4m3fn), want_s, dtype)
    np.testing.assert_array_equal(mask(deq), want_deq)
    # Within FP8's rounding of the unquantized rows: 3 mantissa bits (relative 2^-4), and
    # below the smallest normal an absolute step of 2^-9 scales; plus the dtype's rounding.
    err = np.abs(mask(deq).astype(np.float32) - want_plain.astype(np.float32))
    step = np.repeat(want_s, 128, axis=-1)[..., :H] * 2.0 ** -9
    bound = np.abs(want_plain.astype(np.float32)) * (2.0 ** -4 + 2.0 * jnp.finfo(dtype).eps) + step
    assert (err <= bound).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_dispatch_of_non_finite_tokens_matches_numpy(dtype):
    """A block holding a NaN or an infinity quantizes as NumPy's formula does (its amax is
    not finite): NaN codes (0x7F, 0xFF) and a NaN or infinite scale, dequantized to NaN;
    the token's other blocks, and signed zeros, stay exact. Covers the NaN entries of the
    dequantizing lookup and the quantizer's saturation and NaN paths."""
    T, K, E, H = 3, 2, 16, 384  # three full scale blocks
    ids = routing(T, K, E, seed=63, p_none=0.0)
    x = np.random.default_rng(64).normal(size=(R, T, H)).astype(np.float32)
    x[:, 0, 5] = np.nan          # token 0, block 0
    x[:, 1, 200] = np.inf        # token 1, block 1
    x[:, 1, 300] = -np.inf       # token 1, block 2
    x[:, 2, :128] = 0.0          # token 2, block 0: zeros of both signs, amax at its floor
    x[:, 2, 1:128:2] = -0.0
    x = x.astype(dtype)

    def f(x, ids):
        (q, s), _, _ = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep", fp8="raw")
        deq, _, _ = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep", fp8="dequantize")
        return q.view(jnp.uint8), s, deq

    q, s, deq = run("shard_map", f, x, ids)
    with np.errstate(invalid="ignore"):  # inf * 0 and NaN * x: the cases under test
        ref_q, ref_s = np_quantize_fp8(x.astype(np.float32))
        want_q, _, _, _ = np_dispatch(ref_q.view(np.uint8), ids, E)
        want_s, _, _, _ = np_dispatch(ref_s, ids, E)
        want_deq = np_dequantize_fp8(want_q.view(ml_dtypes.float8_e4m3fn), want_s, dtype)
    bits = np.uint16 if jnp.dtype(dtype).itemsize == 2 else np.uint32
    nan_codes = (want_q & 0x7F) == 0x7F
    assert nan_codes.any() and np.isnan(want_deq.astype(np.float32)).any()
    np.testing.assert_array_equal(q, want_q)  # NaN codes are bytes: compared as they are
    np.testing.assert_array_equal(np.isnan(s), np.isnan(want_s))
    np.testing.assert_array_equal(s[~np.isnan(s)], want_s[~np.isnan(want_s)])
    nan = np.isnan(want_deq.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(deq.astype(np.float32)), nan)
    np.testing.assert_array_equal(deq.view(bits)[~nan], want_deq.view(bits)[~nan])
    assert np.signbit(want_deq[~nan][want_deq[~nan] == 0]).any()


def test_fp8_gradient_is_the_combine_of_the_cotangent():
    """Straight through: the FP8 dispatch's VJP and JVP equal the unquantized dispatch's."""
    T, K, E, H = 4, 2, 16, 130
    ids, x, w, ct = _bf16_case(T, K, E, H, seed=62)

    def f(x, ids, w, ct):
        def loss(x, fp8):
            ex, _, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep", fp8=fp8)
            return jnp.sum(jaxcomm.moe.combine(ex * 2, h, w).astype(jnp.float32) * ct.astype(jnp.float32))
        disp = lambda fp8: lambda v: jaxcomm.moe.dispatch(v, ids, num_experts=E, axis_name="ep", fp8=fp8)[0]  # noqa: E731
        return (jax.grad(loss)(x, "dequantize"), jax.grad(loss)(x, None),
                jax.jvp(disp("dequantize"), (x,), (ct,))[1], jax.jvp(disp(None), (x,), (ct,))[1])

    g8, g, t8, t = per_device(f, _mesh(), x, ids, w, ct)
    np.testing.assert_array_equal(g8, g)
    np.testing.assert_array_equal(t8, t)
    np.testing.assert_array_equal(t8, np_dispatch(ct, ids, E)[0])  # the cotangent's rows, moved
    _, _, row_of, _ = np_dispatch(x, ids, E)
    want = np.zeros((R, T, H), np.float32)
    for (s, tk, k), _ in row_of.items():
        want[s, tk] += 2 * w[s, tk, k] * ct[s, tk].astype(np.float32)
    np.testing.assert_allclose(g8.astype(np.float32), want, rtol=2e-2, atol=2e-2)


def test_fp8_on_the_composed_transport(monkeypatch):
    """JAXCOMM_BACKEND=xla quantizes in jax.numpy: the same bits."""
    monkeypatch.setenv("JAXCOMM_BACKEND", "xla")
    T, K, E, H = 3, 2, 16, 140
    ids = routing(T, K, E, seed=64)
    x = np.random.default_rng(65).normal(size=(R, T, H)).astype(jnp.bfloat16)

    def f(x, ids):
        (q, s), _, _ = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep", fp8="raw")
        deq, _, _ = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep", fp8="dequantize")
        return q.view(jnp.uint8), s, deq

    q, s, deq = per_device(f, _mesh(), x, ids)
    ref_q, ref_s = np_quantize_fp8(x.astype(np.float32))
    want_q, _, _, _ = np_dispatch(ref_q.view(np.uint8), ids, E)
    want_s, _, _, _ = np_dispatch(ref_s, ids, E)
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(s, want_s)
    np.testing.assert_array_equal(deq, np_dequantize_fp8(want_q.view(ml_dtypes.float8_e4m3fn), want_s,
                                                         jnp.bfloat16))


# ---------------------------------------------------------------- split phase

def _split_layer(layout, E, MAX, fp8=None):
    """(fused, split) versions of one layer; both return (expert_x, counts, y, dropped)."""
    kw = dict(num_experts=E, axis_name="ep", fp8=fp8)
    fused_disp = {"packed": jaxcomm.moe.dispatch, "padded": jaxcomm.moe.dispatch_padded,
                  "low_latency": lambda *a, **k: jaxcomm.moe.dispatch_low_latency(*a, max_tokens=MAX, **k)}
    fused_comb = {"packed": jaxcomm.moe.combine, "padded": jaxcomm.moe.combine_padded,
                  "low_latency": jaxcomm.moe.combine_low_latency}

    def fused(x, ids, w):
        ex, counts, h = fused_disp[layout](x, ids, **kw)
        return ex, counts, fused_comb[layout](jnp.sin(ex), h, w) + jnp.cos(x), h.dropped

    def split(x, ids, w):
        pending = jaxcomm.moe.dispatch_send(x, ids, layout=layout, max_tokens=MAX, **kw)
        c = jnp.cos(x)  # independent work between the halves
        ex, counts, h = jaxcomm.moe.dispatch_recv(pending)
        pending = jaxcomm.moe.combine_send(jnp.sin(ex), h, w)
        return ex, counts, jaxcomm.moe.combine_recv(pending) + c, h.dropped
    return fused, split


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layout,fp8", [("packed", None), ("padded", None), ("low_latency", "dequantize")])
def test_split_phase_equals_fused(layout, fp8, form):
    T, K, E, H, MAX = 5, 3, 16, 6, 5
    ids = routing(T, K, E, seed=66)
    x = tagged_x(T, H)
    w = np.random.default_rng(67).random((R, T, K)).astype(np.float32)
    fused, split = _split_layer(layout, E, MAX, fp8)
    want = list(run(form, fused, x, ids, w))
    got = list(run(form, split, x, ids, w))
    if layout == "low_latency":
        want[0], got[0] = _ll_valid(want[0], want[1]), _ll_valid(got[0], got[1])
    for g, v in zip(got, want):
        np.testing.assert_array_equal(g, v)
    padded = layout != "packed"
    want_ex, _, row_of, _ = np_dispatch(x, ids, E, padded=padded, slab=R * MAX if padded else None)
    if fp8 is None:
        np.testing.assert_array_equal(got[0], want_ex)
        np.testing.assert_allclose(got[2], np_combine(np.sin(want_ex), row_of, w, T, H) + np.cos(x),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", FORMS)
def test_split_phase_gradients(form):
    T, K, E, H = 3, 2, 8, 2
    ids = routing(T, K, E, seed=68, p_none=0.2)
    rng = np.random.default_rng(69)
    x = rng.normal(size=(R, T, H)).astype(np.float32)
    w = rng.random((R, T, K)).astype(np.float32)
    _, split = _split_layer("padded", E, None)
    f, args = _differentiable(form, lambda x, ids, w: split(x, ids, w)[2], x, ids, w)
    want_ex, _, row_of, _ = np_dispatch(x, ids, E, padded=True)
    np.testing.assert_allclose(np.asarray(f(*args)).reshape(R, T, H),
                               np_combine(np.sin(want_ex), row_of, w, T, H) + np.cos(x), rtol=1e-5, atol=1e-6)
    jtu.check_grads(f, args, order=2 if form == "shard_map" else 1, modes=["fwd", "rev"],
                    atol=2e-2, rtol=2e-2)


def test_split_phase_leaves_work_between_the_halves():
    """The compiled schedule runs the independent matmul between the dispatch's send and
    receive halves (XLA is free to hoist it; it does not)."""
    T, K, E, H = 8, 2, 16, 64
    mesh = _mesh()

    def step(x, ids, w1):
        pending = jaxcomm.moe.dispatch_send(x, ids, num_experts=E, axis_name="ep")
        shared = x @ w1
        ex, _, h = jaxcomm.moe.dispatch_recv(pending)
        return jaxcomm.moe.combine(ex, h, jnp.ones(ids.shape, jnp.float32)) + shared

    sh, rep = NamedSharding(mesh, P("ep")), NamedSharding(mesh, P())
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("ep"), P("ep"), P()), out_specs=P("ep")))
    args = (jax.ShapeDtypeStruct((R * T, H), jnp.float32, sharding=sh),
            jax.ShapeDtypeStruct((R * T, K), jnp.int32, sharding=sh),
            jax.ShapeDtypeStruct((H, H), jnp.float32, sharding=rep))
    entry = f.lower(*args).compile().as_text().split("ENTRY")[1]
    order = [m.group(1) or "dot" for m in re.finditer(
        r'custom_call_target="jaxcomm_(moe_dispatch|moe_recv)"|jit\(step\)/shard_map/(dot_general)', entry)]
    send, recv = order.index("moe_dispatch"), order.index("moe_recv")
    assert "dot" in order[send + 1:recv], order


def test_split_send_returns_before_its_peers_arrive(tmp_path):
    """Rank 3 never joins the send's round: every rank, rank 3 included, still runs the work
    between the halves, and the receive half fails at the round's deadline naming rank 3."""
    script = textwrap.dedent("""
        # 8 CPU devices: the session's XLA_FLAGS and JAX_PLATFORMS (tests/conftest.py).
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import jaxcomm
        from jaxcomm._src.moe import fused

        passed = set()
        mesh = jax.make_mesh((8,), ("ep",))

        def step(x, ids):
            # The fused primitive's send half, so that the callback can depend on its result:
            # the FP8 values it quantized before returning (the receive half only reads them).
            ex, route, q, s = fused.dispatch(x, ids, "ep", num_experts=16, ranks=8, rows=64, slab=0,
                                             fp8=fused.FP8_DEQUANTIZED, split=True)
            def note(r, _):
                passed.add(int(r))
                return np.int32(0)
            # The receive half keeps the callback's result alive: the callback runs before it.
            token = jax.pure_callback(note, jax.ShapeDtypeStruct((), jnp.int32), jax.lax.axis_index("ep"),
                                      q[:1])
            data, table = fused.recv(ex, route, [x, ids, q, s, token], "ep",
                                     fused=fused.fused_key("dispatch", El=2, fp8=1, rows=64, zero_unused=True))
            return data

        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep")))
        sh = NamedSharding(mesh, P("ep"))
        try:
            jax.block_until_ready(f(jax.device_put(np.ones((32, 4), np.float32), sh),
                                    jax.device_put(np.zeros((32, 2), np.int32), sh)))
            print("NO ERROR")
        except Exception as e:
            print("ERROR", str(e).splitlines()[0][:400])
        print("PASSED", sorted(passed))
    """)
    env = dict(os.environ, JAXCOMM_FAULT="rank=3,op=moe_dispatch_send,action=hang", JAXCOMM_TIMEOUT_S="3")
    # tests/ as the working directory: the jaxcomm this test imported, never a source tree.
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    out = proc.stdout
    assert "PASSED [0, 1, 2, 3, 4, 5, 6, 7]" in out, out + proc.stderr
    assert "ERROR" in out and "moe_dispatch_send" in out and "[3]" in out, out + proc.stderr


def test_split_phase_misuse():
    mesh = _mesh()
    sh = NamedSharding(mesh, P("ep"))
    x = jax.device_put(jnp.zeros((R * 2, 4), jnp.float32), sh)
    ids = jax.device_put(jnp.zeros((R * 2, 2), jnp.int32), sh)
    with pytest.raises(TypeError, match="under jax.jit"):
        jaxcomm.moe.dispatch_send(x, ids, num_experts=8, axis_name="ep")

    def twice(x, ids):
        pending = jaxcomm.moe.dispatch_send(x, ids, num_experts=8, axis_name="ep")
        jaxcomm.moe.dispatch_recv(pending)
        return jaxcomm.moe.dispatch_recv(pending)[0]

    def swapped(x, ids):
        pending = jaxcomm.moe.dispatch_send(x, ids, num_experts=8, axis_name="ep")
        return jaxcomm.moe.combine_recv(pending)

    def vmapped(x, ids):
        def one(x, ids):
            return jaxcomm.moe.dispatch_recv(jaxcomm.moe.dispatch_send(x, ids, num_experts=8,
                                                                       axis_name="ep"))[0]
        return jax.vmap(one)(x[None], ids[None])[0]

    for body, err, match in [(twice, ValueError, "already received"),
                             (swapped, TypeError, "expects what combine_send returned"),
                             (vmapped, NotImplementedError, "vmap")]:
        g = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep")))
        with pytest.raises(err, match=match):
            g.lower(x, ids)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("backend", ["jaxcomm", "xla"])
def test_check_ids_raises_on_out_of_range_ids(backend, monkeypatch):
    monkeypatch.setenv("JAXCOMM_BACKEND", backend)
    T, K, E, H = 3, 2, 16, 2
    ids = routing(T, K, E, seed=70)
    ids[2, 1, 0] = 99
    x = tagged_x(T, H)

    def f(check):
        return lambda x, ids: jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep",
                                                   check_ids=check)[1]

    # Without the check: counted (test_moe) and dropped, the call succeeds.
    assert per_device(f(False), _mesh(), x, ids).sum() == (ids[(ids >= 0) & (ids < E)]).size
    with pytest.raises(Exception, match=re.escape("expert id 99 of token 1, slot 0 on rank 2 is outside "
                                                  "[-1, 16) (check_ids=True)")):
        per_device(f(True), _mesh(), x, ids)


def test_bad_input_trace_time_errors():
    mesh = _mesh()

    def call(body, dtype=np.float32, T=9):
        g = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep")))
        sh = NamedSharding(mesh, P("ep"))
        return g.lower(jax.ShapeDtypeStruct((R * T, 4), dtype, sharding=sh),
                       jax.ShapeDtypeStruct((R * T, 2), jnp.int32, sharding=sh))

    ll = lambda **kw: lambda x, ids: jaxcomm.moe.dispatch_low_latency(  # noqa: E731
        x, ids, num_experts=16, axis_name="ep", **kw)[1]
    with pytest.raises(ValueError, match="9 tokens per rank is more than the declared max_tokens=8"):
        call(ll(max_tokens=8))
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        call(ll(max_tokens=0))
    fp8 = lambda x, ids: jaxcomm.moe.dispatch(x, ids, num_experts=16, axis_name="ep", fp8="dequantize")[1]  # noqa: E731
    with pytest.raises(TypeError, match="FP8 dispatch quantizes float32, bfloat16 or float16 tokens, got int32"):
        call(fp8, dtype=np.int32)
    with pytest.raises(ValueError, match="fp8 must be None, 'dequantize' or 'raw'"):
        call(lambda x, ids: jaxcomm.moe.dispatch(x, ids, num_experts=16, axis_name="ep", fp8="e5m2")[1])
    raw = lambda x, ids: jax.grad(lambda v: jaxcomm.moe.dispatch(  # noqa: E731
        v, ids, num_experts=16, axis_name="ep", fp8="raw")[0][1].sum())(x)
    with pytest.raises(TypeError, match="not differentiable"):
        call(raw)
    with pytest.raises(ValueError, match="layout must be"):
        call(lambda x, ids: jaxcomm.moe.dispatch_send(x, ids, num_experts=16, axis_name="ep",
                                                      layout="ragged"))


# ---------------------------------------------------------------- across processes

SPLIT_ACROSS_PROCESSES = """
R = NPROC * LOCAL
T, K, E, H = 4, 2, 4 * R, 160
mesh = Mesh(np.asarray(jax.devices()), ("ep",))
sh = NamedSharding(mesh, P("ep"))
rng = np.random.default_rng(0)
ids = np.stack([rng.choice(E, K, replace=False) for _ in range(R * T)]).astype(np.int32)
x = rng.normal(size=(R * T, H)).astype(np.float32)
w = rng.random((R * T, K)).astype(np.float32)
put = lambda a: jax.make_array_from_callback(a.shape, sh, lambda i: a[i])

def split(x, ids, w):
    pending = jaxcomm.moe.dispatch_send(x, ids, num_experts=E, axis_name="ep", layout="low_latency",
                                        max_tokens=T, fp8="dequantize")
    ex, counts, h = jaxcomm.moe.dispatch_recv(pending)
    pending = jaxcomm.moe.combine_send(ex * 2, h, w)
    return jaxcomm.moe.combine_recv(pending)

def fused(x, ids, w):
    ex, counts, h = jaxcomm.moe.dispatch_low_latency(x, ids, num_experts=E, axis_name="ep",
                                                     max_tokens=T, fp8="dequantize")
    return jaxcomm.moe.combine_low_latency(ex * 2, h, w)

run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))(
    put(x), put(ids), put(w))
ys, yf = run(split), run(fused)
want = 2 * x * w.sum(1, keepdims=True)
for a, b in zip(ys.addressable_shards, yf.addressable_shards):
    np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    np.testing.assert_allclose(np.asarray(a.data), want[a.index], rtol=0.15, atol=0.15)
print("CHECKED split-phase low-latency FP8 across processes", flush=True)

# bfloat16 tokens through the packed layout: combine sums every slot's row, weighted, in
# float32 and rounds once to bfloat16 (each row doubled: exact in bfloat16).
def packed(x, ids, w):
    ex, sizes, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep")
    return jaxcomm.moe.combine(ex * 2, h, w)

xb = x.astype(jnp.bfloat16)
yb = jax.jit(jax.shard_map(packed, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))(
    put(xb), put(ids), put(w))
want = 2 * xb.astype(np.float64) * w.sum(1, keepdims=True)
for a in yb.addressable_shards:
    assert a.data.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(a.data, np.float64), want[a.index], rtol=2e-2, atol=2e-2)
print("CHECKED bfloat16 combine across processes", flush=True)
"""


def test_split_low_latency_fp8_across_processes():
    """The halves' round crosses processes (shared memory): same values as the fused calls.
    In the same job, a bfloat16 combine across processes against NumPy."""
    from mp_util import assert_ok, run_script
    res = run_script(SPLIT_ACROSS_PROCESSES, 2, 2, timeout_s=180)
    assert_ok(res)
    for rank in range(2):
        assert "CHECKED split-phase" in res.output[rank], res.format()
        assert "CHECKED bfloat16 combine across processes" in res.output[rank], res.format()


@pytest.mark.parametrize("form", FORMS)
def test_paths_of_backends_without_the_host_dispatch(monkeypatch, form):
    """The Python side of the CUDA backend's path, run here on the host kernels: routing
    planned in XLA, FP8 quantized by the moe_fp8_quantize primitive (a kernel on CUDA, its
    jax.numpy form here) and dequantized by the GATHER_DEQUANT transports, the low-latency
    layout left unwritten past the counts (GATHER_SPARSE), the split halves through
    moe_transport_send / moe_recv, half precision combine, check_ids by callback.

    check_ids only inside shard_map: in the global view XLA:CPU runs the callback on the
    jaxcomm thread that completed the collective before it, where jaxlib's CPU callback
    handler crashed reading the execution context (a case only this CPU run of the CUDA
    path reaches: on the host backend the check is in the dispatch kernel)."""
    from jaxcomm._src.moe import fused
    monkeypatch.setattr(fused, "on_host", lambda: False)
    T, K, E, H, MAX = 4, 3, 16, 140, 5
    ids = routing(T, K, E, seed=72)
    x = np.random.default_rng(73).normal(size=(R, T, H)).astype(jnp.bfloat16)
    w = np.random.default_rng(74).random((R, T, K)).astype(np.float32)

    def f(x, ids, w):
        pending = jaxcomm.moe.dispatch_send(x, ids, num_experts=E, axis_name="ep", layout="low_latency",
                                            max_tokens=MAX, fp8="dequantize", check_ids=form == "shard_map")
        ex, counts, h = jaxcomm.moe.dispatch_recv(pending)
        y = jaxcomm.moe.combine_recv(jaxcomm.moe.combine_send(ex, h, w))
        packed, _, _ = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep", fp8="dequantize")
        (q, s), _, _ = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep", fp8="raw")
        return ex, counts, y, packed, q.view(jnp.uint8), s

    ex, counts, y, packed, q, s = run(form, f, x, ids, w)
    ref_q, ref_s = np_quantize_fp8(x.astype(np.float32))
    want_q, sizes, row_of, _ = np_dispatch(ref_q.view(np.uint8), ids, E, padded=True, slab=R * MAX)
    want_s, _, _, _ = np_dispatch(ref_s, ids, E, padded=True, slab=R * MAX)
    want_ex = np_dequantize_fp8(want_q.view(ml_dtypes.float8_e4m3fn), want_s, jnp.bfloat16)
    np.testing.assert_array_equal(counts, sizes)
    np.testing.assert_array_equal(_ll_valid(ex.astype(np.float32), counts), want_ex.astype(np.float32))
    np.testing.assert_array_equal(y, np_combine_f32(want_ex, row_of, w, T, H, jnp.bfloat16))
    packed_q, _, _, _ = np_dispatch(ref_q.view(np.uint8), ids, E)
    packed_s, _, _, _ = np_dispatch(ref_s, ids, E)
    np.testing.assert_array_equal(q, packed_q)
    np.testing.assert_array_equal(s, packed_s)
    # The packed layout's dequantizing gather writes zeros past the rows that arrive.
    want_packed = np_dequantize_fp8(packed_q.view(ml_dtypes.float8_e4m3fn), packed_s, jnp.bfloat16)
    np.testing.assert_array_equal(packed, want_packed)


@pytest.mark.parametrize("form", FORMS)
def test_planned_split_fp8_gradient_is_straight_through(monkeypatch, form):
    """On the CUDA backend's path, the split FP8 dispatch's derivative moves x's cotangent
    as the plain dispatch's does (a bfloat16 combine of it), whatever FP8 rounded."""
    from jaxcomm._src.moe import fused
    monkeypatch.setattr(fused, "on_host", lambda: False)
    T, K, E, H, MAX = 3, 2, 16, 130, 4
    ids, x, w, ct = _bf16_case(T, K, E, H, seed=75)

    def grads(split):
        def layer(x, ids, w):
            kw = dict(num_experts=E, axis_name="ep", layout="low_latency", max_tokens=MAX)
            if split:
                ex, _, h = jaxcomm.moe.dispatch_recv(jaxcomm.moe.dispatch_send(x, ids, fp8="dequantize", **kw))
            else:
                ex, _, h = jaxcomm.moe.dispatch_low_latency(x, ids, num_experts=E, axis_name="ep",
                                                            max_tokens=MAX)
            return jaxcomm.moe.combine_low_latency(ex * 2, h, w)
        f, args = _differentiable(form, layer, x, ids, w)
        ct_d = jax.device_put(ct.reshape(R * T, H), args[0].sharding)
        return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * ct_d.astype(jnp.float32)),
                                argnums=0))(*args)

    np.testing.assert_array_equal(np.asarray(grads(True), np.float32), np.asarray(grads(False), np.float32))


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_planned_fp8_raw_is_not_differentiable(monkeypatch, split):
    """fp8='raw' under jax.grad on the CUDA backend's path: the host dispatch's TypeError."""
    from jaxcomm._src.moe import fused
    monkeypatch.setattr(fused, "on_host", lambda: False)
    T, K, E, H = 2, 2, 16, 8
    ids, x, w, _ = _bf16_case(T, K, E, H, seed=76)

    def layer(x, ids, w):
        kw = dict(num_experts=E, axis_name="ep", fp8="raw")
        if split:
            (q, s), _, _ = jaxcomm.moe.dispatch_recv(jaxcomm.moe.dispatch_send(x, ids, **kw))
        else:
            (q, s), _, _ = jaxcomm.moe.dispatch(x, ids, **kw)
        return q.astype(jnp.float32)[:T] * s[:T, :1]

    f, args = _differentiable("shard_map", layer, x, ids, w)
    with pytest.raises(TypeError, match="fp8='raw'"):
        jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w)), argnums=0))(*args)
