"""The flight recorder, its dumps, the analyzer, the exporters, stats() and fault
injection (JAXCOMM_FAULT).

Fault runs happen in child processes (JAXCOMM_FAULT and JAXCOMM_TRACE_DIR are read once
at start) with 2-3 s collective timeouts; the analyzer then reads their real dumps.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from jaxcomm.trace import analyzer, exporter

R = 8
MESH = jax.make_mesh((R,), ("x",))
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(jaxcomm.__file__)))


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
        time.sleep(2)
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


def _env(**extra):
    """This session's environment (8 CPU devices: tests/conftest.py), jaxcomm importable,
    without fault or recorder settings."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    for k in ("JAXCOMM_FAULT", "JAXCOMM_TRACE_DIR", "JAXCOMM_TRACE_ENTRIES"):
        env.pop(k, None)
    env.update(extra)
    return env


def _child(tmp_path, mode, fault=None, timeout=120):
    out = tmp_path / "dumps"
    out.mkdir(exist_ok=True)
    env = _env(JAXCOMM_TRACE_DIR=str(out), **({"JAXCOMM_FAULT": fault} if fault else {}))
    # cwd: not the repository root, whose jaxcomm/ would shadow the installed package.
    proc = subprocess.run([sys.executable, "-c", _CHILD, mode, str(out)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=HERE)
    return proc, out


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxcomm.trace", *map(str, args)], env=_env(),
                          capture_output=True, text=True, timeout=120, cwd=HERE)


def _exit_dump(out):
    files = list(out.glob("jaxcomm-trace-p0-*.json"))
    assert len(files) == 1, files
    with open(files[0]) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    proc, out = _child(tmp, "signal")
    assert proc.returncode == 0 and "RAN-OK" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    return proc, out, tmp


def test_clean_run_verdict_and_exit_dump(clean_run):
    proc, out, tmp = clean_run
    assert _exit_dump(out)["reason"] == "exit"
    # A loaded machine may delay a device thread by tens of ms: a generous threshold.
    report = analyzer.analyze(out, straggler_ms=1000)
    assert report.kind == "clean" and report.exit_code == 0, report.text()
    assert report.calls == 12 and report.ranks == list(range(R))
    cli = _cli("analyze", out, "--straggler-ms", 1000)
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


def test_injected_hang_names_the_missing_rank(tmp_path):
    proc, out = _child(tmp_path, "hang", "rank=3,op=all_reduce,call=5,action=hang")
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


def test_sigusr1_dump_of_a_stuck_job_names_the_missing_rank(tmp_path):
    proc, out = _child(tmp_path, "stuck", "rank=6,op=all_gather,call=2,action=hang")
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


def test_injected_delay_names_the_straggler(tmp_path):
    # Two faults: the second selects no call of this program (no broadcast) and must not fire.
    proc, out = _child(tmp_path, "delay",
                       "rank=5,op=all_gather,call=2,action=delay:1.5; op=broadcast,action=exit")
    assert "RAN-OK" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    report = analyzer.analyze(out)
    assert report.kind == "straggler" and report.exit_code == 2, report.text()
    top = report.findings[0]
    assert (top.op, top.execution, top.culprits) == ("all_gather", 2, [5]), report.text()
    assert top.seconds >= 1.4
    cli = _cli("analyze", out)
    assert cli.returncode == 2
    assert cli.stdout.startswith("verdict: STRAGGLER: rank 5 arrived"), cli.stdout


def test_rank_later_than_the_deadline_is_named(tmp_path):
    proc, out = _child(tmp_path, "late", "rank=4,op=all_reduce,call=2,action=delay:3")
    assert "RAN-ERROR" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    report = analyzer.analyze(out)
    assert report.kind == "hang", report.text()
    top = report.findings[0]
    assert (top.op, top.execution, top.culprits) == ("all_reduce", 2, [4]), report.text()
    assert top.waiting == [0, 1, 2, 3, 5, 6, 7]
    assert "had timed out" in top.summary


def test_mismatched_ops_are_a_program_mismatch(tmp_path):
    proc, out = _child(tmp_path, "mismatch")
    assert "RAN-ERROR" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    report = analyzer.analyze(out)
    assert report.kind == "mismatch", report.text()
    top = report.findings[0]
    sides = {top.op: top.waiting}
    assert sorted(top.waiting + top.culprits) == list(range(R))
    assert {tuple(top.waiting), tuple(top.culprits)} == {(0, 1, 2, 3), (4, 5, 6, 7)}
    assert "all_reduce" in top.summary and "all_gather" in top.summary, sides
    assert _cli("analyze", out).returncode == 1


