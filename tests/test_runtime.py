"""jaxcomm's runtime behaviour: call matching, timeouts, threads, memory, donation,
the jax.lax fallback and its HLO, and composition with pjit-style sharded programs."""

from __future__ import annotations

import os
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxcomm

R = 8
MESH = jax.make_mesh((R,), ("x",))  # Explicit axes: inputs are placed with device_put
AUTO_MESH = jax.make_mesh((R,), ("x",), axis_types=(AxisType.Auto,))
MESH2 = jax.make_mesh((2, 4), ("dp", "ep"))

# Deadline for collectives that should never wait long: a bug shows up as an error
# within seconds instead of the default 300 s hang.
T = 15
# How long after its deadline an expired call may report it: generous, for a loaded
# machine (what is asserted is that a deadline is not cut short, nor ignored).
DEADLINE_SLACK_S = 30.0

# jax raises errors from a failed execution as JaxRuntimeError (XlaRuntimeError is its
# older name; both are RuntimeError subclasses).
RUNTIME_ERRORS = tuple({getattr(jax.errors, n) for n in ("JaxRuntimeError", "XlaRuntimeError")
                        if hasattr(jax.errors, n)})

XLA_COLLECTIVE_HLO = re.compile(
    r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(-start|-done)?\(")
XLA_COLLECTIVE_MLIR = re.compile(
    r"stablehlo\.(all_reduce|all_gather|all_to_all|collective_permute|reduce_scatter)\b")


def put(x, spec, mesh=MESH):
    return jax.device_put(x, NamedSharding(mesh, spec))


def smap(body, in_specs=P("x"), out_specs=P("x"), check_vma=True, mesh=MESH, **jit_kw):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=check_vma), **jit_kw)


def data(shape, seed=0, dtype=np.float32):
    # Small integers: sums are exact in float32 whatever the reduction order.
    return np.random.default_rng(seed).integers(-8, 8, size=shape).astype(dtype)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return i
    raise AssertionError(marker)


# ------------------------------------------------------- matching by instruction identity


def test_many_independent_large_collectives_match_by_instruction():
    """16 independent 256 KiB+ collectives: XLA:CPU runs them in different orders on
    different devices; every one must still meet its own counterparts."""
    n_ar, n_ag, n = 10, 6, 64 * 1024  # 64 Ki float32 = 256 KiB per rank and op

    def body(v):
        # timeout_s: a failure to match shows up as an error rather than a long hang
        ars = [jaxcomm.all_reduce(v * (i + 1) + i, "x", timeout_s=T) for i in range(n_ar)]
        ags = [jaxcomm.all_gather(v * (i + 2) - i, "x", tiled=True, timeout_s=T)
               for i in range(n_ag)]
        return ars, ags

    f = smap(body, out_specs=([P("x")] * n_ar, [P("x")] * n_ag))
    for rep in range(3):
        x = data((R, n), seed=rep)
        ars, ags = f(put(x, P("x")))
        total = x.sum(axis=0)
        for i, a in enumerate(ars):
            np.testing.assert_array_equal(np.asarray(a), np.tile((i + 1) * total + R * i, (R, 1)),
                                          err_msg=f"all_reduce #{i}, repetition {rep}")
        for i, g in enumerate(ags):
            np.testing.assert_array_equal(np.asarray(g), np.tile(x * (i + 2) - i, (R, 1)),
                                          err_msg=f"all_gather #{i}, repetition {rep}")


def test_nested_jit_called_twice_in_one_program():
    """Two inlined copies of one nested jit are two instructions with equal attributes."""
    n = 64 * 1024
    inner_ar = jax.jit(lambda u: jaxcomm.all_reduce(u, "x", timeout_s=T))
    inner_ag = jax.jit(lambda u: jaxcomm.all_gather(u, "x", tiled=True, timeout_s=T))

    def body(v):
        a = inner_ar(v)
        b = inner_ar(v * 2 + 1)
        c = inner_ag(v - 3)
        d = inner_ag(v * 5)
        return a, b, c, d

    f = smap(body)
    for rep in range(3):
        x = data((R, n), seed=10 + rep)
        a, b, c, d = f(put(x, P("x")))
        s = x.sum(axis=0)
        np.testing.assert_array_equal(np.asarray(a), np.tile(s, (R, 1)))
        np.testing.assert_array_equal(np.asarray(b), np.tile(2 * s + R, (R, 1)))
        np.testing.assert_array_equal(np.asarray(c), np.tile(x - 3, (R, 1)))
        np.testing.assert_array_equal(np.asarray(d), np.tile(x * 5, (R, 1)))


