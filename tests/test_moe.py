"""jaxcomm.moe dispatch/combine against a NumPy reference of the documented semantics."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import test_util as jtu
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from conftest import per_device
from example_util import run_example
from moe_reference import R, np_combine, np_combine_f32, np_dispatch, routing, tagged_x


def _mesh(r=R):
    return jax.make_mesh((r,), ("ep",), devices=jax.devices()[:r])


def per_rank(f, *args, r=R):
    """Rank k gets args[i][k]; returns f's outputs stacked over ranks (pytree)."""
    return per_device(f, _mesh(r), *args)


def run_moe(x, ids, w, E, capacity=None, padded=False, ey_fn=lambda e: 2.0 * e + 1.0):
    def f(x, ids, w):
        if padded:
            ex, sizes, h = jaxcomm.moe.dispatch_padded(x, ids, num_experts=E, axis_name="ep")
            y = jaxcomm.moe.combine_padded(ey_fn(ex), h, w)
        else:
            ex, sizes, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep", capacity=capacity)
            y = jaxcomm.moe.combine(ey_fn(ex), h, w)
        return ex, sizes, y, h.dropped, h.invalid, h.recv_dropped
    return per_rank(f, x, ids, w)


# ---------------------------------------------------------------------------- tests

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("padded", [False, True])
def test_dispatch_combine_match_numpy(padded, dtype):
    T, K, E, H = 6, 3, 16, 5
    ids = routing(T, K, E, seed=1)
    ids[2, 1, 0] = 99   # out of range: counted, treated as -1
    ids[5, 0, 2] = -7
    x = tagged_x(T, H).astype(jnp.dtype(dtype))
    w = np.random.default_rng(2).normal(size=(R, T, K)).astype(np.float32)
    # bfloat16: the expert is the identity, so that the reference has no bfloat16
    # arithmetic of XLA's to repeat.
    ey_fn = (lambda e: 2.0 * e + 1.0) if dtype == "float32" else (lambda e: e)
    ex, sizes, y, dropped, invalid, recv_dropped = run_moe(x, ids, w, E, padded=padded, ey_fn=ey_fn)
    clean = np.where((ids >= 0) & (ids < E), ids, -1)
    want_ex, want_sizes, row_of, want_dropped = np_dispatch(x, clean, E, padded=padded)
    np.testing.assert_array_equal(ex, want_ex)
    np.testing.assert_array_equal(sizes, want_sizes)
    # Per-expert counts equal the all-gathered (here: global) counts of the routing.
    np.testing.assert_array_equal(sizes.reshape(-1), np.bincount(clean[clean >= 0], minlength=E))
    np.testing.assert_array_equal(dropped, 0)
    np.testing.assert_array_equal(recv_dropped, 0)
    np.testing.assert_array_equal(invalid, [0, 0, 1, 0, 0, 1, 0, 0])
    if dtype == "float32":
        want_y = np_combine(2.0 * want_ex + 1.0, row_of, w, T, H)
        np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    else:
        # Summed in float32 in the kernel's order, rounded once to bfloat16: the same bits.
        assert y.dtype == x.dtype
        np.testing.assert_array_equal(y, np_combine_f32(want_ex, row_of, w, T, H, dtype=x.dtype))


def test_rows_identify_source_and_order():
    T, K, E, H = 5, 2, 8, 4
    ids = routing(T, K, E, seed=3)
    x = tagged_x(T, H)
    ex, sizes, *_ = run_moe(x, ids, np.ones((R, T, K), np.float32), E)
    for d in range(R):
        start = 0
        for el, n in enumerate(sizes[d]):
            rows = ex[d, start:start + n]
            src = list(zip(rows[:, 0].astype(int), rows[:, 1].astype(int)))
            assert src == sorted(src), "rows of one expert are ordered by (source, token)"
            for s, t in src:
                assert d * (E // R) + el in ids[s, t]
            start += n
        assert not ex[d, start:].any(), "rows past the total are zero"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_combine_of_dispatch_is_weighted_x(dtype):
    T, K, E, H = 7, 4, 32, 3
    ids = routing(T, K, E, seed=4, p_none=0.3)
    x = tagged_x(T, H, seed=5).astype(jnp.dtype(dtype))
    w = np.random.default_rng(6).random((R, T, K)).astype(np.float32)
    *_, y, _, _, _ = run_moe(x, ids, w, E, ey_fn=lambda e: e)
    want = x.astype(np.float64) * np.where(ids >= 0, w, 0).sum(-1, keepdims=True)
    assert y.dtype == x.dtype
    # bfloat16: one rounding of the float32 sum (2^-8 relative), of values up to ~10.
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=tol, atol=tol)


