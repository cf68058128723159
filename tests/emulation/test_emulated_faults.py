"""Deadlines and fault verdicts on the CUDA path, under the emulation (JAXCOMM_EMULATE_CUDA=1,
one process x 8 devices): a rank that never arrives (JAXCOMM_FAULT ``action=hang``) or comes
later than the deadline (``action=delay``) makes its peers fail with the host backend's
message, and ``jaxcomm.trace analyze`` names it from the emulated CUDA calls' dump.

Each job is one process running one or more *cells*: a loop of one op, compiled first, a
barrier (an all_reduce with a generous deadline) and then four calls with a short deadline,
of which the faulty rank's second is hit by the fault. The routes one process reaches:

* ``cuda peers in process`` (ppermute, the MoE transport: jaxcomm's own copies and
  kernels between the GPUs of the process, the peers meeting on the host,
  ffi/cuda/peers.cc);
* ``nccl`` (all_reduce, all_gather over the 8 GPUs: the mock NCCL, whose call the
  completion watcher aborts at the deadline, ffi/cuda/watcher.cc). A NCCL fault aborts
  the group's communicator for good, so a job has at most one NCCL cell, its last.

The default run is two jobs, each with a peers cell and a NCCL cell, run at once: one
under the emulation and the same program on the host backend. The emulated errors and
the late rank's recorded error must equal the host backend's, word for word (but for the
rank that speaks, which differs run to run; a NCCL call adds that its communicator was
aborted), and both dumps must give the same verdicts. ``JAXCOMM_TEST_EMULATED_FULL=1``
adds every route, fault and position (first, middle, last rank) in jobs of their own.
The deadline is 2 s; no assertion is about time.
"""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxcomm.trace import __main__ as trace_cli
from jaxcomm.trace import analyzer

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))  # test_fault_matrix's helpers

FULL = os.environ.get("JAXCOMM_TEST_EMULATED_FULL") == "1"
N = 8
#: The faulty loop's deadline, seconds.
DEADLINE_S = 2
#: How late a delayed rank comes: well past its peers' deadline (and the watcher's poll).
DELAY_S = DEADLINE_S + 2
ACTIONS = {"hang": "hang", "delay": f"delay:{DELAY_S}"}
#: Op -> the route it takes over 8 GPUs of one process.
ROUTES = {"ppermute": "cuda peers in process", "moe_transport": "cuda peers in process",
          "all_reduce": "nccl", "all_gather": "nccl"}
#: Which call of its op the fault hits: a step's second (a MoE step's dispatch and
#: combine are two transports), the execution 2 of the faulty instruction.
FAULTY_CALL = {"moe_transport": 3}

SCRIPT = textwrap.dedent(f"""
    import json, sys
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxcomm

    mesh = jax.make_mesh(({N},), ("x",))
    x = jax.device_put(jnp.arange({N * 8}.0).reshape({N * 2}, 4), NamedSharding(mesh, P("x")))
    smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    perm = [(i, (i + 1) % {N}) for i in range({N})]

    def barrier(v):
        return jaxcomm.all_reduce(v, "x", timeout_s=120)

    # One function per op: the fault selects its call site by the name.
    def faulty_ppermute(v):
        return jaxcomm.ppermute(v, "x", perm, timeout_s={DEADLINE_S})

    def faulty_all_reduce(v):
        return jaxcomm.all_reduce(v, "x", timeout_s={DEADLINE_S})

    def faulty_all_gather(v):
        return jaxcomm.all_gather(v, "x", tiled=True, timeout_s={DEADLINE_S})[:2]

    def faulty_moe_transport(v):  # the deadline: JAXCOMM_TIMEOUT_S
        ids = (jnp.arange(2, dtype=jnp.int32)[:, None] + jax.lax.axis_index("x")) % {N}
        ex, _, h = jaxcomm.moe.dispatch(v, ids, num_experts={N}, axis_name="x")
        return jaxcomm.moe.combine(ex * 2.0, h, jnp.ones((2, 1), v.dtype))

    out = {{}}
    for op in sys.argv[1:]:
        step = smap(globals()["faulty_" + op]).lower(x).compile()  # no compiling after the barrier
        jax.block_until_ready(smap(barrier)(x))
        out[op] = None
        for i in range(4):
            try:
                jax.block_until_ready(step(x))
            except Exception as e:  # the program's error, as the user sees it
                out[op] = str(e)
                break
    print("CELLS " + json.dumps(out), flush=True)
""")