# --------------------------------------------------------------------------- timeouts


def _skipping_body(v):
    def call(u):
        return jaxcomm.all_reduce(u, "x", timeout_s=2)  # TIMEOUT-CALL-SITE
    return lax.cond(lax.axis_index("x") < 4, call, lambda u: u, v)


def _check_timeout_message(msg: str, op: str, line: int, execution: int) -> None:
    assert f"jaxcomm.{op}" in msg, msg
    assert "'x'" in msg, msg                                   # the axis
    assert "partitions [0 1 2 3 4 5 6 7]" in msg, msg          # the group
    assert f"test_runtime.py:{line}" in msg, msg               # the call site
    assert f"execution #{execution}" in msg, msg               # which execution
    assert "[4, 5, 6, 7]" in msg, msg                          # who did not arrive
    assert "timed out" in msg, msg


def test_timeout_names_the_call_and_missing_ranks_then_recovers():
    f = smap(_skipping_body, check_vma=False)
    x = put(data((R, 16), seed=20), P("x"))
    line = _line_of("# TIMEOUT-CALL-SITE")
    for execution in (1, 2):
        start = time.monotonic()
        with pytest.raises(RUNTIME_ERRORS) as info:
            jax.block_until_ready(f(x))
        elapsed = time.monotonic() - start
        _check_timeout_message(str(info.value), "all_reduce", line, execution)
        # The deadline's length (2 s from the first arrival, which came after `start`):
        # not before it, and not far after it, however loaded the machine.
        assert 2.0 <= elapsed < 2.0 + DEADLINE_SLACK_S, elapsed
        assert "timed out after 2 s" in str(info.value), str(info.value)

    # The process is still usable: a normal collective works.
    g = smap(lambda v: jaxcomm.all_reduce(v, "x", timeout_s=T))
    y = data((R, 16), seed=21)
    np.testing.assert_array_equal(np.asarray(g(put(y, P("x")))), np.tile(y.sum(0), (R, 1)))


def _late_rank(v, rank, seconds):
    """v, once rank ``rank`` of axis "x" has slept ``seconds`` (the others pass it on)."""
    def sleep(r, u):
        if int(r) == rank:
            time.sleep(seconds)
        return u
    return jax.pure_callback(sleep, jax.ShapeDtypeStruct(v.shape, v.dtype), lax.axis_index("x"), v)


def test_rank_late_within_its_deadline_completes():
    # Rank 3 arrives 1 s after the others, well within the 5 s deadline: no error, and
    # the right result. (A deadline that expired 10x too early would fail it.)
    f = smap(lambda v: jaxcomm.all_reduce(_late_rank(v, 3, 1.0), "x", timeout_s=5), check_vma=False)
    x = data((R, 16), seed=24)
    start = time.monotonic()
    got = np.asarray(f(put(x, P("x"))))
    assert time.monotonic() - start >= 1.0  # rank 3 was late indeed
    np.testing.assert_array_equal(got, np.tile(x.sum(0), (R, 1)))


def test_timeout_from_environment(monkeypatch):
    monkeypatch.setenv("JAXCOMM_TIMEOUT_S", "2")

    def body(v):
        def call(u):
            return jaxcomm.all_gather(u, "x", tiled=True)  # ENV-TIMEOUT-CALL-SITE
        # ranks 4..7 skip; the result shapes of both branches agree
        return lax.cond(lax.axis_index("x") < 4, call, lambda u: jnp.tile(u, (R, 1)), v)

    f = smap(body, check_vma=False)
    x = put(data((R, 16), seed=22), P("x"))
    with pytest.raises(RUNTIME_ERRORS) as info:
        jax.block_until_ready(f(x))
    _check_timeout_message(str(info.value), "all_gather", _line_of("# ENV-TIMEOUT-CALL-SITE"), 1)
    assert "timed out after 2 s" in str(info.value), str(info.value)
    monkeypatch.delenv("JAXCOMM_TIMEOUT_S")

    g = smap(lambda v: jaxcomm.all_gather(v, "x", tiled=True, timeout_s=T))
    y = data((R, 4), seed=23)
    np.testing.assert_array_equal(np.asarray(g(put(y, P("x")))), np.tile(y, (R, 1)))