def test_injected_exit(tmp_path):
    proc, out = _child(tmp_path, "exit", "rank=2,op=all_reduce,call=2,action=exit")
    assert proc.returncode == 17, proc.stdout + proc.stderr[-2000:]
    assert "JAXCOMM_FAULT 'rank=2,op=all_reduce,call=2,action=exit' fired" in proc.stderr
    assert list(out.glob("*.json")) == []  # like a crash: no exit dump


def test_trace_entries_zero_turns_the_recorder_off():
    code = ("import jax, jax.numpy as jnp, jaxcomm\n"
            "from jax.sharding import NamedSharding, PartitionSpec as P\n"
            "mesh = jax.make_mesh((8,), ('x',))\n"
            "x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P('x')))\n"
            "f = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, 'x'), mesh=mesh,\n"
            "                          in_specs=P('x'), out_specs=P('x')))\n"
            "import numpy as np; print('SUM', float(np.asarray(f(x))[0, 0]))\n"
            "jaxcomm.trace.set_enabled(True)  # no rings: stays off\n"
            "s = jaxcomm.trace.snapshot()\n"
            "print('OFF', jaxcomm.trace.enabled(), len(s['entries']), s['entries_per_rank'],\n"
            "      jaxcomm.stats())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(JAXCOMM_TRACE_ENTRIES="0"), timeout=60, cwd=HERE)
    assert "SUM 8.0" in proc.stdout and "OFF False 0 0 []" in proc.stdout, (
        proc.stdout + proc.stderr[-2000:])


def test_malformed_fault_is_rejected():
    proc = subprocess.run([sys.executable, "-c", "import jaxcomm"], capture_output=True, text=True,
                          env=_env(JAXCOMM_FAULT="rank=1,action=explode"), timeout=60, cwd=HERE)
    assert proc.returncode != 0
    assert "JAXCOMM_FAULT: in 'rank=1,action=explode': unknown action 'explode'" in proc.stderr


def test_analyzer_on_an_empty_directory(tmp_path):
    report = analyzer.analyze(tmp_path)
    assert report.kind == "empty" and report.exit_code == 0


# ------------------------------------------------------------------- two processes


_MP_CHILD = r"""
import os, sys
import jax
jax.distributed.initialize(os.environ["MP_COORD"], 2, int(os.environ["MP_ID"]),
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


def _two_processes(tmp_path, fault, wait, mode="", transport="auto"):
    """Runs _MP_CHILD in 2 processes of 2 devices each; returns [(rc, stdout, stderr)]."""
    out = tmp_path / "dumps"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(2):
        env = _env(MP_COORD=f"127.0.0.1:{port}", MP_ID=str(i), MP_WAIT="1" if wait else "0",
                   MP_MODE=mode, JAXCOMM_TRANSPORT=transport,
                   XLA_FLAGS="--xla_force_host_platform_device_count=2", JAXCOMM_FAULT=fault)
        procs.append(subprocess.Popen([sys.executable, "-c", _MP_CHILD, str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=HERE))
    results = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a process of the two-process job did not finish")
        results.append((p.returncode, stdout, stderr))
    return results, out


def test_two_processes_hang_names_the_missing_rank(tmp_path):
    results, out = _two_processes(tmp_path, "rank=2,op=all_reduce,call=3,action=hang", wait=True)
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
def test_two_processes_exit_names_the_dead_process(tmp_path, transport):
    results, out = _two_processes(tmp_path, "process=1,op=all_reduce,call=3,action=exit",
                                  wait=False, transport=transport)
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


def test_two_processes_running_different_ops_are_a_mismatch(tmp_path):
    results, out = _two_processes(tmp_path, "", wait=True, mode="mismatch")
    for rc, stdout, stderr in results:
        assert "RAN-ERROR" in stdout and "runs a different collective" in stdout, (
            stdout + stderr[-2000:])
    report = analyzer.analyze(out)
    assert report.kind == "mismatch", report.text()
    top = report.findings[0]
    assert top.execution == 1 and (top.waiting, top.culprits) == ([0, 1], [2, 3])
    assert "ranks [0, 1] run all_reduce" in top.summary, top.summary
    assert "ranks [2, 3] run all_gather" in top.summary, top.summary