def test_small_capacity_drops_are_accounted():
    T, K, E, H, C = 6, 2, 8, 3, 5
    ids = routing(T, K, E, seed=7, p_none=0.0)
    x = tagged_x(T, H)
    w = np.random.default_rng(8).random((R, T, K)).astype(np.float32)
    ex, sizes, y, dropped, invalid, recv_dropped = run_moe(x, ids, w, E, capacity=C)
    want_ex, want_sizes, row_of, want_dropped = np_dispatch(x, ids, E, capacity=C)
    np.testing.assert_array_equal(ex, want_ex)
    np.testing.assert_array_equal(sizes, want_sizes)
    np.testing.assert_array_equal(dropped, want_dropped)
    assert dropped.sum() > 0
    assert recv_dropped.sum() == dropped.sum()
    assert (sizes.sum(1) <= C).all()
    np.testing.assert_allclose(y, np_combine(2.0 * want_ex + 1.0, row_of, w, T, H), rtol=1e-5, atol=1e-5)


def test_one_hot_expert_and_idle_ranks():
    T, K, E, H = 4, 2, 8, 3
    ids = np.full((R, T, K), -1, np.int32)
    ids[:, :, 0] = 0  # everything to expert 0 on rank 0; ranks 1.. receive nothing
    x = tagged_x(T, H)
    w = np.ones((R, T, K), np.float32)
    ex, sizes, y, dropped, *_ = run_moe(x, ids, w, E)
    want_ex, want_sizes, row_of, _ = np_dispatch(x, ids, E)
    np.testing.assert_array_equal(ex, want_ex)
    assert sizes[0, 0] == R * T and sizes.sum() == R * T
    assert not ex[1:].any()
    np.testing.assert_allclose(y, 2.0 * x + 1.0, rtol=1e-6)


def test_all_tokens_none():
    T, K, E, H = 3, 2, 8, 2
    ids = np.full((R, T, K), -1, np.int32)
    x = tagged_x(T, H)
    for padded in (False, True):
        ex, sizes, y, dropped, invalid, _ = run_moe(x, ids, np.ones((R, T, K), np.float32), E, padded=padded)
        assert not ex.any() and not sizes.any() and not y.any()
        assert not dropped.any() and not invalid.any()


def test_int64_ids_under_x64():
    T, K, E, H = 4, 2, 8, 3
    ids = routing(T, K, E, seed=9).astype(np.int64)
    ids[0, 0, 0] = 2**40  # would wrap to a valid id if cast to int32 first
    x = tagged_x(T, H).astype(np.float64)
    w = np.ones((R, T, K))
    with jax.enable_x64(True):
        ex, sizes, y, dropped, invalid, _ = run_moe(x, ids, w, E)
    clean = np.where((ids >= 0) & (ids < E), ids, -1)
    want_ex, want_sizes, row_of, _ = np_dispatch(x, clean, E)
    np.testing.assert_array_equal(ex, want_ex)
    assert invalid[0] == 1
    assert y.dtype == np.float64