def _job(tmp_path: Path, name: str, emulated: bool, cells: list[tuple[str, str, int]]) -> dict:
    """Runs one job: ``cells`` as (op, fault kind, faulty rank), in order. Returns each op's
    error, the dumps' directory and the process's output."""
    work = tmp_path / name
    work.mkdir()
    trace_dir = work / "trace"
    fault = ";".join(f"rank={rank},op={op},site=(faulty_{op}),call={FAULTY_CALL.get(op, 2)},"
                     f"action={ACTIONS[kind]}" for op, kind, rank in cells)
    env = dict(os.environ, JAXCOMM_EMULATE_CUDA="1" if emulated else "0", JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={N}", JAXCOMM_FAULT=fault,
               JAXCOMM_TRACE_DIR=str(trace_dir), JAXCOMM_TIMEOUT_S=str(DEADLINE_S))
    r = subprocess.run([sys.executable, "-c", SCRIPT] + [op for op, _, _ in cells], env=env,
                       capture_output=True, text=True, timeout=300, cwd=str(work))
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("CELLS ")]
    assert r.returncode == 0 and line, (r.stdout + r.stderr)[-4000:]
    return dict(errors=json.loads(line[0][len("CELLS "):]), trace=trace_dir, output=r.stdout + r.stderr)


def _expected(op: str, kind: str, rank: int) -> str:
    """The host backend's error of a peer of ``rank`` (core/rendezvous.cc), up to the
    speaker's rank (``R``) and the call site (``SITE``)."""
    return (f"DEADLINE_EXCEEDED: jaxcomm.{op} over axis 'x' (group 0 = partitions "
            f"[{' '.join(map(str, range(N)))}]), rank R (partition R), call site SITE, "
            f"execution #2: timed out after {DEADLINE_S} s (timeout_s / JAXCOMM_TIMEOUT_S) waiting "
            f"for ranks [{rank}] (partitions [{rank}]), which never arrived at this call; {N - 1} of "
            f"{N} ranks did. Ranks that skip a collective (e.g. under a lax.cond whose predicate "
            f"differs by rank) or run different programs cause this.")


def _speaker_and_site(error: str, op: str) -> tuple[str, int]:
    """The error with the speaking rank as ``R`` and the call site as ``SITE``; and that rank."""
    m = re.search(r"rank (\d+) \(partition (\d+)\), call site (.*?\(faulty_" + op + r"\)[^,]*), execution",
                  error)
    assert m and m.group(1) == m.group(2), error
    return (error.replace(m.group(0), "rank R (partition R), call site SITE, execution"), int(m.group(1)))


#: What the emulated NCCL call's error adds to the host backend's (watcher.cc).
_NCCL_ABORTED = re.compile(r" The NCCL communicator of group nccl:[0-9/,]+ was aborted: this call's "
                           r"result is undefined, and every later call on it fails\.$")


def _check_error(error: str | None, op: str, kind: str, rank: int, emulated: bool) -> str:
    """Checks one cell's program error; returns it normalized (speaker, call site)."""
    assert error is not None, f"{op} {kind} at rank {rank}: the program did not fail"
    text, speaker = _speaker_and_site(error.strip(), op)
    assert speaker != rank, error  # a peer's error, which names the faulty rank
    if emulated and ROUTES[op] == "nccl":
        assert _NCCL_ABORTED.search(text), error
        text = _NCCL_ABORTED.sub("", text)
    assert text == _expected(op, kind, rank), error
    return text


def _late_error(trace_dir: Path, op: str, rank: int) -> str | None:
    """The late rank's own recorded error at the faulty call (dumps: JSON or ring file)."""
    for d in analyzer.load(trace_dir):
        for e in d["entries"]:
            if e["op"] == op and e["partition"] == rank and e["execution"] == 2 \
                    and f"(faulty_{op})" in e["call_site"]:
                return e["error"]
    return None