def test_invalid_timeout_is_rejected():
    x = put(data((R, 4)), P("x"))
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="timeout"):
            smap(lambda v: jaxcomm.all_reduce(v, "x", timeout_s=bad))(x)


# ---------------------------------------------------------------------------- threads


def _run_threads(jobs, iters):
    """Runs each (fn, x, expected) in its own thread ``iters`` times; returns errors."""
    errors = []
    barrier = threading.Barrier(len(jobs))

    def work(fn, x, expected):
        try:
            for _ in range(iters):
                barrier.wait(timeout=120)  # dispatch at the same moment
                out = np.asarray(fn(x))
                np.testing.assert_array_equal(out, expected)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=job, daemon=True) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    hung = [t for t in threads if t.is_alive()]
    assert not hung, "a thread never finished: deadlock between concurrent executions"
    return errors


def test_concurrent_programs_from_two_threads():
    n = 32 * 1024
    f_ar = smap(lambda v: jaxcomm.all_reduce(v, "x", timeout_s=T))
    f_ag = smap(lambda v: jaxcomm.all_gather(v, "x", tiled=True, timeout_s=T))
    f_pp = smap(lambda v: jaxcomm.ppermute(v, "x", [(i, (i + 1) % R) for i in range(R)],
                                           timeout_s=T))
    xs = [data((R, n), seed=30 + i) for i in range(3)]
    ar_exp = [np.tile(x.sum(0), (R, 1)) for x in xs]
    placed = [put(x, P("x")) for x in xs]
    # compile first, so that the threads race on execution
    for f in (f_ar, f_ag, f_pp):
        jax.block_until_ready(f(placed[0]))

    # different programs
    errors = _run_threads([(f_ar, placed[0], ar_exp[0]),
                           (f_ag, placed[1], np.tile(xs[1], (R, 1)))], iters=15)
    assert not errors, errors
    # the same program with different inputs
    errors = _run_threads([(f_ar, placed[1], ar_exp[1]), (f_ar, placed[2], ar_exp[2])], iters=15)
    assert not errors, errors
    # three at once, one of them the same as another
    errors = _run_threads([(f_ar, placed[0], ar_exp[0]), (f_ar, placed[2], ar_exp[2]),
                           (f_pp, placed[1], np.roll(xs[1], 1, axis=0))], iters=10)
    assert not errors, errors


def test_back_to_back_async_dispatch():
    """Many executions in flight at once (jax dispatches asynchronously, and small programs
    queue up quickly): every one completes with the right result, none waits for a
    deadline.

    32 dispatches: XLA:CPU (jax 0.10.2, 8 devices) runs each device's part on a shared
    worker pool and blocks a worker until that part's collectives complete, so with
    enough executions queued, the workers all hold parts whose peers cannot start. XLA's
    own lax.psum survives 32 back-to-back dispatches but aborts the process (rendezvous
    termination timeout) at 40-64; jaxcomm must do at least as well."""
    n = 16
    # A short deadline: executions that deadlock fail after 2 s each rather than hang.
    f_ar = smap(lambda v: jaxcomm.all_reduce(v, "x", timeout_s=2))
    f_ag = smap(lambda v: jaxcomm.all_gather(v, "x", tiled=True, timeout_s=2))
    xs = [data((R, n), seed=35 + i) for i in range(4)]
    placed = [put(x, P("x")) for x in xs]
    jax.block_until_ready((f_ar(placed[0]), f_ag(placed[0])))
    outs = []
    for i in range(32):
        if i % 4 == 3:
            outs.append(("all_gather", i, f_ag(placed[i % 4])))
        else:
            outs.append(("all_reduce", i, f_ar(placed[i % 4])))
    failures = []
    for op, i, out in outs:
        try:
            got = np.asarray(out)
        except RUNTIME_ERRORS as e:
            failures.append(f"dispatch {i} ({op}): {str(e)[:400]}")
            continue
        x = xs[i % 4]
        expected = np.tile(x, (R, 1)) if op == "all_gather" else np.tile(x.sum(0), (R, 1))
        np.testing.assert_array_equal(got, expected, err_msg=f"dispatch {i} ({op})")
    assert not failures, (f"{len(failures)} of {len(outs)} executions failed:\n" +
                          "\n".join(failures[:4]))