@pytest.mark.parametrize("backend", ["jaxcomm", "xla"])
@pytest.mark.parametrize("padded", [False, True])
def test_gradients(padded, backend, monkeypatch):
    monkeypatch.setenv("JAXCOMM_BACKEND", backend)  # xla: the composed transport
    T, K, E, H = 3, 2, 8, 2
    ids = routing(T, K, E, seed=10, p_none=0.2)
    mesh = _mesh()
    sh = NamedSharding(mesh, P("ep"))
    rng = np.random.default_rng(11)
    x = rng.normal(size=(R, T, H)).astype(np.float32)
    w = rng.random((R, T, K)).astype(np.float32)
    El = E // R
    scale = jnp.asarray(1.0 + np.arange(El, dtype=np.float32))

    def body(x, ids, w):
        x, ids, w = x[0], ids[0], w[0]
        if padded:
            ex, _, h = jaxcomm.moe.dispatch_padded(x, ids, num_experts=E, axis_name="ep")
            y = jaxcomm.moe.combine_padded(jnp.tanh(ex) * scale[:, None, None], h, w)
        else:
            ex, sizes, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep")
            y = jaxcomm.moe.combine(jnp.tanh(ex) * 1.5, h, w)
        return y[None]

    g = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    ids_d = jax.device_put(ids, sh)
    f = lambda x, w: g(jax.reshard(x, sh), ids_d, jax.reshard(w, sh))
    # check_grads compares with f's own finite differences: f itself must be right too.
    want_ex, _, row_of, _ = np_dispatch(x, ids, E, padded=padded)
    want_ey = np.tanh(want_ex) * (np.asarray(scale)[None, :, None, None] if padded else 1.5)
    np.testing.assert_allclose(np.asarray(f(jax.device_put(x, sh), jax.device_put(w, sh))),
                               np_combine(want_ey, row_of, w, T, H), rtol=1e-5, atol=1e-6)
    # Forward and reverse mode, and reverse over reverse (the transports' transposes are
    # transports again, so second order needs no extra rule). The composed transport
    # (xla) to first order: its derivatives are ragged_all_to_all's, whose second order
    # test_ragged checks (its second order here compiled 20 programs: 26 s of CPU a case).
    jtu.check_grads(f, (jax.device_put(x, sh), jax.device_put(w, sh)),
                    order=2 if backend == "jaxcomm" else 1, modes=["fwd", "rev"],
                    atol=2e-2, rtol=2e-2)


def test_jvp_matches_linearity():
    """Tangents: dispatch is linear in x, combine bilinear in (expert_y, weights)."""
    T, K, E, H = 4, 3, 16, 3
    ids = routing(T, K, E, seed=30)
    rng = np.random.default_rng(31)
    x, dx = (rng.normal(size=(R, T, H)).astype(np.float32) for _ in range(2))
    w, dw = (rng.random((R, T, K)).astype(np.float32) for _ in range(2))

    def f(x, dx, ids, w, dw):
        d = lambda v: jaxcomm.moe.dispatch(v, ids, num_experts=E, axis_name="ep")
        (ex, _, h), (d_ex, _, _) = jax.jvp(d, (x,), (dx,))
        ey = jnp.sin(ex)
        y, d_y = jax.jvp(lambda ey, w: jaxcomm.moe.combine(ey, h, w), (ey, w),
                         (jnp.cos(ex) * d_ex, dw))
        return ex, d_ex, y, d_y

    ex, d_ex, y, d_y = per_rank(f, x, dx, ids, w, dw)
    want_ex, _, row_of, _ = np_dispatch(x, ids, E)
    want_dex, _, _, _ = np_dispatch(dx, ids, E)
    np.testing.assert_array_equal(ex, want_ex)
    np.testing.assert_array_equal(d_ex, want_dex)
    want_dy = (np_combine(np.cos(want_ex) * want_dex, row_of, w, T, H)
               + np_combine(np.sin(want_ex), row_of, dw, T, H))
    np.testing.assert_allclose(d_y, want_dy, rtol=1e-5, atol=1e-5)


def test_combine_gradient_wrt_expert_y():
    T, K, E, H = 3, 2, 8, 2
    ids = routing(T, K, E, seed=12)
    x = tagged_x(T, H)
    w = np.random.default_rng(13).random((R, T, K)).astype(np.float32)
    ct = np.random.default_rng(14).normal(size=(R, T, H)).astype(np.float32)

    def f(x, ids, w, ct):
        ex, _, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep")
        _, pull = jax.vjp(lambda ey, w: jaxcomm.moe.combine(ey, h, w), ex, w)
        return ex, *pull(ct)

    ex, d_ey, d_w = per_rank(f, x, ids, w, ct)
    _, _, row_of, _ = np_dispatch(x, ids, E)
    want_ey = np.zeros_like(ex)
    want_w = np.zeros_like(w)
    for (s, t, k), (d, row) in row_of.items():
        want_ey[d, row] += w[s, t, k] * ct[s, t]
        want_w[s, t, k] = ex[d, row] @ ct[s, t]
    np.testing.assert_allclose(d_ey, want_ey, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_w, want_w, rtol=1e-5, atol=1e-5)