def _recorded_errors(trace_dir: Path, op: str) -> dict[int, str]:
    """The errors the ranks' flight recorders hold for the faulty call, but the culprit's."""
    out = {}
    for d in analyzer.load(trace_dir):
        for e in d["entries"]:
            if e["op"] == op and e["execution"] == 2 and f"(faulty_{op})" in e["call_site"] and e["error"] \
                    and "arrived too late" not in e["error"]:
                out[e["partition"]] = e["error"]
    return out


def _check_verdict(trace_dir: Path, op: str, kind: str, rank: int) -> tuple:
    """The analyzer's finding of the cell: a hang (never arrived, or arrived after the
    others timed out) that names ``rank`` alone, from the dumps. Returns its gist."""
    report = analyzer.analyze(trace_dir)
    mine = [f for f in report.findings if f.op == op and "(faulty_" + op + ")" in f.call_site]
    assert len(mine) == 1, report.text()
    f = mine[0]
    assert (f.kind, f.culprits, f.execution) == ("hang", [rank], 2), report.text()
    assert f.waiting == [r for r in range(N) if r != rank], report.text()
    said = "never arrived at" if kind == "hang" else "arrived at"
    assert f.summary.startswith(f"ranks [{rank}] {said} {op} at "), f.summary
    return (f.kind, f.op, f.culprits, f.waiting, f.execution, f.summary.split(" at ")[0])


def _check_emulated_dump(trace_dir: Path, ops: list[str]) -> None:
    """The emulated calls' recorder dumped beside (not over) the host backend's, and its
    entries name the CUDA routes."""
    dumps = glob.glob(str(trace_dir / "jaxcomm-trace-p0-*-cuda-emu.json"))
    assert len(dumps) == 1, os.listdir(trace_dir)
    with open(dumps[0]) as f:
        doc = json.load(f)
    assert doc["recorder"] == "cuda-emu"
    algorithms = {e["op"]: e["algorithm"] for e in doc["entries"] if "(faulty_" + e["op"] + ")" in e["call_site"]}
    assert algorithms == {op: ROUTES[op] for op in ops}, algorithms
    assert glob.glob(str(trace_dir / "jaxcomm-ring-p0-*-cuda-emu.bin")), os.listdir(trace_dir)


#: Default: a peers cell, then a NCCL cell (faulty ranks in the middle and first).
DEFAULT_CELLS = [("ppermute", "hang", 5), ("all_reduce", "delay", 0)]


def test_emulated_faults_match_the_host_backend(tmp_path, capsys):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        jobs = {emulated: pool.submit(_job, tmp_path, "emulated" if emulated else "host", emulated, DEFAULT_CELLS)
                for emulated in (True, False)}
        emu, host = jobs[True].result(), jobs[False].result()
    _check_emulated_dump(emu["trace"], [op for op, _, _ in DEFAULT_CELLS])
    for op, kind, rank in DEFAULT_CELLS:
        cell = f"{op} {kind} at rank {rank}"
        assert "JAXCOMM_FAULT" in emu["output"] and f"rank {rank} (partition {rank})" in emu["output"], cell
        got = _check_error(emu["errors"][op], op, kind, rank, emulated=True)
        want = _check_error(host["errors"][op], op, kind, rank, emulated=False)
        assert got == want, cell
        assert _check_verdict(emu["trace"], op, kind, rank) == _check_verdict(host["trace"], op, kind, rank), cell
        if kind == "delay":  # the late rank's own error, as recorded
            late = _late_error(emu["trace"], op, rank)
            assert late is not None and late == _late_error(host["trace"], op, rank), (late, cell)
            assert late == ("the other ranks of this call already gave up on it (timed out); this rank "
                            "arrived too late"), late
        # The waiting ranks' recorded errors: the host backend's (a NCCL call adds the abort).
        emu_recorded = {r: _NCCL_ABORTED.sub("", e) for r, e in _recorded_errors(emu["trace"], op).items()}
        host_recorded = _recorded_errors(host["trace"], op)
        want = _expected(op, kind, rank)
        want = want[want.index("timed out after"):]
        assert emu_recorded == host_recorded == {r: want for r in range(N) if r != rank}, (emu_recorded, cell)
    # The command as a user runs it on the emulated dumps: the first fault (the hung
    # ppermute) is the verdict, printed first; exit status 1.
    capsys.readouterr()
    assert trace_cli.main(["analyze", str(emu["trace"])]) == 1
    op, _, rank = DEFAULT_CELLS[0]
    first = capsys.readouterr().out.splitlines()[0]
    assert re.fullmatch(rf"verdict: HANG: ranks \[{rank}\] never arrived at {op} at .*\(faulty_{op}\).* "
                        rf"\(axis 'x', execution 2\); ranks \[{', '.join(str(r) for r in range(N) if r != rank)}\] "
                        rf"waited for them and timed out", first), first


