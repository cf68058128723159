"""The flight recorder, its dumps, the analyzer, the exporters, stats() and fault
injection (JAXCOMM_FAULT).

Fault runs happen in child processes (JAXCOMM_FAULT and JAXCOMM_TRACE_DIR are read once
at start) with 2-3 s collective timeouts; the analyzer then reads their real dumps. They
run once for the module (fixtures ``children`` and ``two_process_jobs``), one after the
other, each forked from one Python that imported jax (tests/fresh_util.py).
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pathlib
import re
import subprocess
from typing import NamedTuple

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from jaxcomm.trace import __main__ as trace_main
from jaxcomm.trace import analyzer, causes, exporter, ringfile
from fresh_util import Command, run_fresh

R = 8
MESH = jax.make_mesh((R,), ("x",))


def smap(body):
    return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("x"), out_specs=P("x"),
                                 check_vma=False))


def put(x):
    return jax.device_put(x, NamedSharding(MESH, P("x")))


with open(__file__) as _f:
    _SOURCE = _f.read().splitlines()


def _line_of(marker: str) -> int:
    """The line of this file that carries ``marker`` (a call site under test)."""
    return next(i for i, text in enumerate(_SOURCE, 1) if marker in text and "_line_of" not in text)


def _mine(entries, marker):
    """The entries of the call site marked ``marker``, of its latest instruction (each
    test compiles its own program)."""
    site = f"test_trace.py:{_line_of(marker)} "
    ours = [e for e in entries if e["call_site"].startswith(site)]
    if not ours:
        return []
    latest = max(ours, key=lambda e: e["enqueue_us"])["instruction"]
    return [e for e in ours if e["instruction"] == latest]


# --------------------------------------------------------------- recorder in this process


def _known_sequence():
    """3 all_reduces of f32[1,4] and 2 all_gathers of i32[1,2] per rank."""
    f = smap(lambda v: jaxcomm.all_reduce(v, "x"))  # TRACE-AR
    g = smap(lambda v: jaxcomm.all_gather(v, "x", tiled=True)[:1])  # TRACE-AG
    x = put(np.ones((R, 4), np.float32))
    y = put(np.ones((R, 2), np.int32))
    for _ in range(3):
        jax.block_until_ready(f(x))
    for _ in range(2):
        jax.block_until_ready(g(y))


def test_recorder_contents_after_known_sequence():
    _known_sequence()
    snap = jaxcomm.trace.snapshot()
    assert snap["version"] == 1 and snap["enabled"] is True
    ar = _mine(snap["entries"], "# TRACE-AR")
    ag = _mine(snap["entries"], "# TRACE-AG")
    assert len(ar) == 3 * R and len(ag) == 2 * R
    for entries, op, dtype, elements, nbytes, runs in ((ar, "all_reduce", "float32", 4, 16, 3),
                                                       (ag, "all_gather", "int32", 2, 8, 2)):
        by_rank = {}
        for e in entries:
            by_rank.setdefault(e["partition"], []).append(e)
            assert e["op"] == op and e["dtype"] == dtype
            assert e["elements"] == elements and e["bytes"] == nbytes
            assert e["state"] == "done" and e["error"] is None
            assert e["group"] == list(range(R)) and e["processes"] == [0]
            assert e["rank"] == e["partition"] and e["axis"] == "'x'"
            assert e["algorithm"] == "in-process zero-copy"
            assert e["enqueue_us"] <= e["start_us"] <= e["end_us"]
        assert sorted(by_rank) == list(range(R))
        for rank_entries in by_rank.values():
            assert [e["execution"] for e in sorted(rank_entries, key=lambda e: e["seq"])] == \
                list(range(1, runs + 1))
        # One instruction: the same key on every rank.
        assert len({e["instruction"] for e in entries}) == 1


def test_stats_match_known_sequence():
    jaxcomm.reset_stats()
    _known_sequence()
    rows = {s.op: s for s in jaxcomm.stats(reset=True) if s.group == tuple(range(R))}
    ar, ag = rows["all_reduce"], rows["all_gather"]
    assert (ar.calls, ar.failed, ar.bytes) == (3, 0, 3 * 16)
    assert (ag.calls, ag.failed, ag.bytes) == (2, 0, 2 * 8 * R)  # all_gather: output size
    for s in (ar, ag):
        assert s.total_us >= 0 and s.mean_us == pytest.approx(s.total_us / s.calls)
        if s.total_us > 0:
            algbw = s.bytes / s.total_us / 1e3
            assert s.algbw_gbps == pytest.approx(algbw)
    if ar.total_us > 0:
        assert ar.busbw_gbps == pytest.approx(ar.algbw_gbps * 2 * (R - 1) / R)
    if ag.total_us > 0:
        assert ag.busbw_gbps == pytest.approx(ag.algbw_gbps * (R - 1) / R)
    assert jaxcomm.stats() == []  # reset=True zeroed them


def test_recording_can_be_switched_off():
    f = smap(lambda v: jaxcomm.all_reduce(v, "x"))  # TRACE-OFF
    x = put(np.ones((R, 1), np.float32))
    jaxcomm.trace.set_enabled(False)
    try:
        assert not jaxcomm.trace.enabled()
        jax.block_until_ready(f(x))
        assert _mine(jaxcomm.trace.snapshot()["entries"], "# TRACE-OFF") == []
    finally:
        jaxcomm.trace.set_enabled(True)
    jax.block_until_ready(f(x))
    assert len(_mine(jaxcomm.trace.snapshot()["entries"], "# TRACE-OFF")) == R


_ENTRY_TYPES = dict(partition=int, seq=int, op=str, axis=str, call_site=str, instruction=str,
                    group_index=int, group=list, processes=list, rank=int, execution=int,
                    run_id=int, dtype=str, elements=int, bytes=int, algorithm=str, state=str,
                    error=(str, type(None)), enqueue_us=int, start_us=(int, type(None)),
                    end_us=(int, type(None)), left_out=list)


def test_dump_json_schema(tmp_path):
    _known_sequence()
    path = jaxcomm.trace.dump(tmp_path)
    assert re.fullmatch(rf"jaxcomm-trace-p0-{os.getpid()}\.json", os.path.basename(path))
    with open(path) as f:
        d = json.load(f)
    assert d["format"] == "jaxcomm-trace" and d["version"] == 1 and d["reason"] == "manual"
    assert d["process_index"] == 0 and d["pid"] == os.getpid() and isinstance(d["host"], str)
    assert d["entries_per_rank"] == 2048 and isinstance(d["dumped_at_us"], int)
    assert sorted(r["partition"] for r in d["ranks"]) == list(range(R))
    assert all(r["calls"] >= 5 for r in d["ranks"])
    assert d["entries"]
    for e in d["entries"]:
        assert set(e) == set(_ENTRY_TYPES), set(e) ^ set(_ENTRY_TYPES)
        for k, t in _ENTRY_TYPES.items():
            assert isinstance(e[k], t), (k, e[k])
        assert e["state"] in ("pending", "active", "done", "failed")
        assert re.fullmatch(r"[0-9a-f]{16}", e["instruction"])
    # A file name ending in .json is taken as is.
    assert jaxcomm.trace.dump(tmp_path / "x.json") == str(tmp_path / "x.json")


# ------------------------------------------------------------- fault runs in a child


_CHILD = r"""
import os, signal, sys, time
mode, out = sys.argv[1], sys.argv[2]
import jax, jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxcomm
from jaxcomm import _jaxcomm