def test_vmap():
    T, K, E, H, B = 3, 2, 8, 2, 2
    ids = np.stack([routing(T, K, E, seed=20 + b) for b in range(B)], axis=1)  # [R, B, T, K]
    x = np.random.default_rng(15).normal(size=(R, B, T, H)).astype(np.float32)
    w = np.random.default_rng(16).random((R, B, T, K)).astype(np.float32)

    def one(x, ids, w):
        ex, sizes, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep")
        return ex, sizes, jaxcomm.moe.combine(ex * 3.0, h, w)

    ex, sizes, y = per_rank(jax.vmap(one), x, ids, w)
    for b in range(B):
        want_ex, want_sizes, row_of, _ = np_dispatch(x[:, b], ids[:, b], E)
        np.testing.assert_array_equal(ex[:, b], want_ex)
        np.testing.assert_array_equal(sizes[:, b], want_sizes)
        np.testing.assert_allclose(y[:, b], np_combine(3.0 * want_ex, row_of, w[:, b], T, H),
                                   rtol=1e-5, atol=1e-5)


def test_xla_backend_fallback(monkeypatch):
    monkeypatch.setenv("JAXCOMM_BACKEND", "xla")
    T, K, E, H = 4, 2, 16, 3
    ids = routing(T, K, E, seed=17)
    x = tagged_x(T, H)
    w = np.random.default_rng(18).random((R, T, K)).astype(np.float32)
    ex, sizes, y, *_ = run_moe(x, ids, w, E, capacity=9)
    want_ex, want_sizes, row_of, _ = np_dispatch(x, ids, E, capacity=9)
    np.testing.assert_array_equal(ex, want_ex)
    np.testing.assert_allclose(y, np_combine(2.0 * want_ex + 1.0, row_of, w, T, H), rtol=1e-5, atol=1e-5)


def test_two_axis_mesh_over_ep():
    mesh = jax.make_mesh((2, 4), ("dp", "ep"))
    T, K, E, H = 3, 2, 8, 2
    rng = np.random.default_rng(19)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(8 * T)]).astype(np.int32)
    x = rng.normal(size=(8 * T, H)).astype(np.float32)
    spec = P(("dp", "ep"))

    def body(x, ids):
        ex, sizes, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep")
        return jaxcomm.moe.combine(ex, h, jnp.ones(ids.shape, jnp.float32))

    g = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    y = g(jax.device_put(x, NamedSharding(mesh, spec)), jax.device_put(ids, NamedSharding(mesh, spec)))
    np.testing.assert_allclose(np.asarray(y), x * K, rtol=1e-6)