def _thread_cpu_masks(name: str) -> dict[int, set[int]]:
    """CPU masks of this process's threads called `name`, by thread id."""
    masks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != name:
                    continue
            masks[int(tid)] = os.sched_getaffinity(int(tid))
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return masks


def test_helper_threads_get_their_cpu_mask_back():
    """Rounds large enough to share their work: a pool thread that wakes on its poster's
    CPU moves off it (LeaveCore, ffi/core/cpu_affinity.h) and must keep the process's CPU
    mask, or it would run later ranks' programs pinned."""
    n = 256 * 1024  # 1 MiB per rank: the work is shared by the pool's threads
    f = smap(lambda v: jaxcomm.all_gather(v, "x", tiled=True, timeout_s=T))
    x = data((R, n), seed=5)
    for _ in range(20):
        np.testing.assert_array_equal(np.asarray(f(put(x, P("x")))), np.tile(x, (R, 1)))
    masks = _thread_cpu_masks("jaxcomm-pool")
    assert masks, "no jaxcomm pool threads found"
    allowed = os.sched_getaffinity(0)
    assert {tid: m for tid, m in masks.items() if m != allowed} == {}


# ----------------------------------------------------------------------------- memory


def test_memory_does_not_grow_with_executions():
    """Per-execution state (rounds, watchdog entries, futures) is released."""
    per_dispatch = 20

    def body(v):
        return lax.fori_loop(0, per_dispatch,
                             lambda i, c: jaxcomm.all_reduce(c, "x", timeout_s=T) * 0.125, v)

    f = smap(body, check_vma=False)
    x = put(data((R, 16), seed=40), P("x"))

    def batch(k):
        # One execution in flight at a time (test_back_to_back_async_dispatch covers many).
        for _ in range(k):
            jax.block_until_ready(f(x))

    batch(400)  # warm up: compilation, allocator arenas, caches
    r0 = rss_bytes()
    batch(1000)  # 20000 collective executions
    r1 = rss_bytes()
    batch(1000)
    r2 = rss_bytes()
    growth1, growth2 = r1 - r0, r2 - r1
    # A leak of 256 bytes per collective execution would add about 5 MB per batch.
    limit = 4 * 1024 * 1024
    assert min(growth1, growth2) < limit, (
        f"RSS grew {growth1 / 2**20:.1f} MiB and then {growth2 / 2**20:.1f} MiB over two "
        f"batches of {1000 * per_dispatch} collective executions")


def test_memory_does_not_grow_with_timeouts():
    """Failed calls leave nothing behind but the bounded tombstones."""
    f = smap(lambda v: lax.cond(lax.axis_index("x") < 4,
                                lambda u: jaxcomm.all_reduce(u, "x", timeout_s=0.001),
                                lambda u: u, v), check_vma=False)
    x = put(data((R, 16), seed=41), P("x"))

    def batch(k):
        for _ in range(k):
            try:
                jax.block_until_ready(f(x))
            except RUNTIME_ERRORS:
                pass

    batch(100)
    r0 = rss_bytes()
    batch(300)
    r1 = rss_bytes()
    assert r1 - r0 < 8 * 1024 * 1024, f"RSS grew {(r1 - r0) / 2**20:.1f} MiB over 300 timeouts"


# --------------------------------------------------------------------------- donation


@pytest.mark.parametrize("n", [16, 256 * 1024], ids=["small", "large"])
@pytest.mark.parametrize("op", ["sum", "max", "prod", "broadcast"])
def test_donated_input(op, n):
    if op == "broadcast":
        def coll(v):
            return jaxcomm.broadcast(v, "x", root=3)
        expected = lambda x: np.tile(x[3], (R, 1))  # noqa: E731
    else:
        def coll(v):
            return jaxcomm.all_reduce(v, "x", op=op)
        red = {"sum": np.sum, "max": np.max, "prod": np.prod}[op]
        expected = lambda x: np.tile(red(x, axis=0), (R, 1))  # noqa: E731

    f = smap(coll, donate_argnums=0)
    # the donated operand is also used after the collective: XLA must keep it intact
    g = smap(lambda v: coll(v) + v, donate_argnums=0)
    for rep in range(3):
        x = data((R, n), seed=50 + rep)
        if op == "prod":
            x = np.where(np.abs(x) < 2, 1, np.sign(x)).astype(np.float32)
        xd = put(x, P("x"))
        np.testing.assert_array_equal(np.asarray(f(xd)), expected(x))
        assert xd.is_deleted()
        np.testing.assert_array_equal(np.asarray(g(put(x, P("x")))), expected(x) + x)


