"""jaxcomm ops under JAX transformations, against their jax.lax counterparts.

Every check compares jaxcomm with jax.lax under the same ``check_vma`` setting:
grad / jvp / linear_transpose / check_grads, vmap (inside and outside shard_map),
lax control flow (scan, fori_loop, cond), and the varying/invariant typing of results.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P
from jax.test_util import check_grads

import jaxcomm
from jaxcomm._src import compat

R = 8
# Auto axes: shard_map reshards its inputs itself, so the perturbed/derived inputs that
# transformations create (check_grads, vmap) need no explicit placement.
MESH = jax.make_mesh((R,), ("x",), axis_types=(AxisType.Auto,))
MESH2 = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(AxisType.Auto, AxisType.Auto))

RTOL = dict(rtol=1e-5, atol=1e-5)


def smap(body, in_specs=P("x"), out_specs=P("x"), check_vma=True, mesh=MESH):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=check_vma))


def data(shape, seed=0, lo=-1.0, hi=1.0):
    return np.random.default_rng(seed).uniform(lo, hi, size=shape).astype(np.float32)


def assert_close(a, b, **kw):
    tol = dict(RTOL)
    tol.update(kw)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), **tol),
                 a, b)


def lax_reverse(reverse, forward):
    """jax.lax's reverse-mode result; where jax.lax's own transpose rule is broken (jax
    0.10.2: untiled all_to_all with split_axis < concat_axis fails with "Expected
    cotangent type ..."), the same quantity computed in forward mode instead."""
    try:
        return reverse()
    except ValueError as e:
        if "Expected cotangent type" not in str(e):
            raise
        return forward()


def lax_broadcast(v, axis_name, root):
    is_root = lax.axis_index(axis_name) == root
    return lax.psum(jnp.where(is_root, v, jnp.zeros_like(v)), axis_name)


SHIFT = [(i, (i + 1) % R) for i in range(R)]
PARTIAL = [(0, 3), (3, 5), (5, 0), (2, 7)]  # ranks 1, 2, 4, 6 receive zeros

# ------------------------------------------------------------------------------------
# Linear ops: (id, local shape without the leading 1, jaxcomm body, lax body, out_specs
# allowed with check_vma=True). Bodies see the local block v of shape (1, *local).

LINEAR = [
    ("all_reduce_sum", (4, 3), lambda v: jaxcomm.all_reduce(v, "x"),
     lambda v: lax.psum(v, "x"), (P("x"), P())),
    ("all_reduce_mean", (4, 3), lambda v: jaxcomm.all_reduce(v, "x", op="mean"),
     lambda v: lax.pmean(v, "x"), (P("x"), P())),
    ("all_gather_untiled_0", (4, 3), lambda v: jaxcomm.all_gather(v, "x"),
     lambda v: lax.all_gather(v, "x"), (P("x"),)),
    ("all_gather_untiled_last", (4, 3), lambda v: jaxcomm.all_gather(v, "x", axis=-1),
     lambda v: lax.all_gather(v, "x", axis=3), (P("x"),)),
    ("all_gather_tiled_1", (4, 3), lambda v: jaxcomm.all_gather(v, "x", axis=1, tiled=True),
     lambda v: lax.all_gather(v, "x", axis=1, tiled=True), (P("x"),)),
    ("reduce_scatter_untiled", (8, 3), lambda v: jaxcomm.reduce_scatter(v, "x", scatter_dimension=1),
     lambda v: lax.psum_scatter(v, "x", scatter_dimension=1), (P("x"),)),
    ("reduce_scatter_tiled", (3, 16),
     lambda v: jaxcomm.reduce_scatter(v, "x", scatter_dimension=2, tiled=True),
     lambda v: lax.psum_scatter(v, "x", scatter_dimension=2, tiled=True), (P("x"),)),
    ("all_to_all_untiled", (8, 3), lambda v: jaxcomm.all_to_all(v, "x", 1, 2),
     lambda v: lax.all_to_all(v, "x", 1, 2), (P("x"),)),
    ("all_to_all_tiled_same", (16, 3), lambda v: jaxcomm.all_to_all(v, "x", 1, 1, tiled=True),
     lambda v: lax.all_to_all(v, "x", 1, 1, tiled=True), (P("x"),)),
    ("all_to_all_tiled_swap", (2, 16), lambda v: jaxcomm.all_to_all(v, "x", 2, 1, tiled=True),
     lambda v: lax.all_to_all(v, "x", 2, 1, tiled=True), (P("x"),)),
    ("ppermute_shift", (4, 3), lambda v: jaxcomm.ppermute(v, "x", SHIFT),
     lambda v: lax.ppermute(v, "x", SHIFT), (P("x"),)),
    ("ppermute_partial", (4, 3), lambda v: jaxcomm.ppermute(v, "x", PARTIAL),
     lambda v: lax.ppermute(v, "x", PARTIAL), (P("x"),)),
    ("broadcast_root3", (4, 3), lambda v: jaxcomm.broadcast(v, "x", root=3),
     lambda v: lax_broadcast(v, "x", 3), (P("x"), P())),
]
LINEAR_IDS = [c[0] for c in LINEAR]


def _linear_settings():
    for check_vma in (True, False):
        for spec in (P("x"), P()):
            yield pytest.param(check_vma, spec, id=f"vma{int(check_vma)}-{'P()' if spec == P() else 'Px'}")


def _side_by_side(ops, out_spec, check_vma, before=None, after=None):
    """One program running each op on its own input: ``(x_1, ..., x_n) -> (op_1(x_1), ...)``,
    with ``after(op(before(v)))`` around each op where given."""
    before = before or (lambda v: v)
    after = after or (lambda v: v)
    body = lambda *vs: tuple(after(op(before(v))) for op, v in zip(ops, vs))
    return smap(body, in_specs=(P("x"),) * len(ops), out_specs=(out_spec,) * len(ops),
                check_vma=check_vma)


def _weighted(f, cts):
    """The scalar sum_i <f(xs)_i, ct_i>: its gradient is each op's transpose applied to ct_i."""
    return lambda *xs: sum(jnp.sum(y * c) for y, c in zip(f(*xs), cts))


def _lax_reverse_works(op, x, ct, out_spec, check_vma):
    """Whether jax.lax's own transpose rule handles ``op`` (see lax_reverse); found by
    tracing alone, so that the ops whose rule works share one compiled reverse program."""
    f = smap(op, out_specs=out_spec, check_vma=check_vma)
    try:
        jax.make_jaxpr(jax.linear_transpose(f, x))(ct)
    except ValueError as e:
        if "Expected cotangent type" not in str(e):
            raise
        return False
    return True


@pytest.mark.parametrize("check_vma,out_spec", list(_linear_settings()))
def test_linear_op_transforms_match_lax(check_vma, out_spec):
    """Forward, jvp, linear_transpose and grad (with nonlinearities around the op) of every
    linear op that allows ``out_spec``.

    The ops run side by side in one program per library and transformation (each op on
    its own input, so each gets its own transpose and gradient), not one per op: jax.lax's
    reference takes reverse mode for the ops whose lax transpose rule works and forward
    mode (jacfwd of the same quantity) for the others."""
    cases = [c for c in LINEAR if out_spec in c[4]]
    names = [c[0] for c in cases]
    n = len(cases)
    jc_ops, lax_ops = [c[2] for c in cases], [c[3] for c in cases]
    xs = tuple(data((R, *local), seed=1) for _, local, *_ in cases)
    f_jc = _side_by_side(jc_ops, out_spec, check_vma)
    f_lax = _side_by_side(lax_ops, out_spec, check_vma)

    def check(got, want, what):
        """Every op's ``what`` against jax.lax's; fails naming each op that differs."""
        wrong = []
        for name, g, w in zip(names, got, want, strict=True):
            try:
                assert_close(g, w, err_msg=f"{name}: {what}")
            except AssertionError as e:
                wrong.append(str(e))
        assert not wrong, "\n".join(wrong)

    ys_ref = f_lax(*xs)
    check(f_jc(*xs), ys_ref, "forward")

    ts = tuple(data(x.shape, seed=2) for x in xs)
    p_jc, t_jc = jax.jvp(f_jc, xs, ts)
    p_lax, t_lax = jax.jvp(f_lax, xs, ts)
    check(p_jc, p_lax, "jvp primal")
    check(t_jc, t_lax, "jvp tangent")

    cts = tuple(data(y.shape, seed=3) for y in ys_ref)
    reverse = [i for i in range(n) if _lax_reverse_works(lax_ops[i], xs[i], cts[i], out_spec,
                                                         check_vma)]
    forward = [i for i in range(n) if i not in reverse]

    def lax_reference(make_f, reverse_mode):
        """jax.lax's d/dx_i of sum_i <make_f(ops)(xs)_i, ct_i> for every op i:
        ``reverse_mode(f, xs, cts)`` where jax.lax's rule works, jacfwd elsewhere."""
        got = {}
        if reverse:
            got.update(zip(reverse, reverse_mode(make_f([lax_ops[i] for i in reverse]),
                                                 tuple(xs[i] for i in reverse),
                                                 tuple(cts[i] for i in reverse))))
        if forward:
            f = _weighted(make_f([lax_ops[i] for i in forward]), [cts[i] for i in forward])
            got.update(zip(forward, jax.jit(jax.jacfwd(f, argnums=tuple(range(len(forward)))))(
                *(xs[i] for i in forward))))
        return [got[i] for i in range(n)]

    tr_jc = jax.linear_transpose(f_jc, *xs)(cts)
    tr_lax = lax_reference(lambda ops: _side_by_side(ops, out_spec, check_vma),
                           lambda f, xs, cts: jax.linear_transpose(f, *xs)(cts))
    check(tr_jc, tr_lax, "linear_transpose")

    # grad of a nonlinear function around the op (sin before, square after).
    around = lambda ops: _side_by_side(ops, out_spec, check_vma, before=jnp.sin,
                                       after=lambda y: y ** 2)
    grad = lambda f, xs, cts: jax.jit(jax.grad(_weighted(f, cts), argnums=tuple(range(len(xs)))))(*xs)
    g_jc = grad(around(jc_ops), xs, cts)
    check(g_jc, lax_reference(around, grad), "grad")


CHECK_GRADS = ("all_reduce_sum", "all_gather_tiled_1", "reduce_scatter_untiled",
               "all_to_all_tiled_swap", "ppermute_partial", "broadcast_root3")


@pytest.mark.parametrize("case", [c for c in LINEAR if c[0] in CHECK_GRADS],
                         ids=[i for i in LINEAR_IDS if i in CHECK_GRADS])
def test_check_grads_order2(case):
    """Finite-difference check of jaxcomm's derivatives, second order, fwd and rev."""
    name, local, jc, ref, specs = case
    with jax.enable_x64(True):
        x = np.random.default_rng(4).uniform(-1, 1, size=(R, *local))
        f = smap(lambda v: jnp.tanh(jc(jnp.sin(v) * v)), out_specs=specs[-1], check_vma=True)
        # check_grads compares f's derivatives with f's own finite differences: f itself
        # must be right too.
        f_ref = smap(lambda v: jnp.tanh(ref(jnp.sin(v) * v)), out_specs=specs[-1], check_vma=True)
        assert_close(f(x), f_ref(x), rtol=1e-12, atol=1e-12)
        check_grads(f, (x,), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("check_vma", [True, False])
def test_all_reduce_sum_transpose_equals_lax_rule(check_vma):
    """psum transposes to a varying cast (check_vma) or to psum (without); jaxcomm too."""
    x = data((R, 3), seed=5)
    ct = data((R, 3), seed=6)
    for out_spec in (P("x"), P()):
        cts = ct if out_spec == P("x") else ct[:1]
        f_jc = smap(lambda v: jaxcomm.all_reduce(v, "x"), out_specs=out_spec, check_vma=check_vma)
        f_lax = smap(lambda v: lax.psum(v, "x"), out_specs=out_spec, check_vma=check_vma)
        _, vjp_jc = jax.vjp(f_jc, x)
        _, vjp_lax = jax.vjp(f_lax, x)
        assert_close(vjp_jc(cts), vjp_lax(cts))
        # Forward + backward communicate exactly as lax's do: the all-reduce transposes to
        # a varying cast (no collective) with check_vma, to an all-reduce without.
        vjp_jc = str(jax.make_jaxpr(lambda c: jax.vjp(f_jc, x)[1](c))(cts))
        vjp_lax = str(jax.make_jaxpr(lambda c: jax.vjp(f_lax, x)[1](c))(cts))
        collectives = r"\b(jaxcomm_all_reduce|psum\w*)\["
        n_jc, n_lax = len(re.findall(collectives, vjp_jc)), len(re.findall(collectives, vjp_lax))
        assert n_jc == n_lax, (vjp_jc, vjp_lax)
        assert vjp_jc.count("pvary[") == vjp_lax.count("pvary["), (vjp_jc, vjp_lax)
        if out_spec == P():
            assert n_jc == (1 if check_vma else 2), vjp_jc


# ------------------------------------------------------------------- max / min / prod


def _extremum_data():
    """x[r, j] for 8 ranks: column 0 a unique max at rank 5, column 1 a tie (ranks 2 and 6),
    column 2 an 8-way tie, column 3 a unique min at rank 0 and a tie for max (1, 7)."""
    x = np.array([
        [0.1, 0.2, 1.0, -3.0],
        [0.2, 0.3, 1.0, 2.0],
        [0.3, 0.9, 1.0, 0.5],
        [0.4, 0.1, 1.0, 0.6],
        [0.5, 0.2, 1.0, 0.7],
        [0.9, 0.3, 1.0, 0.8],
        [0.6, 0.9, 1.0, 0.9],
        [0.7, 0.4, 1.0, 2.0],
    ], dtype=np.float32)
    return x


def _extremum_grad_numpy(x, w_per_rank, op):
    """d/dx of sum_r sum_j w[r, j] * ext_k x[k, j]: the tangent split among tied ranks."""
    ext = x.max(axis=0) if op == "max" else x.min(axis=0)
    hit = (x == ext).astype(np.float32)
    return hit / hit.sum(axis=0) * w_per_rank.sum(axis=0)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_all_reduce_max_min_grad_splits_ties(op, check_vma):
    x = _extremum_data()
    w = data(x.shape, seed=7, lo=0.5, hi=2.0)
    jc = lambda v: jaxcomm.all_reduce(v, "x", op=op)
    ref = lambda v: (jnp.max if op == "max" else jnp.min)(lax.all_gather(v, "x"), axis=0)

    f_jc = smap(jc, check_vma=check_vma)
    f_ref = smap(ref, check_vma=check_vma)
    expected_fwd = np.broadcast_to((x.max if op == "max" else x.min)(axis=0), x.shape)
    assert_close(f_jc(x), expected_fwd)

    g_jc = jax.grad(lambda x: jnp.sum(f_jc(x) * w))(x)
    assert_close(g_jc, _extremum_grad_numpy(x, w, op))
    assert_close(g_jc, jax.grad(lambda x: jnp.sum(f_ref(x) * w))(x))

    # jvp: the tangent of each column is the mean of the tangents of its tied extrema.
    t = data(x.shape, seed=8)
    ext = x.max(axis=0) if op == "max" else x.min(axis=0)
    hit = (x == ext).astype(np.float32)
    expected_t = np.broadcast_to((t * hit).sum(0) / hit.sum(0), x.shape)
    _, t_jc = jax.jvp(f_jc, (x,), (t,))
    assert_close(t_jc, expected_t)

    if check_vma:  # the invariant result may be returned replicated
        f_rep = smap(jc, out_specs=P(), check_vma=True)
        w1 = w[:1]
        g_rep = jax.grad(lambda x: jnp.sum(f_rep(x) * w1))(x)
        assert_close(g_rep, _extremum_grad_numpy(x, w1, op))


@pytest.mark.parametrize("op", ["max", "min"])
def test_all_reduce_max_min_check_grads_without_ties(op):
    with jax.enable_x64(True):
        x = np.random.default_rng(9).permutation(R * 6).reshape(R, 6) / (R * 6.0)  # distinct
        f = smap(lambda v: jnp.sin(jaxcomm.all_reduce(v * v, "x", op=op)), check_vma=True)
        extremum = (np.max if op == "max" else np.min)(x * x, axis=0)
        assert_close(f(x), np.broadcast_to(np.sin(extremum), x.shape), rtol=1e-12, atol=1e-12)
        check_grads(f, (x,), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("zeros", [0, 1, 2], ids=["no_zero", "one_zero", "two_zeros"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_all_reduce_prod_grad(zeros, check_vma):
    with jax.enable_x64(True):
        x = np.random.default_rng(10).uniform(0.5, 1.5, size=(R, 5))
        if zeros >= 1:
            x[3, :2] = 0.0
        if zeros >= 2:
            x[6, 1:3] = 0.0
        f_jc = smap(lambda v: jaxcomm.all_reduce(v, "x", op="prod"), check_vma=check_vma)
        f_ref = smap(lambda v: jnp.prod(lax.all_gather(v, "x"), axis=0), check_vma=check_vma)
        assert_close(f_jc(x), np.broadcast_to(np.prod(x, axis=0), x.shape))
        w = np.random.default_rng(11).uniform(0.5, 2.0, size=x.shape)
        g_jc = jax.grad(lambda x: jnp.sum(f_jc(x) * w))(x)
        # exact: d/dx[k, j] prod_r x[r, j] = prod_{r != k} x[r, j], times sum_r w[r, j]
        expected = np.empty_like(x)
        for k in range(R):
            expected[k] = np.prod(np.delete(x, k, axis=0), axis=0) * w.sum(axis=0)
        assert_close(g_jc, expected, rtol=1e-10, atol=1e-12)
        assert_close(g_jc, jax.grad(lambda x: jnp.sum(f_ref(x) * w))(x), rtol=1e-10, atol=1e-12)
        if check_vma:
            check_grads(f_jc, (x,), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("op", ["max", "min", "prod"])
def test_reduce_scatter_non_sum_grad_raises(op):
    x = data((R, 8, 2), seed=12)
    f = smap(lambda v: jaxcomm.reduce_scatter(v, "x", scatter_dimension=1, op=op))
    f(x)  # forward works
    with pytest.raises(NotImplementedError, match=rf"reduce_scatter.*{op}.*(gradient|differentiable)"):
        jax.grad(lambda x: jnp.sum(f(x)))(x)
    with pytest.raises(NotImplementedError, match=r"reduce_scatter"):
        jax.jvp(f, (x,), (x,))


# ------------------------------------------------------------------------------- vmap
# Per-example operands inside the body have shape (8, 4) (8 = group size).

VMAP_OPS = [
    ("all_reduce_sum", lambda u: jaxcomm.all_reduce(u, "x"), lambda u: lax.psum(u, "x")),
    ("all_reduce_max", lambda u: jaxcomm.all_reduce(u, "x", op="max"), lambda u: lax.pmax(u, "x")),
    ("all_reduce_min", lambda u: jaxcomm.all_reduce(u, "x", op="min"), lambda u: lax.pmin(u, "x")),
    ("all_reduce_mean", lambda u: jaxcomm.all_reduce(u, "x", op="mean"), lambda u: lax.pmean(u, "x")),
    ("all_reduce_prod", lambda u: jaxcomm.all_reduce(u, "x", op="prod"),
     lambda u: jnp.prod(lax.all_gather(u, "x"), axis=0)),
    ("all_gather_0", lambda u: jaxcomm.all_gather(u, "x"), lambda u: lax.all_gather(u, "x")),
    ("all_gather_1_tiled", lambda u: jaxcomm.all_gather(u, "x", axis=1, tiled=True),
     lambda u: lax.all_gather(u, "x", axis=1, tiled=True)),
    ("reduce_scatter_0", lambda u: jaxcomm.reduce_scatter(u, "x"),
     lambda u: lax.psum_scatter(u, "x")),
    ("reduce_scatter_0_tiled", lambda u: jaxcomm.reduce_scatter(u, "x", tiled=True),
     lambda u: lax.psum_scatter(u, "x", tiled=True)),
    ("all_to_all_0_1", lambda u: jaxcomm.all_to_all(u, "x", 0, 1),
     lambda u: lax.all_to_all(u, "x", 0, 1)),
    ("all_to_all_0_1_tiled", lambda u: jaxcomm.all_to_all(u, "x", 0, 1, tiled=True),
     lambda u: lax.all_to_all(u, "x", 0, 1, tiled=True)),
    ("ppermute", lambda u: jaxcomm.ppermute(u, "x", PARTIAL), lambda u: lax.ppermute(u, "x", PARTIAL)),
    ("broadcast", lambda u: jaxcomm.broadcast(u, "x", root=2), lambda u: lax_broadcast(u, "x", 2)),
]
VMAP_IDS = [c[0] for c in VMAP_OPS]
B = 3


@pytest.mark.parametrize("in_axis", [0, 1])
@pytest.mark.parametrize("case", VMAP_OPS, ids=VMAP_IDS)
def test_vmap_inside_shard_map(case, in_axis):
    _, jc, ref = case
    # local block (1, B, 8, 4) [in_axis=0] or (1, 8, B, 4) [in_axis=1]
    shape = (R, B, 8, 4) if in_axis == 0 else (R, 8, B, 4)
    x = data(shape, seed=13)

    def body(op, axis):
        return lambda v: jax.vmap(op, in_axes=axis)(v[0])[None]

    # The reference moves the batch dim to the front itself: jax.lax's own batching rule
    # for untiled psum_scatter fails (IndexError) with the batch dim elsewhere (jax 0.10.2).
    x0 = np.moveaxis(x, 1 + in_axis, 1)
    assert_close(smap(body(jc, in_axis))(x), smap(body(ref, 0))(x0))


@pytest.mark.parametrize("case", VMAP_OPS, ids=VMAP_IDS)
def test_vmap_inside_shard_map_no_vma_and_unbatched_operand(case):
    """check_vma=False; and a vmap whose collective operand is not batched."""
    _, jc, ref = case
    x = data((R, B, 8, 4), seed=14)
    c = data((R, 8, 4), seed=15)

    def body(op):
        return lambda v: jax.vmap(op, in_axes=0, out_axes=1)(v[0])[None]

    assert_close(smap(body(jc), check_vma=False)(x), smap(body(ref), check_vma=False)(x))

    def body2(op):
        # the collective sees `w` (not batched); the batched `v` only enters afterwards
        return lambda v, w: jax.vmap(lambda a, b: op(b) + jnp.sum(a), in_axes=(0, None))(v[0], w[0])[None]

    f_jc = smap(body2(jc), in_specs=(P("x"), P("x")))
    f_ref = smap(body2(ref), in_specs=(P("x"), P("x")))
    assert_close(f_jc(x, c), f_ref(x, c))


@pytest.mark.parametrize("in_axis", [0, 1])
@pytest.mark.parametrize("case", VMAP_OPS, ids=VMAP_IDS)
def test_vmap_of_shard_map(case, in_axis):
    """jax.vmap outside the (jitted) shard_map: the batch dim reaches the primitive."""
    _, jc, ref = case
    x = data((B, R, 8, 4) if in_axis == 0 else (R, B, 8, 4), seed=16)
    # Per-example global shape (R*8, 4) -> local (8, 4).
    x = x.reshape((B, R * 8, 4) if in_axis == 0 else (R * 8, B, 4))
    f_jc = jax.vmap(smap(jc), in_axes=in_axis)
    f_ref = jax.vmap(smap(ref), in_axes=0)  # see test_vmap_inside_shard_map
    assert_close(f_jc(x), f_ref(np.moveaxis(x, in_axis, 0)))


@pytest.mark.parametrize("case", LINEAR[:3] + LINEAR[5:6] + LINEAR[7:8] + LINEAR[10:11] + LINEAR[12:],
                         ids=lambda c: c[0])
def test_grad_of_vmap(case):
    """vmap and grad together: grad(sum(vmap(op)))."""
    _, local, jc, ref, _ = case
    x = data((R, B, *local), seed=17)

    def loss(op):
        f = smap(lambda v: jax.vmap(lambda u: op(jnp.sin(u)), in_axes=1, out_axes=1)(v) ** 2)
        return lambda x: jnp.sum(f(x))

    expected = lax_reverse(lambda: jax.grad(loss(ref))(x), lambda: jax.jacfwd(loss(ref))(x))
    assert_close(jax.grad(loss(jc))(x), expected)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "ppermute", "broadcast"])
def test_collective_over_vmap_axis_name_raises_clear_error(op, check_vma):
    calls = {
        "all_reduce": lambda u: jaxcomm.all_reduce(u, "v"),
        "all_gather": lambda u: jaxcomm.all_gather(u, "v"),
        "ppermute": lambda u: jaxcomm.ppermute(u, "v", [(0, 1), (1, 0)]),
        "broadcast": lambda u: jaxcomm.broadcast(u, "v", root=0),
    }
    fn = calls[op]
    x = data((R, 2, 3), seed=18)
    inside = smap(lambda v: jax.vmap(fn, axis_name="v")(v[0])[None], check_vma=check_vma)
    with pytest.raises((NotImplementedError, ValueError, NameError, TypeError),
                       match=rf"(?s)jaxcomm\.{op}.*vmap"):
        inside(x)


def test_collective_over_vmap_axis_name_outside_shard_map_raises_clear_error():
    x = data((2, 3), seed=19)
    with pytest.raises((NotImplementedError, ValueError, NameError, TypeError),
                       match=r"(?s)jaxcomm\.all_reduce.*vmap"):
        jax.vmap(lambda u: jaxcomm.all_reduce(u, "v"), axis_name="v")(x)
    with pytest.raises((NotImplementedError, ValueError, NameError, TypeError),
                       match=r"(?s)jaxcomm\.all_reduce.*vmap"):
        jax.jit(jax.vmap(lambda u: jaxcomm.all_reduce(u, "v"), axis_name="v"))(x)


# ----------------------------------------------------------------------- control flow


@pytest.mark.parametrize("check_vma", [True, False])
def test_inside_scan(check_vma):
    x = data((R, 5, 4), seed=20)

    def body(ar, ag, pp):
        def step(c, v_t):
            s = ar(c * v_t) / R
            g = ag(v_t)                       # (R, 4), varying under check_vma
            c = jnp.tanh(s + pp(c) + g.sum(0))
            return c, s

        def f(v):
            c0 = v[0, 0]
            c, ys = lax.scan(step, c0, v[0])
            return (c + ys.sum(0))[None]
        return f

    jc = body(lambda u: jaxcomm.all_reduce(u, "x"), lambda u: jaxcomm.all_gather(u, "x"),
              lambda u: jaxcomm.ppermute(u, "x", SHIFT))
    ref = body(lambda u: lax.psum(u, "x"), lambda u: lax.all_gather(u, "x"),
               lambda u: lax.ppermute(u, "x", SHIFT))
    f_jc, f_ref = smap(jc, check_vma=check_vma), smap(ref, check_vma=check_vma)
    assert_close(f_jc(x), f_ref(x))
    assert_close(jax.grad(lambda x: jnp.sum(f_jc(x) ** 2))(x),
                 jax.grad(lambda x: jnp.sum(f_ref(x) ** 2))(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("check_vma", [True, False])
def test_inside_fori_loop(check_vma):
    x = data((R, 6), seed=21)

    def body(pp, bc, ar):
        def f(v):
            def it(i, c):
                c = pp(c)                       # ring shift
                return c + 0.5 * bc(c) + 0.01 * ar(c)
            return lax.fori_loop(0, 2 * R + 1, it, v)
        return f

    jc = body(lambda u: jaxcomm.ppermute(u, "x", SHIFT), lambda u: jaxcomm.broadcast(u, "x", root=5),
              lambda u: jaxcomm.all_reduce(u, "x", op="max"))
    ref = body(lambda u: lax.ppermute(u, "x", SHIFT), lambda u: lax_broadcast(u, "x", 5),
               lambda u: lax.pmax(u, "x"))
    assert_close(smap(jc, check_vma=check_vma)(x), smap(ref, check_vma=check_vma)(x),
                 rtol=1e-4)

    # the collectives' own loop: R ring shifts give back the input.
    ring = smap(lambda v: lax.fori_loop(0, R, lambda i, c: jaxcomm.ppermute(c, "x", SHIFT), v),
                check_vma=check_vma)
    assert_close(ring(x), x)


@pytest.mark.parametrize("check_vma", [True, False])
def test_inside_cond(check_vma):
    """A cond whose predicate is equal on every rank (all ranks take the same branch)."""
    x = data((R, 8, 3), seed=22)

    def body(ag, a2a, rs):
        def f(v, p):
            def yes(u):
                return ag(u).reshape(1, -1, 3)[:, : 8]  # (1, 8, 3)
            def no(u):
                return a2a(u) + rs(u)[:, None]
            return lax.cond(p[0] > 0, yes, no, v)
        return f

    jc = body(lambda u: jaxcomm.all_gather(u, "x", axis=1, tiled=True),
              lambda u: jaxcomm.all_to_all(u, "x", 1, 1, tiled=True),
              lambda u: jaxcomm.reduce_scatter(u, "x", scatter_dimension=1))
    ref = body(lambda u: lax.all_gather(u, "x", axis=1, tiled=True),
               lambda u: lax.all_to_all(u, "x", 1, 1, tiled=True),
               lambda u: lax.psum_scatter(u, "x", scatter_dimension=1))
    for pred in (1.0, -1.0):
        p = np.full((1,), pred, np.float32)
        f_jc = smap(jc, in_specs=(P("x"), P()), check_vma=check_vma)
        f_ref = smap(ref, in_specs=(P("x"), P()), check_vma=check_vma)
        assert_close(f_jc(x, p), f_ref(x, p))
        assert_close(jax.grad(lambda x: jnp.sum(jnp.sin(f_jc(x, p))))(x),
                     jax.grad(lambda x: jnp.sum(jnp.sin(f_ref(x, p))))(x))

    # predicate from a collective result (invariant under check_vma): psum > 0
    def body2(ar, bc):
        def f(v):
            s = ar(v.sum())
            return lax.cond(s > 0, lambda u: bc(u) * 2.0, lambda u: bc(-u), v)
        return f

    for sign in (1.0, -1.0):
        xs = np.abs(x) * sign
        jc2 = smap(body2(lambda u: jaxcomm.all_reduce(u, "x"), lambda u: jaxcomm.broadcast(u, "x", root=1)),
                   out_specs=P(), check_vma=check_vma)
        ref2 = smap(body2(lambda u: lax.psum(u, "x"), lambda u: lax_broadcast(u, "x", 1)),
                    out_specs=P(), check_vma=check_vma)
        assert_close(jc2(xs), ref2(xs))


# ---------------------------------------------------------------- varying / invariant


ALL_OPS = [
    ("all_reduce", lambda v: jaxcomm.all_reduce(v, "x"), lambda v: lax.psum(v, "x")),
    ("all_reduce_max", lambda v: jaxcomm.all_reduce(v, "x", op="max"), lambda v: lax.pmax(v, "x")),
    ("broadcast", lambda v: jaxcomm.broadcast(v, "x", root=4), lambda v: lax_broadcast(v, "x", 4)),
    ("all_gather", lambda v: jaxcomm.all_gather(v, "x"), lambda v: lax.all_gather(v, "x")),
    ("reduce_scatter", lambda v: jaxcomm.reduce_scatter(v, "x", scatter_dimension=1),
     lambda v: lax.psum_scatter(v, "x", scatter_dimension=1)),
    ("all_to_all", lambda v: jaxcomm.all_to_all(v, "x", 1, 1, tiled=True),
     lambda v: lax.all_to_all(v, "x", 1, 1, tiled=True)),
    ("ppermute", lambda v: jaxcomm.ppermute(v, "x", SHIFT), lambda v: lax.ppermute(v, "x", SHIFT)),
]


def _vma_recorder(seen, key, op):
    """Wraps ``op`` so that it records its result's varying axes in ``seen[key]``."""
    def f(v):
        y = op(v)
        seen[key] = compat.vma(jax.typeof(y))
        return y
    return f


@pytest.mark.parametrize("in_spec", [P("x"), P()], ids=["varying_in", "invariant_in"])
@pytest.mark.parametrize("case", ALL_OPS, ids=[c[0] for c in ALL_OPS])
def test_result_vma_type_matches_lax(case, in_spec):
    _, jc, ref = case
    x = data((R, 8, 2), seed=23)
    seen = {}
    record = functools.partial(_vma_recorder, seen)
    smap(record("jc", jc), in_specs=in_spec, out_specs=P("x"))(x)
    smap(record("lax", ref), in_specs=in_spec, out_specs=P("x"))(x)
    assert seen["jc"] == seen["lax"], seen


@pytest.mark.parametrize("case", ALL_OPS, ids=[c[0] for c in ALL_OPS])
def test_replicated_out_specs_follow_lax(case):
    """check_vma=True: invariant results may use out_specs=P(); varying ones raise as lax does."""
    name, jc, ref = case
    x = data((R, 8, 2), seed=24)
    try:
        expected = smap(ref, out_specs=P())(x)
        lax_error = None
    except Exception as e:  # noqa: BLE001 - we compare the kind of error with jaxcomm's
        lax_error = e
    if lax_error is None:
        assert name in ("all_reduce", "all_reduce_max", "broadcast")
        assert_close(smap(jc, out_specs=P())(x), expected)
    else:
        assert name not in ("all_reduce", "all_reduce_max", "broadcast")
        with pytest.raises(type(lax_error)) as info:
            smap(jc, out_specs=P())(x)
        assert "out_specs" in str(info.value)
        assert "out_specs" in str(lax_error)


def test_two_axis_mesh_types_and_grads():
    """Collectives over one axis of a 2-D mesh, and over both; results and grads as lax.

    The cases run side by side in one program per library (each case on its own copy of
    the input, so each gets its own gradient): four compilations instead of four per case."""
    x = data((8, 16, 3), seed=25)
    cases = [
        (lambda v: jaxcomm.all_reduce(v, "ep"), lambda v: lax.psum(v, "ep"), P("dp")),
        (lambda v: jaxcomm.all_reduce(v, ("dp", "ep"), op="mean"),
         lambda v: lax.pmean(v, ("dp", "ep")), P()),
        (lambda v: jaxcomm.broadcast(v, "dp", root=1), lambda v: lax_broadcast(v, "dp", 1),
         P(None, "ep")),
        (lambda v: jaxcomm.all_gather(v, ("dp", "ep"), axis=1, tiled=True),
         lambda v: lax.all_gather(v, ("dp", "ep"), axis=1, tiled=True), P(("dp", "ep"))),
        (lambda v: jaxcomm.reduce_scatter(v, "ep", scatter_dimension=1, tiled=True),
         lambda v: lax.psum_scatter(v, "ep", scatter_dimension=1, tiled=True), P("dp", "ep")),
        (lambda v: jaxcomm.ppermute(v, "ep", [(0, 1), (1, 2), (2, 3), (3, 0)]),
         lambda v: lax.ppermute(v, "ep", [(0, 1), (1, 2), (2, 3), (3, 0)]), P("dp", "ep")),
    ]
    seen = {}
    rec = functools.partial(_vma_recorder, seen)
    n = len(cases)

    def program(side, ops):
        body = lambda *vs: tuple(rec((side, i), op)(v) for i, (op, v) in enumerate(zip(ops, vs)))
        return smap(body, in_specs=(P("dp", "ep"),) * n,
                    out_specs=tuple(out_spec for _, _, out_spec in cases), mesh=MESH2)

    f_jc = program("jc", [jc for jc, _, _ in cases])
    f_ref = program("lax", [ref for _, ref, _ in cases])
    xs = (x,) * n
    for i, (got, want) in enumerate(zip(f_jc(*xs), f_ref(*xs))):
        assert_close(got, want, err_msg=f"case {i}")
        assert seen[("jc", i)] == seen[("lax", i)], i
    loss = lambda f: lambda *xs: sum(jnp.sum(jnp.sin(y)) for y in f(*xs))
    grads = lambda f: jax.grad(loss(f), argnums=tuple(range(n)))(*xs)
    for i, (got, want) in enumerate(zip(grads(f_jc), grads(f_ref))):
        assert_close(got, want, err_msg=f"case {i} grad")