def test_trace_time_errors():
    mesh = _mesh()

    def call(E=16, ids_dtype=np.int32, ids_shape=(2, 2), w_dtype=np.float32, capacity=None,
             x_dtype=np.float32, dispatch=jaxcomm.moe.dispatch):
        def body(x):
            ids = jnp.zeros(ids_shape, ids_dtype)
            ex, _, h = dispatch(x[0], ids, num_experts=E, axis_name="ep", capacity=capacity)
            return jaxcomm.moe.combine(ex, h, jnp.ones((2, 2), w_dtype))[None].astype(jnp.float32)
        g = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        return g(jax.device_put(np.zeros((R, 2, 3), x_dtype), NamedSharding(mesh, P("ep"))))

    with pytest.raises(ValueError, match="not divisible"):
        call(E=12)
    with pytest.raises(TypeError, match="integers"):
        call(ids_dtype=np.float32)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        call(ids_shape=(2,))
    with pytest.raises(TypeError, match="floating"):
        call(w_dtype=np.int32)
    with pytest.raises(ValueError, match="capacity"):
        call(capacity=0)
    # Tokens are floats (combine sums them, weighted): integer tokens are refused, in
    # every layout and call form.
    for x_dtype in (np.int32, np.uint8, np.bool_):
        with pytest.raises(TypeError, match=re.escape(
                f"jaxcomm.moe.dispatch: x (the tokens) must be floating point, got {np.dtype(x_dtype).name}")):
            call(x_dtype=x_dtype)
    with pytest.raises(TypeError, match=re.escape(
            "jaxcomm.moe.dispatch_padded: x (the tokens) must be floating point, got int32")):
        call(x_dtype=np.int32, dispatch=lambda *a, capacity, **k: jaxcomm.moe.dispatch_padded(*a, **k))
    sh = NamedSharding(mesh, P("ep"))
    with pytest.raises(TypeError, match=re.escape(
            "jaxcomm.moe.dispatch: x (the tokens) must be floating point, got int32")):
        jax.jit(lambda x, ids: jaxcomm.moe.dispatch(x, ids, num_experts=16, axis_name="ep")[0])(
            jax.device_put(np.zeros((R * 2, 3), np.int32), sh),
            jax.device_put(np.zeros((R * 2, 2), np.int32), sh))


def test_global_view_under_jit():
    mesh = _mesh()
    sh = NamedSharding(mesh, P("ep"))
    T, K, E, H = 3, 2, 16, 3
    ids = routing(T, K, E, seed=21)
    x = tagged_x(T, H)
    w = np.random.default_rng(22).random((R, T, K)).astype(np.float32)

    @jax.jit
    def f(x, ids, w):
        ex, sizes, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep")
        return ex, sizes, jaxcomm.moe.combine(ex * 2.0, h, w)

    args = [jax.device_put(a.reshape(R * T, -1), sh) for a in (x, ids, w)]
    with jax.set_mesh(mesh):
        compiled = f.lower(*args).compile()  # run and inspected: one compilation
        ex, sizes, y = compiled(*args)
        hlo = compiled.as_text()
        dx = jax.jit(jax.grad(lambda x: f(x, args[1], args[2])[2].sum()))(args[0])
    want_ex, want_sizes, row_of, _ = np_dispatch(x, ids, E)
    assert ex.shape == (R * want_ex.shape[1], H) and sizes.shape == (E,)
    assert ex.sharding.spec[0] == "ep"
    np.testing.assert_array_equal(np.asarray(ex).reshape(want_ex.shape), want_ex)
    np.testing.assert_array_equal(np.asarray(sizes).reshape(R, -1), want_sizes)
    np.testing.assert_allclose(np.asarray(y).reshape(R, T, H),
                               np_combine(2.0 * want_ex, row_of, w, T, H), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx).reshape(R, T, H),
                               np.broadcast_to(2.0 * np.where(ids >= 0, w, 0).sum(-1, keepdims=True),
                                               (R, T, H)), rtol=1e-5)
    assert "all-gather" not in hlo


def _no_allgather_of(hlo: str, dtype: str) -> bool:
    """Whether no all-gather in compiled HLO text produces an array of ``dtype`` (e.g. f32)."""
    return not re.search(rf"= {dtype}\[[^\]]*\][^ ]* all-gather\(", hlo)