mesh = jax.make_mesh((8,), ("x",))
x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("x")))
smap = lambda body: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                          check_vma=False))
# Short deadlines only where a call is meant to time out; generous ones elsewhere, so a
# loaded machine cannot turn a slow call into a failure.
T = {"hang": 2, "late": 2, "mismatch": 2, "exit": 2, "stuck": 6}.get(mode, 30)
if mode == "stuck":  # a dump by SIGUSR1 while the ranks still wait (before the timeout)
    import shutil, threading
    def _poke():
        # Once the 7 other ranks wait in the hung call (however slow compiling was).
        t = time.time() + 60
        while time.time() < t and sum(
                e["op"] == "all_gather" and e["execution"] == 2 and e["state"] == "pending"
                for e in jaxcomm.trace.snapshot()["entries"]) < 7:
            time.sleep(0.05)
        time.sleep(1.2)  # waited long enough to count as stuck (stuck_s=1)
        os.kill(os.getpid(), signal.SIGUSR1)
        t = time.time() + 10
        while _jaxcomm.trace_auto_dumps() < 1 and time.time() < t:
            time.sleep(0.05)
        os.makedirs(os.path.join(out, "..", "stuck"), exist_ok=True)
        shutil.copy(jaxcomm.trace.dump_path(), os.path.join(out, "..", "stuck", "dump.json"))
    threading.Thread(target=_poke).start()
if mode == "mismatch":
    f = smap(lambda v: lax.cond(lax.axis_index("x") < 4,
                                lambda u: jaxcomm.all_reduce(u, "x", timeout_s=T),
                                lambda u: jaxcomm.all_gather(u, "x", tiled=True, timeout_s=T)[:1],
                                v))
    g = None
else:
    f = smap(lambda v: jaxcomm.all_reduce(v, "x", timeout_s=T))
    g = smap(lambda v: jaxcomm.all_gather(v, "x", tiled=True, timeout_s=T)[:1])
failed = False
try:
    for i in range(6):
        jax.block_until_ready(f(x))
        if g is not None:
            jax.block_until_ready(g(x))
    print("RAN-OK", flush=True)
except Exception as e:
    failed = True
    print("RAN-ERROR", str(e)[:400], flush=True)
deadline = time.time() + 20
if failed:  # the automatic dump on a timeout, from the recorder's own thread
    while _jaxcomm.trace_auto_dumps() < 1 and time.time() < deadline:
        time.sleep(0.05)
    print("AUTO-DUMPS", _jaxcomm.trace_auto_dumps(), flush=True)
if mode == "signal":
    os.kill(os.getpid(), signal.SIGUSR1)
    while _jaxcomm.trace_auto_dumps() < 1 and time.time() < deadline:
        time.sleep(0.05)
    import shutil
    shutil.copy(jaxcomm.trace.dump_path(), os.path.join(out, "..", "signal.json"))
    print("SIGNAL-DUMPS", _jaxcomm.trace_auto_dumps(), flush=True)