SKIP_SCRIPT = textwrap.dedent(f"""
    import json
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxcomm

    mesh = jax.make_mesh(({N},), ("x",))
    x = jax.device_put(jnp.arange({N * 4}.0).reshape({N}, 4), NamedSharding(mesh, P("x")))
    perm = [(i, (i + 1) % {N}) for i in range({N})]
    ops = {{"ppermute": lambda v: jaxcomm.ppermute(v, "x", perm, timeout_s={DEADLINE_S}),
           "all_reduce": lambda v: jaxcomm.all_reduce(v, "x", timeout_s={DEADLINE_S})}}
    out = {{}}
    for op in ("ppermute", "all_reduce"):  # NCCL last: its deadline aborts the communicator
        def skipping_(v, step, op=op):  # rank SKIP skips the collective at step 1
            return jax.lax.cond((jax.lax.axis_index("x") == SKIP) & (step[0] == 1), lambda u: u, ops[op], v)
        f = jax.jit(jax.shard_map(skipping_, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"),
                                  check_vma=False))
        out[op] = None
        for i in range(3):
            try:
                jax.block_until_ready(f(x, jnp.array([i])))
            except Exception as e:
                out[op] = str(e)
                break
    print("CELLS " + json.dumps(out), flush=True)
""")


def test_a_rank_that_skips_the_call(tmp_path):
    """No fault injected: a rank skips the collective under a lax.cond (the cause the
    message names), on the peer route and on NCCL; the others fail with the host
    backend's message, and the analyzer names the rank."""
    skip = 3
    trace_dir = tmp_path / "trace"
    env = dict(os.environ, JAXCOMM_EMULATE_CUDA="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={N}", JAXCOMM_TRACE_DIR=str(trace_dir))
    env.pop("JAXCOMM_FAULT", None)
    r = subprocess.run([sys.executable, "-c", SKIP_SCRIPT.replace("SKIP", str(skip))], env=env,
                       capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("CELLS ")]
    assert r.returncode == 0 and line, (r.stdout + r.stderr)[-4000:]
    errors = json.loads(line[0][len("CELLS "):])
    report = analyzer.analyze(trace_dir)
    for op in ("ppermute", "all_reduce"):
        error = errors[op]
        assert error is not None, op
        m = re.search(r"rank (\d+) \(partition \1\), call site [^,]* in jit_skipping[^,]*, execution #2: ", error)
        assert m and int(m.group(1)) != skip, error
        text = _NCCL_ABORTED.sub("", error.strip()) if ROUTES[op] == "nccl" else error.strip()
        want = _expected(op, "hang", skip)
        assert text.endswith(want[want.index(", execution #2: "):]), error
        mine = [f for f in report.findings if f.op == op]
        assert len(mine) == 1 and (mine[0].kind, mine[0].culprits, mine[0].execution) == ("hang", [skip], 2), \
            report.text()


def _full_jobs() -> list[list[tuple[str, str, int]]]:
    """Every route, fault and position: one NCCL cell per job (its last), the peers cells
    shared out among them."""
    positions = (0, N // 2 - 1, N - 1)
    peers = [(op, k, r) for op in ("ppermute", "moe_transport") for k in ACTIONS for r in positions]
    nccl = [(op, k, r) for op in ("all_reduce", "all_gather") for k in ACTIONS for r in positions]
    return [([peers[i]] if i < len(peers) else []) + [cell] for i, cell in enumerate(nccl)]


@pytest.mark.skipif(not FULL, reason="the full matrix runs with JAXCOMM_TEST_EMULATED_FULL=1")
def test_emulated_fault_matrix(tmp_path):
    jobs = _full_jobs()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda ij: _job(tmp_path, f"job{ij[0]}", True, ij[1]), enumerate(jobs)))
    for cells, res in zip(jobs, done):
        _check_emulated_dump(res["trace"], [op for op, _, _ in cells])
        for op, kind, rank in cells:
            _check_error(res["errors"][op], op, kind, rank, emulated=True)
            _check_verdict(res["trace"], op, kind, rank)
            if kind == "delay":
                late = _late_error(res["trace"], op, rank)
                assert late == ("the other ranks of this call already gave up on it (timed out); this rank "
                            "arrived too late"), late


