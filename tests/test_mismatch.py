"""Ranks of a group that wait in different collectives fail within the grace period with a
MISMATCH error naming both sides (ffi/core/mismatch.h), instead of at the deadline.

* In one process (8 emulated devices): a ``lax.cond``/``lax.switch`` whose branch differs
  by rank puts the ranks in different collectives (another op, another call site); every
  rank fails, each error naming every side, and the process goes on.
* Across processes, over shared memory and over TCP (one job per transport, both at
  once): a different op at the same step, then two jitted programs dispatched in
  opposite orders, then two programs that call one helper collective (one call site) in
  opposite orders, then two such programs that differ only in a literal; every process fails with a MISMATCH error naming both call sites (and
  programs) and the processes on each side, and the flight recorder's verdict is MISMATCH
  with both call sites. Programs compiled in opposite orders still pair (after the one
  above, each process has compiled only one of its two programs). Then a process that is merely late (asleep in Python, in no collective)
  is not a mismatch: its peers wait for it past the grace period and the call completes.

Every collective has a 120 s deadline and the grace period is 1 s: that an error
arrives before the deadline is what says it was the mismatch check, not the deadline.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from jaxcomm import _jaxcomm
from jaxcomm._src import runtime
from jaxcomm.trace import analyzer, causes
from mp_util import PROLOGUE, launch_script

R = 8
MESH = jax.make_mesh((R,), ("x",))
RING = [(k, (k + 1) % R) for k in range(R)]
DEADLINE_S = 120
GRACE_S = 1
RUNTIME_ERRORS = tuple({getattr(jax.errors, n) for n in ("JaxRuntimeError", "XlaRuntimeError")
                        if hasattr(jax.errors, n)})


def _line_of(marker: str, source: str | None = None) -> int:
    """The line number of ``marker`` in ``source`` (default: this file)."""
    if source is None:
        with open(__file__) as f:
            source = f.read()
    return next(i for i, line in enumerate(source.splitlines(), 1) if marker in line)


def _smap(body):
    return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("x"), out_specs=P("x"),
                                 check_vma=False))


@pytest.fixture
def short_grace():
    """A 1 s grace period for this test (the registry's value, restored afterwards)."""
    runtime.ensure_registered()  # registration sets it from the environment
    before = _jaxcomm.mismatch_grace_ms()
    _jaxcomm.set_mismatch_grace_ms(GRACE_S * 1000)
    yield
    _jaxcomm.set_mismatch_grace_ms(before)


def _entries_at(*lines: int) -> list[dict]:
    """The flight recorder's entries of the calls at these lines of this file."""
    sites = tuple(f"test_mismatch.py:{n} " for n in lines)
    return [e for e in jaxcomm.trace.snapshot()["entries"] if e["call_site"].startswith(sites)]


def _fails_fast(f, x) -> str:
    """Runs f(x), which must fail before the deadline; returns the error."""
    start = time.monotonic()
    with pytest.raises(RUNTIME_ERRORS) as info:
        jax.block_until_ready(f(x))
    assert time.monotonic() - start < DEADLINE_S
    return str(info.value)


def _ranks_branch(v):
    def site_a(u):
        return jaxcomm.all_reduce(u, "x", timeout_s=DEADLINE_S)  # SITE-A
    def site_b(u):
        return jaxcomm.ppermute(u, "x", RING, timeout_s=DEADLINE_S)  # SITE-B
    return lax.cond(lax.axis_index("x") < 4, site_a, site_b, v)


def test_ranks_in_different_collectives_fail_within_the_grace_period(short_grace):
    x = jax.device_put(jnp.ones((R, 4)), NamedSharding(MESH, P("x")))
    msg = _fails_fast(_smap(_ranks_branch), x)
    a, b = _line_of("# SITE-A"), _line_of("# SITE-B")
    assert "MISMATCH: " in msg, msg
    assert f"wait in all_reduce at test_mismatch.py:{a} " in msg, msg
    assert f"wait in ppermute at test_mismatch.py:{b} " in msg, msg
    assert "ranks [0 1 2 3] (partitions [0 1 2 3]) wait in all_reduce" in msg, msg
    assert "ranks [4 5 6 7] (partitions [4 5 6 7]) wait in ppermute" in msg, msg
    assert f"grace period ({GRACE_S} s, JAXCOMM_MISMATCH_GRACE_S)" in msg, msg
    # Every rank failed so, on both sides, each naming the other's call.
    entries = _entries_at(a, b)
    assert sorted(e["partition"] for e in entries) == list(range(R)), entries
    for e in entries:
        assert e["state"] == "failed" and e["error"].startswith("MISMATCH: "), e
        assert f"test_mismatch.py:{a} " in e["error"] and f"test_mismatch.py:{b} " in e["error"], e
        here = f"wait in {e['op']} at {e['call_site']} (execution #1, this call)"
        assert here in e["error"], e
    # The process goes on: a collective after it is exact.
    y = np.arange(R * 4, dtype=np.float32).reshape(R, 4)
    got = _smap(lambda v: jaxcomm.all_reduce(v, "x", timeout_s=DEADLINE_S))(
        jax.device_put(y, NamedSharding(MESH, P("x"))))
    np.testing.assert_array_equal(np.asarray(got), np.tile(y.sum(0), (R, 1)))


def _three_ways(v):
    def one(u):
        return jaxcomm.all_reduce(u, "x", timeout_s=DEADLINE_S)  # WAY-1
    def two(u):
        return jaxcomm.all_gather(u, "x", tiled=True, timeout_s=DEADLINE_S)[:1]  # WAY-2
    def three(u):
        return jaxcomm.all_reduce(u, "x", op="max", timeout_s=DEADLINE_S)  # WAY-3
    which = jnp.searchsorted(jnp.array([2, 4]), lax.axis_index("x"), side="right")
    return lax.switch(which, [one, two, three], v)


def test_three_sides_all_fail_naming_each_other(short_grace):
    # Ranks 0-1, 2-3 and 4-7 in three collectives (two ops, three call sites): one
    # cycle of waits, every round of it fails at once.
    x = jax.device_put(jnp.ones((R, 4)), NamedSharding(MESH, P("x")))
    msg = _fails_fast(_smap(_three_ways), x)
    lines = [_line_of(f"# WAY-{k}") for k in (1, 2, 3)]
    for n in lines:
        assert f"test_mismatch.py:{n} " in msg, msg
    entries = _entries_at(*lines)
    assert sorted(e["partition"] for e in entries) == list(range(R)), entries
    for e in entries:
        assert e["state"] == "failed" and e["error"].startswith("MISMATCH: "), e
        assert all(f"test_mismatch.py:{n} " in e["error"] for n in lines), e


def test_a_late_rank_is_no_mismatch(short_grace):
    # Rank 3 sleeps in a host callback, in no collective, twice the grace period: the
    # others wait for it, and the call completes exactly.
    def late(r, u):
        if int(r) == 3:
            time.sleep(2 * GRACE_S)
        return u

    def body(v):
        v = jax.pure_callback(late, jax.ShapeDtypeStruct(v.shape, v.dtype), lax.axis_index("x"), v)
        return jaxcomm.all_reduce(v, "x", timeout_s=DEADLINE_S)

    y = np.arange(R * 4, dtype=np.float32).reshape(R, 4)
    got = _smap(body)(jax.device_put(y, NamedSharding(MESH, P("x"))))
    np.testing.assert_array_equal(np.asarray(got), np.tile(y.sum(0), (R, 1)))


# ------------------------------------------------------------------- across processes

SCRIPT = f"""
import json, time
from jaxcomm.trace import causes
print("PID", os.getpid(), flush=True)
mesh = jax.make_mesh((jax.device_count(),), ("x",))
smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
T = {DEADLINE_S}
op_a = smap(lambda v: jaxcomm.all_reduce(v, "x", timeout_s=T))  # OP-A
op_b = smap(lambda v: jaxcomm.all_gather(v, "x", timeout_s=T)[:1])  # OP-B
first = smap(lambda v: jaxcomm.all_reduce(v * 2, "x", op="max", timeout_s=T))  # ORDER-F
ring = [(k, (k + 1) % (NPROC * LOCAL)) for k in range(NPROC * LOCAL)]
second = smap(lambda v: jaxcomm.ppermute(v, "x", ring, timeout_s=T))  # ORDER-G
total = smap(lambda v: jaxcomm.all_reduce(v, "x", timeout_s=T))  # LATE
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                           np.full((LOCAL, 4), RANK + 1, np.float32))
jax.block_until_ready(total(x))  # every process compiled and linked


def report(tag, calls):
    # Each call's outcome: dispatch runs the program at once with one device per
    # process (its error is raised there), else the results fail when awaited.
    start = time.monotonic()
    out = []
    try:
        pending = [call() for call in calls]
    except Exception as e:
        out.append(causes.clean(str(e)))
    else:
        for r in pending:
            try:
                jax.block_until_ready(r)
                out.append("ok")
            except Exception as e:
                out.append(causes.clean(str(e)))
    print(tag, json.dumps({{"outcomes": out, "elapsed": time.monotonic() - start}}), flush=True)


# A different op at the same step.
report("OP", [lambda: (op_a if RANK == 0 else op_b)(x)])
# Two programs dispatched in opposite orders.
order = [lambda: first(x), lambda: second(x)]
report("ORDER", order if RANK == 0 else order[::-1])
# Two programs that call one helper collective (one call site), in opposite orders:
# their calls must not pair with each other.
def helper(v):
    return jaxcomm.all_reduce(v, "x", timeout_s=T)  # HELPER
one = smap(lambda v: helper(v))
ten = smap(lambda v: helper(v * 10))
same_site = [lambda: one(x), lambda: ten(x)]
report("SAME-SITE", same_site if RANK == 0 else same_site[::-1])
# Two programs that differ only in a literal's value (the program digest counts it), in
# opposite orders: their calls must not pair either.
four = smap(lambda v: helper(v * 4))
six = smap(lambda v: helper(v * 6))
literal = [lambda: four(x), lambda: six(x)]
report("LITERAL", literal if RANK == 0 else literal[::-1])
# Compiled in opposite orders, run in one order: they pair, each with itself (v * 3 has the
# structure of ten, compiled by process 1 only).
def total_of(r):
    return float(np.asarray(r.addressable_shards[0].data)[0, 0])
progs = [smap(lambda v: helper(v + 1)), smap(lambda v: helper(v * 3))]
compiled = [p.lower(x).compile() for p in (progs if RANK == 0 else progs[::-1])]
compiled = compiled if RANK == 0 else compiled[::-1]
print("COMPILE-ORDER", json.dumps([total_of(c(x)) for c in compiled]), flush=True)
# A process in no collective, late by twice the grace period: no mismatch.
if RANK == 1:
    time.sleep(2 * {GRACE_S})
y = np.asarray(total(x).addressable_shards[0].data)
print("LATE", json.dumps({{"sum": float(y[0, 0])}}), flush=True)
"""

#: Devices per process for each transport's job: several local ranks over shared memory
#: (their round meets in the process first, and programs are dispatched asynchronously).
JOBS = {"auto": 2, "tcp": 1}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Both transports' jobs, run at once: {transport: (LaunchResult, trace dir)}."""
    # The directories first, in this thread: the first mktemp of a worker also creates
    # pytest's base directory, and two threads doing that at once raced (FileExistsError).
    traces = {t: tmp_path_factory.mktemp(f"mismatch-{t}") for t in JOBS}

    def run(transport):
        trace = traces[transport]
        res = launch_script(SCRIPT, 2, JOBS[transport], timeout_s=240, grace_s=10,
                            env={"JAXCOMM_TRANSPORT": transport, "JAXCOMM_TRACE_DIR": str(trace),
                                 "JAXCOMM_MISMATCH_GRACE_S": str(GRACE_S)})
        return res, str(trace)

    with concurrent.futures.ThreadPoolExecutor(len(JOBS)) as pool:
        futures = {t: pool.submit(run, t) for t in JOBS}
        return {t: f.result() for t, f in futures.items()}


def _tagged(res, rank: int, tag: str) -> dict:
    for line in res.output(rank).splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    raise AssertionError(f"rank {rank} printed no {tag} line:\n{res.format()}")


def _site(marker: str) -> str:
    """`script.py:N`: where the job's script (after mp_util's prologue) has ``marker``."""
    return f"script.py:{_line_of(marker, PROLOGUE + textwrap.dedent(SCRIPT))}"


@pytest.mark.parametrize("transport", sorted(JOBS))
def test_processes_in_different_collectives_fail_within_the_grace_period(jobs, transport):
    res, trace = jobs[transport]
    assert res.returncode == 0, res.format()
    local = JOBS[transport]
    pid = {r: int(_tagged(res, r, "PID")) for r in range(2)}
    for tag, (mine, theirs) in {"OP": ("OP-A", "OP-B"), "ORDER": ("ORDER-F", "ORDER-G")}.items():
        for rank in range(2):
            got = _tagged(res, rank, tag)
            assert got["elapsed"] < DEADLINE_S, got
            here, there = (mine, theirs) if rank == 0 else (theirs, mine)
            first = got["outcomes"][0]
            # This process's side, then the other's, each with its call site and ranks.
            ranks = lambda r: " ".join(str(r * local + k) for k in range(local))
            assert re.search(
                rf"MISMATCH: process {rank} \(host [^,]*, pid {pid[rank]}\) with ranks \[{ranks(rank)}\] "
                rf"\(partitions \[{ranks(rank)}\]\) waits in \S+ at {_site(here)} ", first), (
                f"{transport} {tag} rank {rank}: {first}")
            assert re.search(
                rf"process {1 - rank} \(host [^,]*, pid {pid[1 - rank]}\) with ranks \[{ranks(1 - rank)}\] "
                rf"\(partitions \[{ranks(1 - rank)}\]\) waits in \S+ at {_site(there)} ", first), (
                f"{transport} {tag} rank {rank}: {first}")
            assert f"({GRACE_S} s, JAXCOMM_MISMATCH_GRACE_S)" in first, first
            # A program dispatched after the failed one, into the call the peer waited
            # in, fails too: it does not complete with the peer's contribution.
            assert all("MISMATCH: " in o for o in got["outcomes"]), got
        blamed = {(b.process, b.call_site) for b in causes.blames(_tagged(res, 0, tag)["outcomes"][0])}
        assert {(p, site.split(" in jit_")[0]) for p, site in blamed} == {
            (0, f"{_site(mine)} (<lambda>)"), (1, f"{_site(theirs)} (<lambda>)")}, blamed
    # One helper's call site in two programs (also two that differ only in a literal):
    # each side names its program, and they differ.
    helper = f"{_site('# HELPER')} (helper) in "
    for rank in range(2):
        for tag in ("SAME-SITE", "LITERAL"):
            got = _tagged(res, rank, tag)
            assert got["elapsed"] < DEADLINE_S and all("MISMATCH: " in o for o in got["outcomes"]), (
                tag, got)
            programs = re.findall("waits in all_reduce at " + re.escape(helper) + r"(jit_\S+#[0-9a-f]{8})",
                                  got["outcomes"][0])
            assert len(programs) == 2 and programs[0] != programs[1], (tag, got["outcomes"][0])
    # Compiled in opposite orders, the programs still pair with themselves: sums of
    # x + 1 and of 3 x over every rank (x = process index + 1 on each of its ranks).
    for rank in range(2):
        assert _tagged(res, rank, "COMPILE-ORDER") == [5.0 * local, 9.0 * local], res.format()
    # A late process is no mismatch: the call completed, exactly.
    assert [_tagged(res, r, "LATE")["sum"] for r in range(2)] == [3.0 * local] * 2, res.format()

    # The flight recorder: MISMATCH first, naming both call sites of the first mismatch;
    # the second one too, and nothing else.
    # (The late process shows as a straggler, not as a fault.)
    report = analyzer.analyze(trace)
    assert report.kind == "mismatch", report.text()
    faults = [f for f in report.findings if f.kind != "straggler"]
    assert [f.kind for f in faults] == ["mismatch"] * 4, report.text()
    for f, (a, b) in zip(faults, [("OP-A", "OP-B"), ("ORDER-F", "ORDER-G"), ("HELPER", "HELPER"),
                                  ("HELPER", "HELPER")]):
        ranks = lambda r: ", ".join(str(r * local + k) for k in range(local))
        assert f"ranks [{ranks(0)}] (process 0) wait in " in f.summary, f.summary
        assert f"ranks [{ranks(1)}] (process 1) wait in " in f.summary, f.summary
        assert f"{_site(a)} " in f.summary and f"{_site(b)} " in f.summary, report.text()
        assert f.processes == [0, 1], report.text()
    assert report.verdict.startswith("verdict: MISMATCH: program mismatch: "), report.verdict