"""


#: What a child gets of this session's recorder and fault settings: none (a command sets
#: its own).
_CLEARED = {"JAXCOMM_FAULT": None, "JAXCOMM_TRACE_DIR": None, "JAXCOMM_TRACE_ENTRIES": None}

#: The runs of _CHILD: name -> (mode, JAXCOMM_FAULT).
FAULT_RUNS = {
    "clean": ("signal", None),
    "hang": ("hang", "rank=3,op=all_reduce,call=5,action=hang"),
    "stuck": ("stuck", "rank=6,op=all_gather,call=2,action=hang"),
    # Two faults: the second selects no call of this program (no broadcast) and must not fire.
    "delay": ("delay", "rank=5,op=all_gather,call=2,action=delay:1.5; op=broadcast,action=exit"),
    "late": ("late", "rank=4,op=all_reduce,call=2,action=delay:3"),
    "mismatch": ("mismatch", None),
    "exit": ("exit", "rank=2,op=all_reduce,call=2,action=exit"),
}
#: The runs of _KILLED: name -> JAXCOMM_FAULT.
KILLED_RUNS = {"killed": None, "killed after a hang": "rank=5,op=all_reduce,call=4,action=hang"}


class Child(NamedTuple):
    """A child's exit status and output (``proc``), its JAXCOMM_TRACE_DIR (``out``, in
    ``tmp``, a directory of its own)."""

    proc: subprocess.CompletedProcess
    out: pathlib.Path
    tmp: pathlib.Path


@pytest.fixture(scope="module")
def children(tmp_path_factory) -> dict[str, Child]:
    """Every child process of this module but the two-process jobs, by name.

    Each starts as ``python -c`` (or ``-m``) would, with its own JAXCOMM_* settings; a
    real new Python for each would import jax again, 2-3 s of CPU each."""
    commands, dirs = {}, {}

    def add(name, command_for_out):
        tmp = tmp_path_factory.mktemp(name.replace(" ", "-"))
        dirs[name] = (tmp / "dumps", tmp)
        commands[name] = command_for_out(tmp / "dumps")

    for name, (mode, fault) in FAULT_RUNS.items():
        add(name, lambda out, mode=mode, fault=fault: Command(
            code=_CHILD, args=[mode, out], env={**_CLEARED, "JAXCOMM_TRACE_DIR": str(out),
                                                 "JAXCOMM_FAULT": fault}))
    # The analyzer's command as a user types it (the other tests call its main() here),
    # on the clean run's dumps: after that run.
    clean_out = dirs["clean"][0]
    add("analyze clean", lambda out: Command(
        module="jaxcomm.trace", args=["analyze", clean_out, "--straggler-ms", 1000], env=_CLEARED))
    for name, fault in KILLED_RUNS.items():
        add(name, lambda out, fault=fault: Command(
            code=_KILLED, args=["1" if fault else "30"],
            env={**_CLEARED, "JAXCOMM_TRACE_DIR": str(out), "JAXCOMM_FAULT": fault}))
    add("entries zero", lambda out: Command(
        code=_ENTRIES_ZERO, env={**_CLEARED, "JAXCOMM_TRACE_ENTRIES": "0"}))
    add("malformed fault", lambda out: Command(
        code="import jaxcomm", env={**_CLEARED, "JAXCOMM_FAULT": "rank=1,action=explode"}))
    # The launcher imports jaxcomm too: it must not look like one more process 0.
    add("records nothing", lambda out: Command(
        code="import jaxcomm", env={**_CLEARED, "JAXCOMM_TRACE_DIR": str(out)}))
    for out, _ in dirs.values():
        out.mkdir()
    done = run_fresh(commands, timeout_s=280)
    return {name: Child(done[name], *dirs[name]) for name in commands}


def _run(children, name) -> tuple[subprocess.CompletedProcess, pathlib.Path]:
    return children[name].proc, children[name].out


def _cli(*args) -> subprocess.CompletedProcess:
    """``python -m jaxcomm.trace ARGS``: its exit status and output, run here (the
    module's main(), as the command runs it; ``children`` runs it as a user types it)."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = trace_main.main(argv)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def _exit_dump(out):
    files = list(out.glob("jaxcomm-trace-p0-*.json"))
    assert len(files) == 1, files
    with open(files[0]) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def clean_run(children):
    proc, out, tmp = children["clean"]
    assert proc.returncode == 0 and "RAN-OK" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    return proc, out, tmp


def test_clean_run_verdict_and_exit_dump(clean_run, children):
    proc, out, tmp = clean_run
    assert _exit_dump(out)["reason"] == "exit"
    # A loaded machine may delay a device thread by tens of ms: a generous threshold.
    report = analyzer.analyze(out, straggler_ms=1000)
    assert report.kind == "clean" and report.exit_code == 0, report.text()
    assert report.calls == 12 and report.ranks == list(range(R))
    cli = children["analyze clean"].proc
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert cli.stdout.splitlines()[0].startswith("verdict: clean: 12 calls on 8 ranks")


def test_sigusr1_dumps(clean_run):
    proc, out, tmp = clean_run
    assert "SIGNAL-DUMPS 1" in proc.stdout, proc.stdout
    with open(tmp / "signal.json") as f:
        d = json.load(f)
    assert d["reason"] == "signal" and len(d["entries"]) == 12 * R


def test_perfetto_has_one_track_per_rank(clean_run, tmp_path):
    _, out, _ = clean_run
    cli = _cli("export", out, "--perfetto", tmp_path / "t.json")
    assert cli.returncode == 0, cli.stderr
    with open(tmp_path / "t.json") as f:
        doc = json.load(f)
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] != "wait"]
    assert len(slices) == 12 * R
    assert {(e["pid"], e["tid"]) for e in slices} == {(0, r) for r in range(R)}
    names = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert names == {f"rank {r}" for r in range(R)}
    assert {e["name"] for e in slices} == {"all_reduce", "all_gather"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)