# ------------------------------------------------------------------ across processes
#
# Two processes of one emulated GPU each (CUDA_VISIBLE_DEVICES set per process, as a
# launcher does on a GPU machine), launched as test_fault_matrix.py launches its jobs, one
# fault in process 0 or 1: ppermute takes the CUDA IPC route (its peers meet through the
# host backend's cross-process exchange), all_reduce the mock NCCL across processes. The
# verdict must name the faulty process first, and no process may be left running.

MP_DEADLINE_S = 3
MP_ACTIONS = {"hang": "hang", "exit": "exit", "delay": f"delay:{MP_DEADLINE_S + 5}"}
#: Op -> its route between two processes of one GPU each.
MP_ROUTES = {"ppermute": "cuda ipc across processes", "all_reduce": "nccl"}

MP_SCRIPT = textwrap.dedent(f"""
    import os, sys
    # One emulated GPU per process, picked before anything loads the emulated runtime.
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["JAXCOMM_PROCESS_ID"]
    import numpy as np
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxcomm

    jaxcomm.init()
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",))
    smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    perm = [(i, (i + 1) % n) for i in range(n)]

    def barrier(v):
        return jaxcomm.all_reduce(v, "x", timeout_s=120)

    def faulty_ppermute(v):
        return jaxcomm.ppermute(v, "x", perm, timeout_s={MP_DEADLINE_S})

    def faulty_all_reduce(v):
        return jaxcomm.all_reduce(v, "x", timeout_s={MP_DEADLINE_S})

    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), np.ones((1, 4), np.float32))
    step = smap(globals()["faulty_" + sys.argv[1]]).lower(x).compile()  # compiled before the barrier
    jax.block_until_ready(smap(barrier)(x))
    try:
        for i in range(4):
            jax.block_until_ready(step(x))
    except Exception as e:
        print("RAN-ERROR " + str(e).replace("\\n", " "), flush=True)
        raise
    print("RAN-OK", flush=True)
""")


def _mp_job(tmp_path: Path, op: str, kind: str, faulty: int, emulated: bool = True):
    """Runs one 2-process job; returns the launch result and its trace directory."""
    from jaxcomm import launch

    work = tmp_path / f"mp-{op}-{kind}-{faulty}-{'emulated' if emulated else 'host'}"
    work.mkdir()
    (work / "script.py").write_text(MP_SCRIPT)
    trace_dir = work / "trace"
    env = dict(os.environ, JAXCOMM_EMULATE_CUDA="1" if emulated else "0", JAX_PLATFORMS="cpu",
               JAXCOMM_TRACE_DIR=str(trace_dir),
               JAXCOMM_FAULT=f"process={faulty},op={op},site=(faulty_{op}),call=2,action={MP_ACTIONS[kind]}")
    env.pop("XLA_FLAGS", None)  # the launcher gives each process its one device
    res = launch.launch([str(work / "script.py"), op], 2, env=env, capture=True, timeout_s=150,
                        grace_s=5, cwd=str(work))
    return res, trace_dir