@pytest.mark.parametrize("op", ["all_reduce", "broadcast"])
def test_result_reuses_operand_only_up_to_alias_max(op):
    from jaxcomm._src.primitive import ALIAS_MAX_BYTES
    coll = {"all_reduce": lambda v: jaxcomm.all_reduce(v, "x"),
            "broadcast": lambda v: jaxcomm.broadcast(v, "x", root=1)}[op]
    f = smap(coll)
    at_max = ALIAS_MAX_BYTES // 4  # float32 elements per rank
    for cols, aliased in ((at_max, True), (at_max + 1, False)):
        text = f.lower(put(np.zeros((R, cols), np.float32), P("x"))).as_text()
        call = next(line for line in text.splitlines() if f"@jaxcomm_{op}" in line)
        assert ("output_operand_aliases" in call) == aliased, (cols, call)


def test_donated_input_replicated_output():
    f = smap(lambda v: jaxcomm.all_reduce(v, "x"), out_specs=P(), donate_argnums=0)
    x = data((R, 1024), seed=55)
    np.testing.assert_array_equal(np.asarray(f(put(x, P("x")))), x.sum(0, keepdims=True))


# ---------------------------------------------------------------------- fallback / HLO

FALLBACK_OPS = {
    "all_reduce": (lambda v: jaxcomm.all_reduce(v, "x"), "all_reduce", P()),
    "all_reduce_max": (lambda v: jaxcomm.all_reduce(v, "x", op="max"), "all_reduce", P()),
    "all_reduce_mean": (lambda v: jaxcomm.all_reduce(v, "x", op="mean"), "all_reduce", P()),
    "all_gather": (lambda v: jaxcomm.all_gather(v, "x", tiled=True), "all_gather", P("x")),
    "reduce_scatter": (lambda v: jaxcomm.reduce_scatter(v, "x", scatter_dimension=1, tiled=True),
                       "reduce_scatter", P("x")),
    "all_to_all": (lambda v: jaxcomm.all_to_all(v, "x", 1, 1, tiled=True), "all_to_all", P("x")),
    "ppermute": (lambda v: jaxcomm.ppermute(v, "x", [(i, (i + 3) % R) for i in range(R)]),
                 "collective_permute", P("x")),
    "broadcast": (lambda v: jaxcomm.broadcast(v, "x", root=6), "all_reduce", P()),
}


def _fresh(op):
    """A new jit(shard_map) for ``op``: backend choice happens at trace time and jit caches
    traces by function identity, so each configuration needs its own function."""
    fn, _, out_spec = FALLBACK_OPS[op]
    return smap(lambda v: fn(v), out_specs=out_spec)


@pytest.mark.parametrize("op", list(FALLBACK_OPS))
def test_default_backend_lowers_to_jaxcomm_custom_calls_only(op, monkeypatch):
    monkeypatch.delenv("JAXCOMM_BACKEND", raising=False)
    x = put(data((R, 16), seed=60), P("x"))
    lowered = _fresh(op).lower(x)
    text = lowered.as_text()
    target = "jaxcomm_" + ("all_reduce" if op.startswith("all_reduce") else op)
    assert f"@{target}" in text, text
    assert not XLA_COLLECTIVE_MLIR.search(text), XLA_COLLECTIVE_MLIR.search(text)
    compiled = lowered.compile().as_text()
    assert f'custom_call_target="{target}"' in compiled
    assert not XLA_COLLECTIVE_HLO.search(compiled), XLA_COLLECTIVE_HLO.search(compiled)