def test_plot(clean_run, tmp_path):
    pytest.importorskip("matplotlib")
    _, out, _ = clean_run
    exporter.plot(out, tmp_path / "p.png")
    with open(tmp_path / "p.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_title_keeps_a_long_verdict_whole():
    # A MISMATCH verdict of 8 processes with 64-hex-digit program hashes: the title holds
    # each process's words and a readable prefix of each hash, on lines that fit.
    hashes = [f"{i:x}" * 64 for i in range(8)]
    verdict = "MISMATCH: " + ", ".join(f"process {i} ran program {h}" for i, h in enumerate(hashes))
    title = exporter.plot_title(verdict)
    lines = title.splitlines()
    assert 1 < len(lines) <= 3 and all(len(l) <= exporter.TITLE_WIDTH for l in lines), title
    for i, h in enumerate(hashes):
        assert f"process {i} ran program {h[:8]}…" in title.replace("\n", " "), title
    assert not any(h[:9] in title for h in hashes), title
    assert exporter.plot_title("clean: 12 calls") == "clean: 12 calls"


def test_injected_hang_names_the_missing_rank(children):
    proc, out = _run(children, "hang")
    assert "RAN-ERROR" in proc.stdout and "waiting for ranks [3]" in proc.stdout, proc.stdout
    assert "AUTO-DUMPS 1" in proc.stdout or "AUTO-DUMPS 2" in proc.stdout, proc.stdout
    report = analyzer.analyze(out)
    assert report.kind == "hang", report.text()
    top = report.findings[0]
    assert (top.op, top.execution, top.culprits) == ("all_reduce", 5, [3]), report.text()
    assert top.waiting == [0, 1, 2, 4, 5, 6, 7]
    cli = _cli("analyze", out)
    assert cli.returncode == 1
    first = cli.stdout.splitlines()[0]
    assert first.startswith("verdict: HANG: ranks [3] never arrived at all_reduce"), first
    assert "execution 5" in first


def test_sigusr1_dump_of_a_stuck_job_names_the_missing_rank(children):
    proc, out, tmp_path = children["stuck"]
    assert "RAN-ERROR" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    with open(tmp_path / "stuck" / "dump.json") as f:
        d = json.load(f)
    assert d["reason"] == "signal"
    assert {e["state"] for e in d["entries"] if e["op"] == "all_gather" and e["execution"] == 2} \
        == {"pending"}
    report = analyzer.analyze(tmp_path / "stuck", stuck_s=1)
    assert report.kind == "hang", report.text()
    top = report.findings[0]
    assert (top.op, top.execution, top.culprits) == ("all_gather", 2, [6]), report.text()
    assert "timed out" not in top.summary  # they were still waiting
    # Waiting less than --stuck-s is not yet a fault.
    assert analyzer.analyze(tmp_path / "stuck", stuck_s=60).kind in ("clean", "straggler")


def test_injected_delay_names_the_straggler(children):
    proc, out = _run(children, "delay")
    assert "RAN-OK" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    report = analyzer.analyze(out)
    assert report.kind == "straggler" and report.exit_code == 2, report.text()
    top = report.findings[0]
    assert (top.op, top.execution, top.culprits) == ("all_gather", 2, [5]), report.text()
    assert top.seconds >= 1.4
    cli = _cli("analyze", out)
    assert cli.returncode == 2
    assert cli.stdout.startswith("verdict: STRAGGLER: rank 5 arrived"), cli.stdout
    # The fault's line says what its call=2 counted: calls of one op by one rank, not steps.
    assert ("(call 2 counting rank 5's calls of all_gather at any call site since the process "
            "started, calls not steps, at ") in proc.stderr, proc.stderr[-2000:]


def test_rank_later_than_the_deadline_is_named(children):
    proc, out = _run(children, "late")
    assert "RAN-ERROR" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    report = analyzer.analyze(out)
    assert report.kind == "hang", report.text()
    top = report.findings[0]
    assert (top.op, top.execution, top.culprits) == ("all_reduce", 2, [4]), report.text()
    assert top.waiting == [0, 1, 2, 3, 5, 6, 7]
    assert "had timed out" in top.summary


def test_mismatched_ops_are_a_program_mismatch(children):
    proc, out = _run(children, "mismatch")
    assert "RAN-ERROR" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    # Failed as a mismatch within its grace period (a tenth of the 2 s deadline), not by it.
    assert "MISMATCH: " in proc.stdout and "timed out" not in proc.stdout, proc.stdout
    report = analyzer.analyze(out)
    assert report.kind == "mismatch", report.text()
    top = report.findings[0]
    sides = {top.op: top.waiting}
    assert sorted(top.waiting + top.culprits) == list(range(R))
    assert {tuple(top.waiting), tuple(top.culprits)} == {(0, 1, 2, 3), (4, 5, 6, 7)}
    assert "all_reduce" in top.summary and "all_gather" in top.summary, sides
    assert _cli("analyze", out).returncode == 1


def test_injected_exit(children):
    proc, out = _run(children, "exit")
    assert proc.returncode == 17, proc.stdout + proc.stderr[-2000:]
    assert "JAXCOMM_FAULT 'rank=2,op=all_reduce,call=2,action=exit' fired" in proc.stderr
    assert list(out.glob("*.json")) == []  # like a crash: no exit dump


_ENTRIES_ZERO = r"""
import jax, jax.numpy as jnp, jaxcomm
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((8,), ('x',))
x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P('x')))
f = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, 'x'), mesh=mesh,
                          in_specs=P('x'), out_specs=P('x')))
import numpy as np; print('SUM', float(np.asarray(f(x))[0, 0]))
jaxcomm.trace.set_enabled(True)  # no rings: stays off
s = jaxcomm.trace.snapshot()
print('OFF', jaxcomm.trace.enabled(), len(s['entries']), s['entries_per_rank'],
      jaxcomm.stats())
"""


def test_trace_entries_zero_turns_the_recorder_off(children):
    proc = children["entries zero"].proc
    assert "SUM 8.0" in proc.stdout and "OFF False 0 0 []" in proc.stdout, (
        proc.stdout + proc.stderr[-2000:])


def test_malformed_fault_is_rejected(children):
    proc = children["malformed fault"].proc
    assert proc.returncode != 0
    assert "JAXCOMM_FAULT: in 'rank=1,action=explode': unknown action 'explode'" in proc.stderr


def test_analyzer_on_an_empty_directory(tmp_path):
    report = analyzer.analyze(tmp_path)
    assert report.kind == "empty" and report.exit_code == 0


# ------------------------------------------------------------------- two processes


_MP_CHILD = r"""
import os, socket, sys, time
import jax
# Process 0 finds a free port for the coordinator and tells process 1 through a file.
me = int(os.environ["MP_ID"])
port_file = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), "coordinator-port")
if me == 0:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(port_file + ".tmp", "w") as f:
        f.write(str(port))
    os.replace(port_file + ".tmp", port_file)
else:
    deadline = time.time() + 60
    while not os.path.exists(port_file) and time.time() < deadline:
        time.sleep(0.02)
    with open(port_file) as f:
        port = int(f.read())
jax.distributed.initialize(f"127.0.0.1:{port}", 2, me,
                           heartbeat_timeout_seconds=30, shutdown_timeout_seconds=5)
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxcomm
mesh = jax.make_mesh((4,), ("x",))
if os.environ.get("MP_MODE") == "mismatch":  # process 1 runs another op at the same call site
    body = lambda v: jaxcomm.all_reduce(v, "x", timeout_s=4) if jax.process_index() == 0 else jaxcomm.all_gather(v, "x", tiled=True, timeout_s=4)[:1]
else:
    body = lambda v: jaxcomm.all_reduce(v, "x", timeout_s=4)
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), jnp.ones((2, 4)))
try:
    for i in range(5):
        jax.block_until_ready(f(x))
    print("RAN-OK", flush=True)
except Exception as e:
    print("RAN-ERROR", str(e)[:300], flush=True)
jaxcomm.trace.dump(sys.argv[1])
# Process 0 hosts the coordination service: it must outlive the other's error path.
from jax._src import distributed
me = jax.process_index()
client = distributed.global_state.client
if os.environ.get("MP_WAIT") == "1":
    client.key_value_set(f"test/done/{me}", "1")
    client.blocking_key_value_get(f"test/done/{1 - me}", 60000)
    print("BOTH-DONE", flush=True)
os._exit(0)  # skip jax.distributed's shutdown barrier: nothing is left to agree on
"""


#: The line of _MP_CHILD's mismatched call site (``python -c`` numbers them from 1).
_MP_BODY_LINE = next(i for i, text in enumerate(_MP_CHILD.splitlines(), 1)
                     if text.startswith("    body = lambda v:") and "all_gather" in text)

#: The jobs of 2 processes x 2 devices running _MP_CHILD: name -> (JAXCOMM_FAULT, MP_WAIT
#: (whether each waits for the other before it exits), MP_MODE, JAXCOMM_TRANSPORT,
#: JAXCOMM_MATCH_PROGRAMS).
TWO_PROCESS_RUNS = {
    "hang": ("rank=2,op=all_reduce,call=3,action=hang", True, "", "auto", "1"),
    "exit auto": ("process=1,op=all_reduce,call=3,action=exit", False, "", "auto", "1"),
    "exit tcp": ("process=1,op=all_reduce,call=3,action=exit", False, "", "tcp", "1"),
    "mismatch 1": ("", True, "mismatch", "auto", "1"),
    "mismatch 0": ("", True, "mismatch", "auto", "0"),
}


@pytest.fixture(scope="module")
def two_process_jobs(tmp_path_factory) -> dict[str, tuple[list[tuple[int, str, str]], pathlib.Path]]:
    """Each job of TWO_PROCESS_RUNS: ([(rc, stdout, stderr)] of processes 0 and 1, the
    directory of their dumps). One job after the other, its two processes at once, each
    forked from one Python that imported jax (as ``children``)."""
    commands, outs = {}, {}
    for name, (fault, wait, mode, transport, match_programs) in TWO_PROCESS_RUNS.items():
        out = tmp_path_factory.mktemp(name.replace(" ", "-")) / "dumps"
        outs[name] = out
        for i in range(2):
            env = {**_CLEARED, "MP_ID": str(i), "MP_WAIT": "1" if wait else "0",
                   "MP_MODE": mode, "JAXCOMM_TRANSPORT": transport,
                   "JAXCOMM_MATCH_PROGRAMS": match_programs, "JAXCOMM_FAULT": fault,
                   "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
            commands[f"{name} {i}"] = Command(code=_MP_CHILD, args=[out], env=env, wait=i == 1)
    done = run_fresh(commands, timeout_s=280)
    return {name: ([(p.returncode, p.stdout, p.stderr) for p in (done[f"{name} 0"], done[f"{name} 1"])],
                   out) for name, out in outs.items()}


def test_two_processes_hang_names_the_missing_rank(two_process_jobs):
    results, out = two_process_jobs["hang"]
    for rc, stdout, stderr in results:
        assert "RAN-ERROR" in stdout, stdout + stderr[-2000:]
    report = analyzer.analyze(out)
    assert report.processes == [0, 1], report.text()
    assert report.kind == "hang", report.text()
    top = report.findings[0]
    assert (top.op, top.execution, top.culprits) == ("all_reduce", 3, [2]), report.text()
    assert top.waiting == [0, 1, 3]
    entries = [e for d in analyzer.load(out) for e in d["entries"]]
    assert {e["algorithm"] for e in entries} == {"shm"}
    assert {tuple(e["processes"]) for e in entries} == {(0, 1)}


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_two_processes_exit_names_the_dead_process(two_process_jobs, transport):
    results, out = two_process_jobs[f"exit {transport}"]
    (rc0, stdout0, stderr0), (rc1, _, _) = results
    assert rc1 == 17
    assert "RAN-ERROR" in stdout0 and "with ranks [2 3] (partitions [2 3]) failed" in stdout0, (
        stdout0 + stderr0[-2000:])
    report = analyzer.analyze(out)
    assert report.processes == [0], report.text()
    assert report.kind == "dead", report.text()
    top = report.findings[0]
    assert (top.op, top.execution, top.culprits) == ("all_reduce", 3, [2, 3]), report.text()
    assert "process 1" in top.summary and "no dump" in top.summary
    assert top.waiting == [0, 1]
    entries = analyzer.load(out)[0]["entries"]
    assert {e["algorithm"] for e in entries} == {"shm" if transport == "auto" else "tcp"}


@pytest.mark.parametrize("match_programs", ["1", "0"])
def test_two_processes_running_different_ops_are_a_mismatch(two_process_jobs, match_programs):
    results, out = two_process_jobs[f"mismatch {match_programs}"]
    # The processes traced different programs at one call site. By default their calls
    # are told apart by program (jaxcomm/_src/program.py): each side waits in its own
    # until the grace period shows the mismatch. Without the program in the key they
    # meet in one call, whose op differs: that fails at once.
    expected = "MISMATCH: " if match_programs == "1" else "runs a different collective"
    for rc, stdout, stderr in results:
        assert "RAN-ERROR" in stdout and expected in stdout, stdout + stderr[-2000:]
    report = analyzer.analyze(out)
    assert report.kind == "mismatch", report.text()
    top = report.findings[0]
    assert top.execution == 1
    if match_programs == "1":
        # Each side waits in its own call for the other; the finding lists as waiting the
        # side whose call began first (the analyzer takes stuck calls in arrival order),
        # which is whichever process got there first.
        begun = {e["partition"]: e["enqueue_us"] for d in analyzer.load(out) for e in d["entries"]
                 if e["execution"] == 1 and e["op"] in ("all_reduce", "all_gather")}
        first = [0, 1] if min(begun[0], begun[1]) < min(begun[2], begun[3]) else [2, 3]
        assert (top.waiting, top.culprits) == (first, [2, 3] if first == [0, 1] else [0, 1]), (begun, report.text())
        site = f"<string>:{_MP_BODY_LINE} (<lambda>) in jit__lambda#"
        assert f"ranks [0, 1] (process 0) wait in all_reduce at {site}" in top.summary, top.summary
        assert f"ranks [2, 3] (process 1) wait in all_gather at {site}" in top.summary, top.summary
    else:
        # Both sides in one call: the finding lists them by rank.
        assert (top.waiting, top.culprits) == ([0, 1], [2, 3]), report.text()
        assert "ranks [0, 1] run all_reduce" in top.summary, top.summary
        assert "ranks [2, 3] run all_gather" in top.summary, top.summary


# ------------------------------------------------- records that outlive their process


_KILLED = r"""
import os, signal, sys
# 8 CPU devices: the session's XLA_FLAGS (tests/conftest.py).
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxcomm
mesh = jax.make_mesh((8,), ("x",))
x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("x")))
f = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, "x", timeout_s=float(sys.argv[1])),  # RING-AR
                          mesh=mesh, in_specs=P("x"), out_specs=P("x")))
for i in range(5):
    try:
        jax.block_until_ready(f(x))
    except Exception as e:
        print("FAILED", i, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no exit dump, no atexit: only the ring file is left
"""


@pytest.mark.parametrize("run", sorted(KILLED_RUNS))
def test_ring_file_outlives_a_killed_process(children, run):
    fault = KILLED_RUNS[run]
    proc, out = _run(children, run)
    assert proc.returncode == -9, proc.stdout + proc.stderr[-2000:]
    rings = sorted(out.glob("jaxcomm-ring-p0-*.bin"))
    assert len(rings) == 1, list(out.iterdir())
    doc = ringfile.read(rings[0])
    assert doc["process_index"] == 0 and doc["reason"] == "ring file"
    assert str(doc["pid"]) in rings[0].name and doc["entries_per_rank"] == 2048
    entries = [e for e in doc["entries"] if e["call_site"].startswith("<string>:")]
    assert sorted(r["partition"] for r in doc["ranks"]) == list(range(R))
    by_exec = collections.Counter((e["execution"], e["state"]) for e in entries)
    if fault is None:
        assert by_exec == {(k, "done"): R for k in range(1, 6)}, by_exec
        assert all(e["op"] == "all_reduce" and e["bytes"] == 16 and e["dtype"] == "float32"
                   and e["group"] == list(range(R)) and e["error"] is None for e in entries)
        # The same records as a live dump would hold (ignoring what only a dump has).
        assert analyzer.analyze(out).kind in ("clean", "straggler")
        return
    # Rank 5 never came to its 4th call: the 7 others failed there, with their errors.
    failed = [e for e in entries if e["state"] == "failed"]
    assert {e["partition"] for e in failed if e["execution"] == 4} == set(range(R)) - {5}
    assert all("waiting for ranks [5]" in e["error"] for e in failed if e["execution"] == 4)
    report = analyzer.analyze(out)
    assert report.kind == "hang" and report.findings[0].culprits == [5], report.text()


def test_a_process_that_records_nothing_leaves_no_file(children):
    proc, out = _run(children, "records nothing")
    assert proc.returncode == 0, proc.stderr
    assert list(out.iterdir()) == []


def test_ringfile_read_refuses_what_is_not_one(tmp_path):
    path = tmp_path / "jaxcomm-ring-p0-1.bin"
    path.write_bytes(b"\0" * 300)
    assert ringfile.read(path) is None  # a file whose header is not written yet
    assert analyzer.load(tmp_path) == []


# ------------------------------------------------------------- causes, without processes


def _who(process: int, pid: int | None = None) -> str:
    return (f"process {process} (host h (10.0.0.{process}), pid {pid or 100 + process}) "
            f"with ranks [{process}] (partitions [{process}])")


def test_blames_read_what_an_error_says_of_each_process():
    dead = f"{_who(3)} failed: it exited before it arrived at this call"
    assert causes.blames(dead) == [causes.Blame("dead", 3, 103, (3,), False, said="it exited")]
    after = f"{_who(0)} failed: it exited after it arrived at this call"
    assert causes.blames(after)[0].arrived is True
    closed = (f"sending to {_who(1)}: connection closed by the peer (its process exited?; "
              f"send: Broken pipe)")
    (b,) = causes.blames(closed)
    assert (b.kind, b.process, b.said) == ("dead", 1, "connection closed by the peer "
                                                     "(its process exited?)")
    timeout = (f"timed out (timeout_s / JAXCOMM_TIMEOUT_S) waiting for {_who(2)}; {_who(3)}, "
               f"which did not arrive at this call")
    assert [(b.kind, b.process) for b in causes.blames(timeout)] == [("missing", 2),
                                                                     ("missing", 3)]
    other = f"{_who(1)} runs a different collective at this call (op, dtype or shape differ)"
    assert causes.blames(other)[0].kind == "mismatch"
    assert causes.blames("timed out waiting for ranks [3] (partitions [3])") == []
    assert causes.blames(None) == []


def test_clean_strips_what_dispatch_wraps_around_an_error():
    core = "jaxcomm.all_reduce over axis 'x' (group 0), rank 0: timed out waiting for ranks [1]"
    wrapped = ("jax.errors.JaxRuntimeError: INTERNAL: Error dispatching computation: "
               + "Error dispatching computation: " * 7 + core)
    assert causes.clean(wrapped) == core
    assert causes.clean("ValueError: DEADLINE_EXCEEDED: " + core) == core
    assert causes.clean("ValueError: something else") == "something else"
    assert causes.is_jaxcomm_error("ValueError: UNAVAILABLE: " + core)
    assert not causes.is_jaxcomm_error("[1] import jaxcomm")


def _failure(process, t, *texts):
    return causes.Failure(process, t, [b for x in texts for b in causes.blames(x)])


def test_consequences_lead_back_to_the_process_that_failed_first():
    missing2 = f"timed out waiting for {_who(2)}, which did not arrive at this call"
    gone0 = f"{_who(0)} failed: it exited after it arrived at this call"
    # Process 2 hangs: 0 times out naming it and exits; 1 and 3 then see 0 exit (their
    # clocks may even put that before 0's own error: a dead process had its say first).
    secondary = causes.consequences([_failure(0, 100, missing2), _failure(1, 99, gone0),
                                     _failure(3, 101, gone0)])
    assert set(secondary) == {0, 1, 3}
    assert causes.root_of(1, secondary) == [2] and causes.root_of(2, secondary) == [2]
    # Process 1 runs 40 s late: the others time out naming it at 10 s, and when it comes
    # it finds process 0 gone, and names it: 1 is still the cause.
    missing1 = f"timed out waiting for {_who(1)}, which did not arrive at this call"
    gone0b = f"{_who(0)} failed: it exited before it arrived at this call"
    secondary = causes.consequences([_failure(0, 10, missing1), _failure(2, 10, missing1),
                                     _failure(1, 40, gone0b)])
    assert 1 not in secondary and causes.root_of(0, secondary) == [1]
    # A mismatch names no cause.
    other = f"{_who(1)} runs a different collective at this call"
    assert causes.consequences([_failure(0, 5, other)]) == {}


def _dump(tmp_path, process, entries, at=10_000_000):
    doc = {"format": "jaxcomm-trace", "version": 1, "reason": "error", "process_index": process,
           "pid": 100 + process, "host": "h", "dumped_at_us": at, "entries_per_rank": 2048,
           "enabled": True, "ranks": [{"partition": process, "calls": len(entries)}],
           "entries": entries}
    with open(tmp_path / f"jaxcomm-trace-p{process}-{100 + process}.json", "w") as f:
        json.dump(doc, f)


def _entry(process, execution, state="done", error=None, end=None):
    return {"partition": process, "seq": execution, "op": "all_reduce", "axis": "'x'",
            "call_site": "train.py:9 (step)", "instruction": "00000000000000aa",
            "group_index": 0, "group": [0, 1, 2, 3], "processes": [0, 1, 2, 3],
            "rank": process, "execution": execution, "run_id": execution, "dtype": "float32",
            "elements": 1, "bytes": 4, "algorithm": "shm", "left_out": [], "state": state,
            "error": error, "enqueue_us": execution * 1000,
            "start_us": execution * 1000 + 5 if state == "done" else None,
            "end_us": end or (execution * 1000 + 10)}


def test_verdict_names_the_hung_process_not_the_one_that_gave_up_first(tmp_path):
    # Process 2 never came to execution 3. Process 0 timed out waiting for it and exited;
    # processes 1 and 3 then failed on process 0's exit: "process 0 died" is the issue's
    # wrong verdict, process 2 the right one.
    missing2 = f"timed out waiting for {_who(2)}, which did not arrive at this call"
    gone0 = f"{_who(0)} failed: it exited after it arrived at this call"
    for p, err, end in ((0, missing2, 5_000_000), (1, gone0, 5_100_000), (3, gone0, 5_050_000)):
        _dump(tmp_path, p, [_entry(p, 1), _entry(p, 2), _entry(p, 3, "failed", err, end)])
    _dump(tmp_path, 2, [_entry(2, 1), _entry(2, 2)])
    report = analyzer.analyze(tmp_path)
    assert report.verdict.startswith("verdict: HANG: process 2 (ranks [2]) never arrived at "
                                     "all_reduce at train.py:9 (step)"), report.text()
    top = report.findings[0]
    assert (top.processes, top.culprits, top.waiting) == ([2], [2], [0, 1, 3])
    assert len(top.consequences) == 1 and top.consequences[0].startswith(
        "process 0 (ranks [0]) failed first, with an error naming process(es) [2], then it "
        "exited; process(es) [1, 3] reported that"), top.consequences
    assert [f.kind for f in report.findings] == ["hang"], report.text()


def test_verdict_names_the_dead_process_when_a_survivor_saw_another_exit_first(tmp_path):
    # Process 3 exited; process 1 saw it and exited; process 0 noticed process 1 first.
    gone3 = f"{_who(3)} failed: it exited before it arrived at this call"
    gone1 = f"{_who(1)} failed: it exited after it arrived at this call"
    for p, err in ((0, gone1), (1, gone3), (2, gone3)):
        _dump(tmp_path, p, [_entry(p, 1), _entry(p, 2, "failed", err)])
    report = analyzer.analyze(tmp_path)
    assert report.verdict.startswith("verdict: DEAD: process 3 (pid 103, ranks [3]) died "
                                     "during all_reduce"), report.text()
    assert "it left no dump" in report.verdict  # process 3 left nothing here
    assert report.findings[0].processes == [3]
    assert report.findings[0].consequences[0].startswith("process 1 (ranks [1]) failed first")


def test_verdict_leads_a_dead_process_in_another_call_back_to_the_hung_one(tmp_path):
    # A pipeline: process 2 never came to the call of group [0, 2]; process 0 timed out
    # there and exited; process 1, in a call of group [0, 1], then saw process 0 exit.
    # Process 1's call names only process 0 (dead), whose own error names process 2: the
    # verdict is process 2's hang, not process 0's death, from either call. Nor is it a
    # program mismatch: process 0 waits for process 2, not for process 1 (a chain of
    # waits, not a cycle).
    missing2 = f"timed out waiting for {_who(2)}, which did not arrive at this call"
    gone0 = f"{_who(0)} failed: it exited before it arrived at this call"

    def call(p, group, instruction, site, at, error, end):
        return dict(_entry(p, 3, "failed", error, end), group=group, processes=group,
                    rank=group.index(p), instruction=instruction, call_site=site,
                    enqueue_us=at)

    _dump(tmp_path, 0, [_entry(0, 1), _entry(0, 2),
                        call(0, [0, 2], "00000000000000bb", "pipe.py:20 (send)", 3000, missing2,
                             5_000_000)])
    _dump(tmp_path, 1, [_entry(1, 1), _entry(1, 2),
                        call(1, [0, 1], "00000000000000cc", "pipe.py:30 (recv)", 3500, gone0,
                             5_100_000)])
    _dump(tmp_path, 2, [_entry(2, 1), _entry(2, 2)])
    report = analyzer.analyze(tmp_path)
    assert report.verdict.startswith("verdict: HANG: process 2 (ranks [2]) never arrived at "
                                     "all_reduce at pipe.py:20 (send)"), report.text()
    # Process 1's call leads back to the same fault: one finding, no "process 0 died".
    assert [(f.kind, f.processes) for f in report.findings] == [("hang", [2])], report.text()


def test_blames_reads_the_role_a_phase_adds() -> None:
    """A phase of a hierarchical round names a peer with its role in the call: still dead."""
    error = ("jaxcomm.all_reduce ...: process 0 (host vm (127.0.0.1), pid 5237) with ranks [0] "
             "(partitions [0]) (the leader of its host) failed: it exited before it arrived at this call")
    assert causes.blames(error) == [causes.Blame("dead", 0, 5237, (0,), False, said="it exited")]
    scattered = error.replace("(the leader of its host)", "(reduce-scatter)")
    assert [b.kind for b in causes.blames(scattered)] == ["dead"]