def _check_mp(res, trace_dir: Path, op: str, kind: str, faulty: int, emulated: bool = True) -> str | None:
    """The fault matrix's checks (test_fault_matrix.py) on one job; returns the waiting
    process's error (None where it has none: the faulty process exited)."""
    from test_fault_matrix import _job_processes

    cell = f"{op} {kind} at process {faulty} ({'emulated' if emulated else 'host'})"
    assert _job_processes(res.job_id) == [], f"{cell}: processes left running"
    assert res.returncode != 0 and all(c is not None for c in res.returncodes), f"{cell}: {res.format()}"
    report = analyzer.analyze(trace_dir)
    named = re.findall(r"process (\d+)", report.verdict)
    assert named and int(named[0]) == faulty, f"{cell}: {report.text()}\n{res.format()}"
    top = report.findings[0]
    assert top.processes == [faulty], f"{cell}: {report.text()}"
    # A process that exits is "dead" where its peers saw it go (the host transport, which
    # the IPC route meets through); the mock NCCL does not notice a peer process die: its
    # peers time out, and the process "never arrived".
    dead = kind == "exit" and MP_ROUTES.get(op) != "nccl"
    assert top.kind == ("dead" if dead else "hang"), f"{cell}: {report.text()}"
    assert top.op == op and f"(faulty_{op})" in top.call_site, report.text()
    assert report.processes == [0, 1], f"{cell}: {report.text()}"
    assert res.verdict == report.verdict, cell
    if MP_ROUTES[op] != "nccl":  # the launcher's summary leads back there too (NCCL's errors name no process)
        assert res.cause == [faulty], f"{cell}: {res.cause}\n{res.format()}"
    if emulated:
        rings = sorted(glob.glob(str(trace_dir / "jaxcomm-ring-p*-cuda-emu.bin")))
        assert len(rings) == 2, os.listdir(trace_dir)
        routes = {e["algorithm"] for d in analyzer.load(trace_dir) for e in d["entries"] if e["op"] == op}
        assert routes == {MP_ROUTES[op]}, routes
    def error_of(p: int) -> str | None:
        errors = [ln.split("RAN-ERROR ", 1)[1] for ln in res.output(p).splitlines() if "RAN-ERROR " in ln]
        return errors[0] if errors else None

    if kind == "delay" and emulated:
        # The late process fails the same call (its peer gave up on it), not a later one.
        late = error_of(faulty)
        assert late is not None and ", execution #2: " in late, f"{cell}: {late}"
    return error_of(1 - faulty)


def _host_words(error: str) -> str:
    """A cross-process error with its process ids as ``PID``."""
    return re.sub(r"pid \d+", "pid PID", error)


def test_two_processes_hang_names_the_faulty_process(tmp_path):
    """A hung rank on the CUDA IPC route (against the host backend's same job: the same
    error, word for word) and on NCCL across processes."""
    cells = [("ppermute", "hang", 1, True), ("ppermute", "hang", 1, False), ("all_reduce", "hang", 0, True)]
    with concurrent.futures.ThreadPoolExecutor(len(cells)) as pool:
        done = list(pool.map(lambda c: _mp_job(tmp_path, *c), cells))
    errors = {c: _check_mp(res, trace, *c) for c, (res, trace) in zip(cells, done)}
    ipc, host = errors[cells[0]], errors[cells[1]]
    assert ipc is not None and _host_words(ipc) == _host_words(host), (ipc, host)
    assert ipc.startswith("DEADLINE_EXCEEDED: jaxcomm.ppermute over axis 'x' (group 0 = partitions [0 1]), "
                          "rank 0 (partition 0), call site "), ipc
    assert _host_words(ipc).endswith(
        "execution #2: timed out (timeout_s / JAXCOMM_TIMEOUT_S) waiting for process 1 (host vm "
        "(127.0.0.1), pid PID) with ranks [1] (partitions [1]), which did not arrive at this call"), ipc
    nccl = errors[cells[2]]
    # NCCL does not say which ranks of other processes are missing: the analyzer does.
    assert nccl is not None and f"timed out after {MP_DEADLINE_S} s (timeout_s / JAXCOMM_TIMEOUT_S) running on " \
        "the device: the ranks of other processes that did not arrive are not known here" in nccl, nccl
    assert _NCCL_ABORTED.search(nccl), nccl


@pytest.mark.skipif(not FULL, reason="the full matrix runs with JAXCOMM_TEST_EMULATED_FULL=1")
@pytest.mark.parametrize("op", sorted(MP_ROUTES))
def test_two_process_fault_matrix(tmp_path, op):
    """Every fault kind at either process, on one route."""
    cells = [(op, kind, faulty) for kind in sorted(MP_ACTIONS) for faulty in (0, 1)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        done = list(pool.map(lambda c: _mp_job(tmp_path, *c), cells))
    for c, (res, trace) in zip(cells, done):
        _check_mp(res, trace, *c)