@pytest.mark.parametrize("op", list(FALLBACK_OPS))
def test_xla_backend_fallback(op, monkeypatch):
    x_np = data((R, 16), seed=61)
    x = put(x_np, P("x"))
    monkeypatch.delenv("JAXCOMM_BACKEND", raising=False)
    expected = np.asarray(_fresh(op)(x))

    monkeypatch.setenv("JAXCOMM_BACKEND", "xla")
    f = _fresh(op)
    lowered = f.lower(x)
    text = lowered.as_text()
    stablehlo_op = FALLBACK_OPS[op][1]
    assert f"stablehlo.{stablehlo_op}" in text, text
    assert "jaxcomm_" not in text
    compiled = lowered.compile().as_text()
    assert XLA_COLLECTIVE_HLO.search(compiled), compiled
    assert "jaxcomm_" not in compiled
    np.testing.assert_allclose(np.asarray(f(x)), expected, rtol=1e-6)

    # JAXCOMM_BACKEND=jaxcomm on CPU is the default path
    monkeypatch.setenv("JAXCOMM_BACKEND", "jaxcomm")
    g = _fresh(op)
    assert "jaxcomm_" in g.lower(x).as_text()
    np.testing.assert_allclose(np.asarray(g(x)), expected, rtol=1e-6)


def test_invalid_backend_is_rejected(monkeypatch):
    monkeypatch.setenv("JAXCOMM_BACKEND", "nccl-please")
    with pytest.raises(ValueError, match="JAXCOMM_BACKEND"):
        _fresh("all_reduce")(put(data((R, 4)), P("x")))


@pytest.mark.parametrize("raw,message", [("4MiB", "must be a whole number of bytes, got '4MiB'"),
                                         ("-1", "must be >= 0, got -1")])
def test_invalid_nontemporal_bytes_is_rejected(monkeypatch, raw, message):
    from jaxcomm._src import config
    monkeypatch.setenv("JAXCOMM_NONTEMPORAL_BYTES", raw)
    with pytest.raises(ValueError, match=f"JAXCOMM_NONTEMPORAL_BYTES {message}"):
        config.nontemporal_bytes()
    monkeypatch.setenv("JAXCOMM_NONTEMPORAL_BYTES", "0")
    assert config.nontemporal_bytes() == 0


@pytest.mark.parametrize("raw", ["2", "yes", "-1"])
def test_invalid_single_copy_is_rejected(monkeypatch, raw):
    from jaxcomm._src import config
    monkeypatch.setenv("JAXCOMM_SINGLE_COPY", raw)
    with pytest.raises(ValueError, match=f"JAXCOMM_SINGLE_COPY must be 0 or 1, got '{raw}'"):
        config.single_copy()
    monkeypatch.setenv("JAXCOMM_SINGLE_COPY", "0")
    assert config.single_copy() is False
    monkeypatch.delenv("JAXCOMM_SINGLE_COPY")
    assert config.single_copy() is True


# ---------------------------------------------------------------- composition with pjit


def test_jit_with_shardings_around_shard_map():
    w = data((16, 16), seed=70) / 8

    def f(x, w):
        h = jnp.tanh(x @ w)  # auto-sharded: rows over "x"
        s = jax.shard_map(lambda v: jaxcomm.all_reduce(v.sum(0, keepdims=True), "x", timeout_s=T),
                          mesh=MESH, in_specs=P("x"), out_specs=P())(h)
        g = jax.shard_map(lambda v: jaxcomm.all_gather(v, "x", tiled=True, timeout_s=T)[::R],
                          mesh=MESH, in_specs=P("x"), out_specs=P("x"))(h)
        return s * 2, g + h

    fj = jax.jit(f, in_shardings=(NamedSharding(MESH, P("x")), NamedSharding(MESH, P())),
                 out_shardings=(NamedSharding(MESH, P()), NamedSharding(MESH, P("x"))))
    for rep in range(2):
        x = data((R * 4, 16), seed=71 + rep) / 8
        s, g = fj(put(x, P("x")), put(w, P()))
        h = np.tanh(x @ w)
        np.testing.assert_allclose(np.asarray(s), 2 * h.sum(0, keepdims=True), rtol=1e-4, atol=1e-4)
        # every rank gathered all rows and kept rows 0, 8, 16, 24
        np.testing.assert_allclose(np.asarray(g), np.tile(h[::R], (R, 1)) + h, rtol=1e-4, atol=1e-4)
        assert s.sharding.is_equivalent_to(NamedSharding(MESH, P()), 2)