@pytest.mark.parametrize("spec,axis_types,padded", [
    (P("ep"), "explicit", False),
    (P(("dp", "ep")), "explicit", False),
    (P(("dp", "ep")), "explicit", True),
    (P("ep"), "auto", False),
])
def test_global_view_without_set_mesh(spec, axis_types, padded):
    """pjit style: the mesh comes from the arguments' NamedSharding; results equal the
    shard_map form over the same dim-0 spec; x is never all-gathered; jvp and grad work."""
    kw = {} if axis_types == "explicit" else dict(axis_types=(jax.sharding.AxisType.Auto,) * 2)
    mesh = jax.make_mesh((2, 4), ("dp", "ep"), **kw)
    sh = NamedSharding(mesh, spec)
    T, K, E, H = 3, 2, 8, 4
    rng = np.random.default_rng(40)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(8 * T)]).astype(np.int32)
    ids[rng.random(ids.shape) < 0.1] = -1
    x = rng.normal(size=(8 * T, H)).astype(np.float32)
    w = rng.random((8 * T, K)).astype(np.float32)
    disp = jaxcomm.moe.dispatch_padded if padded else jaxcomm.moe.dispatch
    comb = jaxcomm.moe.combine_padded if padded else jaxcomm.moe.combine

    def layer(x, ids, w):
        ex, sizes, h = disp(x, ids, num_experts=E, axis_name="ep")
        return ex, sizes, comb(jnp.tanh(ex), h, w), h.dropped

    args = [jax.device_put(a, sh) for a in (x, ids, w)]
    glob = jax.jit(layer)
    compiled = glob.lower(*args).compile()  # run and inspected: one compilation
    ex, sizes, y, dropped = compiled(*args)
    want = jax.jit(jax.shard_map(lambda *a: (lambda e, s, y, d: (e, s, y, d[None]))(*layer(*a)),
                                 mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))(*args)
    for got, ref in zip((ex, sizes, y, dropped), want):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert ex.sharding.spec[0] == spec[0]
    np.testing.assert_allclose(np.asarray(y), np.tanh(x) * np.where(ids >= 0, w, 0).sum(1, keepdims=True),
                               rtol=1e-5, atol=1e-6)
    assert _no_allgather_of(compiled.as_text(), "f32")
    # The handle crosses programs: combine in a jit of its own, dispatch called eagerly.
    ex2, _, h2 = disp(args[0], args[1], num_experts=E, axis_name="ep")
    y2 = jax.jit(comb)(jnp.tanh(ex2), h2, args[2])
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))

    loss = lambda x, w: jnp.sum(glob(x, args[1], w)[2] ** 2)
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(args[0], args[2])
    y_np = np.asarray(y)
    want_dx = 2 * y_np * (1 - np.tanh(x) ** 2) * np.where(ids >= 0, w, 0).sum(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-4, atol=1e-5)
    want_dw = np.where(ids >= 0, (2 * y_np * np.tanh(x)).sum(1, keepdims=True), 0)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-4, atol=1e-5)
    _, t = jax.jit(lambda x, dx: jax.jvp(lambda v: glob(v, args[1], args[2])[2], (x,), (dx,)))(
        args[0], args[0])
    # tanh'(x) * x * sum of weights
    np.testing.assert_allclose(np.asarray(t), (1 - np.tanh(x) ** 2) * x * np.where(ids >= 0, w, 0).sum(
        1, keepdims=True), rtol=1e-4, atol=1e-5)


def test_moe_layer_example_runs():
    """The README's main command: the example checks itself against the dense reference."""
    stdout, losses = run_example("moe_layer.py", "--steps", "2")
    assert "match the dense reference" in stdout
    assert len(losses) == 2 and losses[1] < losses[0]


def test_global_view_int64_ids_under_x64():
    """The partitioner traces the per-rank code outside the caller's x64 context."""
    mesh = _mesh()
    sh = NamedSharding(mesh, P("ep"))
    T, K, E, H = 4, 2, 16, 3
    ids = routing(T, K, E, seed=41).astype(np.int64).reshape(R * T, K)
    ids[0, 0] = 2**40  # would wrap to a valid id if truncated to int32
    x = tagged_x(T, H).astype(np.float64).reshape(R * T, H)
    with jax.enable_x64(True):
        ex, sizes, h = jax.jit(lambda x, i: jaxcomm.moe.dispatch(x, i, num_experts=E, axis_name="ep"))(
            jax.device_put(x, sh), jax.device_put(ids, sh))
        invalid = np.asarray(h.invalid)
    clean = np.where((ids >= 0) & (ids < E), ids, -1).reshape(R, T, K)
    want_ex, want_sizes, _, _ = np_dispatch(x.reshape(R, T, H), clean, E)
    assert invalid.tolist() == [1] + [0] * (R - 1)
    assert ex.dtype == np.float64
    np.testing.assert_array_equal(np.asarray(ex).reshape(want_ex.shape), want_ex)
    np.testing.assert_array_equal(np.asarray(sizes).reshape(R, -1), want_sizes)