def test_jit_with_shardings_and_resharding_auto_mesh():
    """Auto axes: the input arrives sharded differently from in_specs; XLA reshards."""
    def f(x):
        y = jax.shard_map(lambda v: jaxcomm.all_gather(v, "x", axis=1, tiled=True, timeout_s=T),
                          mesh=AUTO_MESH, in_specs=P(None, "x"), out_specs=P("x"))(x * 3)
        z = jax.shard_map(lambda v: jaxcomm.all_reduce(v, "x", op="max", timeout_s=T),
                          mesh=AUTO_MESH, in_specs=P("x"), out_specs=P())(x)
        return y, z

    fj = jax.jit(f, in_shardings=NamedSharding(AUTO_MESH, P("x")),
                 out_shardings=(NamedSharding(AUTO_MESH, P(None, "x")), NamedSharding(AUTO_MESH, P())))
    x = data((R, R * 2), seed=75)
    y, z = fj(x)
    # each rank gathers its column block from all ranks -> the full x (times 3), per rank
    np.testing.assert_array_equal(np.asarray(y), np.tile(3 * x, (R, 1)))
    np.testing.assert_array_equal(np.asarray(z), x.max(0, keepdims=True))


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather", "all_gather_axis0",
                                "reduce_scatter", "all_to_all", "ppermute"])
def test_partially_manual_shard_map(op):
    """A shard_map manual over "ep" only, inside a program sharded over "dp". Expected:
    the jax.lax results, or else a clear jaxcomm error naming the limitation."""
    cases = {
        "all_reduce": (lambda v: jaxcomm.all_reduce(v, "ep"), lambda v: lax.psum(v, "ep"),
                       P(None, None)),
        "broadcast": (lambda v: jaxcomm.broadcast(v, "ep", root=2),
                      lambda v: lax.psum(jnp.where(lax.axis_index("ep") == 2, v, 0), "ep"),
                      P(None, None)),
        "all_gather_axis0": (lambda v: jaxcomm.all_gather(v, "ep", axis=0, tiled=True),
                             lambda v: lax.all_gather(v, "ep", axis=0, tiled=True), P("ep")),
        "reduce_scatter": (lambda v: jaxcomm.reduce_scatter(v, "ep", scatter_dimension=0, tiled=True),
                           lambda v: lax.psum_scatter(v, "ep", scatter_dimension=0, tiled=True),
                           P("ep")),
        "all_to_all": (lambda v: jaxcomm.all_to_all(v, "ep", 0, 1, tiled=True),
                       lambda v: lax.all_to_all(v, "ep", 0, 1, tiled=True), P(None, "ep")),
        "all_gather": (lambda v: jaxcomm.all_gather(v, "ep", axis=1, tiled=True),
                       lambda v: lax.all_gather(v, "ep", axis=1, tiled=True), P(None, "ep")),
        "ppermute": (lambda v: jaxcomm.ppermute(v, "ep", [(0, 1), (1, 2), (2, 3), (3, 0)]),
                     lambda v: lax.ppermute(v, "ep", [(0, 1), (1, 2), (2, 3), (3, 0)]),
                     P(None, "ep")),
    }
    jc, ref, out_spec = cases[op]

    def program(body, manual=frozenset({"ep"})):
        def f(x):
            if "dp" in manual:
                x = jax.reshard(x, NamedSharding(MESH2, P(None, "ep")))
            y = jax.shard_map(body, mesh=MESH2, in_specs=P(None, "ep"), out_specs=out_spec,
                              axis_names=manual)(x * 2)
            return y + 1
        return jax.jit(f)

    x = put(data((8, 8), seed=80), P("dp", "ep"), MESH2)
    # Reference: jax.lax in a shard_map manual over both axes, whose body sees the same
    # blocks (the operand is replicated over "dp"). (jax.lax.all_to_all itself fails in a
    # partially manual shard_map on jax 0.10.2.)
    expected = np.asarray(program(ref, manual=frozenset({"dp", "ep"}))(x))
    try:
        got = np.asarray(program(jc)(x))
    except Exception as e:  # noqa: BLE001 - judged below
        msg = str(e)
        clear = (isinstance(e, (NotImplementedError, ValueError, TypeError)) and
                 f"jaxcomm.{op.replace('_axis0', '')}" in msg and
                 re.search(r"manual|axis_names|partial", msg))
        assert clear, (f"jaxcomm.{op} in a partially manual shard_map neither worked nor raised a "
                       f"clear jaxcomm error; got {type(e).__name__}: {msg[:600]}")
        return
    np.testing.assert_array_equal(got, expected)
