"""jaxcomm collectives across processes (jax.distributed jobs started by jaxcomm.launch).

Each test launches a small job on 127.0.0.1 (tests/mp_util.py) and checks every rank's
results against NumPy (tests/multiprocess/check_ops.py), or the errors the survivors of a
failing job raise: they must name the missing process, its ranks, the op and the call.
"""

from __future__ import annotations

import json
import os
import pathlib
import re

import numpy as np

import pytest

from jaxcomm._src import distributed
from mp_util import MPResult, assert_ok, run_script

HERE = pathlib.Path(__file__).parent
CHECK_OPS = (HERE / "multiprocess" / "check_ops.py").read_text()


def assert_no_segments_left(res: MPResult) -> None:
    """The job left no shared-memory segment: none for the launcher to remove, none of its
    own left in /dev/shm. Only this job's names count (``jaxcomm-<job id>-``): other jobs,
    of parallel tests or of other users, may come and go meanwhile."""
    assert res.launch.removed_shm == [], res.format()
    prefix = distributed.shm_prefix(res.launch.job_id)
    try:
        left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    except FileNotFoundError:
        left = []
    assert left == [], left


# Processes 2h and 2h+1 play one host (JAXCOMM_HOST_ID): shared memory within, TCP
# across, all_reduce hierarchical.
TWO_PER_HOST = 'os.environ["JAXCOMM_HOST_ID"] = f"test-host-{RANK // 2}"\n'


# What check_ops.py prints for each mesh and axis ("CHECKED <tag> <case>", and the MoE
# layouts it runs there), and for the large operands ("CHECKED <tag> streamed<case>").
CHECKED_CASES = ["all_reduce sum", "all_reduce max", "all_reduce prod", "all_gather",
                 "all_gather axis 1", "reduce_scatter", "reduce_scatter dim 1", "all_to_all",
                 "all_to_all split 1 concat 0", "ppermute", "broadcast", "ragged_all_to_all"]
STREAMED_CASES = [" all_reduce sum", " all_reduce max", " all_gather", " reduce_scatter",
                  " all_to_all", " ppermute", " donated all_reduce in place",
                  " float16 all_reduce", " float16 reduce_scatter", " bfloat16 all_reduce",
                  " bfloat16 reduce_scatter"]


# JAXCOMM_NONTEMPORAL_BYTES=1: every result, however small, is written with streaming
# stores (ffi/cpu/result_stores.h), in the shared-memory streams and across hosts too.
# JAXCOMM_SINGLE_COPY=0: the streams go through the ring where they would read the peers'
# memory directly.
NT_RING = {"JAXCOMM_NONTEMPORAL_BYTES": "1", "JAXCOMM_SINGLE_COPY": "0"}


def assert_every_op_checked(res: MPResult, processes: int, devices: int, transport: str) -> None:
    """Every case of check_ops.py's meshes and axes checked, in every process: none
    silently skipped."""
    tags = {"p": ["moe packed"], "l": [], "pl": ["moe padded"], "transposed p": ["moe padded"],
            "transposed lp": ["moe packed"]} if devices > 1 else {"x": ["moe packed", "moe padded"]}
    streamed_tags = ["pl", "transposed p"] if devices > 1 else ["x"]
    want = {f"{t} {c}" for t, moe in tags.items() for c in CHECKED_CASES + moe} | {
        f"{t} streamed{c}" for t in streamed_tags for c in STREAMED_CASES}
    if transport == "hosts":
        want.add("hierarchical")
    for rank in range(processes):
        assert "ALL CHECKED" in res.output[rank], res.format()
        checked = [line.split("CHECKED ", 1)[1] for line in res.output[rank].splitlines()
                   if line.startswith("CHECKED ")]
        assert sorted(checked) == sorted(want), res.format()


# The case [2-1-auto] (2 processes of 1 device, shared memory, default settings) runs in
# shared_job, below.
@pytest.mark.parametrize("processes,devices,transport,settings", [
    (2, 2, "auto", NT_RING),
    (4, 1, "auto", {}),
    (2, 2, "tcp", {}),
    (3, 1, "tcp", {}),  # slices of 301000 elements that 3 processes do not divide evenly
    (4, 2, "tcp", {}),
    (4, 1, "hosts", {}),
    (4, 2, "hosts", {"JAXCOMM_NONTEMPORAL_BYTES": "1"}),
])
def test_every_op_matches_numpy_across_processes(processes: int, devices: int, transport: str,
                                                 settings: dict[str, str]) -> None:
    body = TWO_PER_HOST + CHECK_OPS if transport == "hosts" else CHECK_OPS
    env = {"JAXCOMM_TRANSPORT": "auto" if transport == "hosts" else transport, **settings}
    res = run_script(body, processes, devices, env=env, timeout_s=180)
    assert_ok(res)
    assert_every_op_checked(res, processes, devices, transport)
    assert_no_segments_left(res)


# A streamed round reads the peers' memory directly only if every process of it offers
# to: here process 1 turns it off (its links to the others still read directly), and both
# must then use the ring.
ONE_DECLINES_SINGLE_COPY = """
from jaxcomm import _jaxcomm
jaxcomm.reset_stats()
rounds, offered = _jaxcomm.single_copy_rounds(), _jaxcomm.single_copy()
if RANK == 1:
    _jaxcomm.set_single_copy(False)
mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("x",))
f = jax.jit(jax.shard_map(lambda v: jaxcomm.ppermute(v, "x", [(0, 1), (1, 0)]), mesh=mesh,
                          in_specs=P("x"), out_specs=P("x"), check_vma=False))
n = 300001  # 1.2 MB per rank: streamed
x = jax.device_put(np.arange(2 * n, dtype=np.float32), NamedSharding(mesh, P("x")))
for _ in range(3):
    out = f(x)
want = np.arange(2 * n, dtype=np.float32).reshape(2, n)[1 - RANK]
np.testing.assert_array_equal(np.asarray(out.addressable_shards[0].data), want)
assert {s.algorithm for s in jaxcomm.stats()} == {"shm stream"}, jaxcomm.stats()
print("SINGLE COPY ROUNDS", _jaxcomm.single_copy_rounds() - rounds, flush=True)
_jaxcomm.set_single_copy(offered)
"""


# The last process dies while the others are inside the loop's collectives. The script
# starts with ELEMENTS (per device) and ALGORITHM (what jaxcomm.stats() must report, or
# None) defined.
KILLED_MID_COLLECTIVE = """
import threading, signal, time
mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("x",))
step = jax.jit(jax.shard_map(
    lambda v: jax.lax.fori_loop(0, 50, lambda i, a: jaxcomm.all_reduce(a, "x") * 0.5, v),
    mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
x = jax.device_put(np.ones((jax.device_count() * ELEMENTS,), np.float32), NamedSharding(mesh, P("x")))
step(x).block_until_ready()
if ALGORITHM is not None:
    assert [s.algorithm for s in jaxcomm.stats()] == [ALGORITHM]
print("WARM", flush=True)
if RANK == NPROC - 1:
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
try:
    for _ in range(10000):
        step(x).block_until_ready()
    print("NO ERROR", flush=True)
except Exception as e:
    print("ERROR", str(e).replace("\\n", " "), flush=True)
    time.sleep(3)  # the others tell the dead process from this one's exit
    os._exit(3)
"""


@pytest.mark.parametrize("transport,elements", [
    ("auto", 65536),
    ("tcp", 65536),
    ("auto", 1 << 19),  # 2 MiB per rank: streamed through shared memory
])
def test_killed_process_is_named_by_the_survivors(transport: str, elements: int) -> None:
    res = run_script(f"ELEMENTS = {elements}\nALGORITHM = None\n" + KILLED_MID_COLLECTIVE, 2, 1,
                     env={"JAXCOMM_TRANSPORT": transport, "JAXCOMM_TIMEOUT_S": "60"},
                     timeout_s=90, grace_s=20)
    assert res.returncode != 0
    out = res.output[0]
    assert "WARM" in out and "NO ERROR" not in out, res.format()
    line = next(l for l in out.splitlines() if "ERROR" in l)
    # Detected directly (the process is gone / its connection closed), long before the
    # 60 s deadline, and named with its host, ranks, the op and the call.
    assert "timed out" not in line, line
    assert re.search(r"process 1 \(host \S+ \(127\.0\.0\.1\), pid \d+\) with ranks \[1\]", line), line
    assert "jaxcomm.all_reduce over axis 'x'" in line and re.search(r"execution #\d+", line), line
    assert ("exited" in line) if transport == "auto" else ("connection closed" in line), line
    assert_no_segments_left(res)


# Rounds in several exchanges, killing the last process:
# - hierarchical: process 3 (not a leader) dies; its host's leader hears it in the host
#   phase, the others, waiting on their leaders, watch it over their own links;
# - reduce-scatter then all-gather over TCP (1 MiB per rank): every survivor exchanges
#   with it in both phases.
@pytest.mark.parametrize("processes,elements,algorithm,env,extra", [
    (4, 4096, "hierarchical shm+tcp", {}, TWO_PER_HOST),
    (3, 1 << 18, "tcp reduce-scatter+all-gather", {"JAXCOMM_TRANSPORT": "tcp"}, ""),
])
def test_killed_process_in_a_phased_round_is_named_by_every_survivor(
        processes: int, elements: int, algorithm: str, env: dict[str, str], extra: str) -> None:
    body = extra + f'ELEMENTS = {elements}\nALGORITHM = "{algorithm}"\n' + KILLED_MID_COLLECTIVE
    res = run_script(body, processes, 1, env={**env, "JAXCOMM_TIMEOUT_S": "60"},
                     timeout_s=120, grace_s=20)
    assert res.returncode != 0
    dead = processes - 1
    for rank in range(dead):
        out = res.output[rank]
        assert "WARM" in out and "NO ERROR" not in out, res.format()
        line = next(l for l in out.splitlines() if "ERROR" in l)
        assert "timed out" not in line, line
        assert re.search(rf"process {dead} \(host \S+ \(127\.0\.0\.1\), pid \d+\) with ranks \[{dead}\]",
                         line), line
        assert "jaxcomm.all_reduce over axis 'x'" in line, line


LATE_PROCESS = """
import time
mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("x",))
def program(timeout_s):
    return jax.jit(jax.shard_map(lambda v: jaxcomm.all_gather(v, "x", tiled=True, timeout_s=timeout_s),
                                 mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
x = jax.device_put(np.arange(jax.device_count(), dtype=np.float32), NamedSharding(mesh, P("x")))
within, past = program(5.0), program(2.0)
# Process 1 comes 1 s late, within the 5 s deadline: the call completes everywhere.
if RANK == 1:
    time.sleep(1)
print("WITHIN", np.asarray(within(x).addressable_shards[0].data).tolist(), flush=True)
past(x).block_until_ready()  # compiled, and both processes past the first call
from jaxcomm._src import distributed
kv = distributed.kv_client()
if RANK == 1:
    # Alive, but never arrives: waits until process 0 is done.
    kv.blocking_key_value_get("test/late/done", 60000)
    os._exit(0)
start = time.monotonic()
try:
    past(x).block_until_ready()
    print("NO ERROR", flush=True)
except Exception as e:
    print("ELAPSED", time.monotonic() - start, flush=True)
    print("ERROR", str(e).replace("\\n", " "), flush=True)
kv.key_value_set("test/late/done", "1")
os._exit(0)
"""


@pytest.fixture(scope="module")
def shared_job() -> MPResult:
    """One job of 2 processes x 1 device over shared memory, default settings, for the
    scenarios that fit one after the other in it (a job of its own starts 2 Pythons that
    import jax, and a coordination service): check_ops.py (every_op's [2-1-auto] case),
    then ONE_DECLINES_SINGLE_COPY, then LATE_PROCESS, which ends the job. A scenario that
    fails ends the job: the tests of the scenarios after it fail too, with its output."""
    return run_script(CHECK_OPS + ONE_DECLINES_SINGLE_COPY + LATE_PROCESS, 2, 1,
                      env={"JAXCOMM_TRANSPORT": "auto"}, timeout_s=240, grace_s=10)


def test_every_op_matches_numpy_across_two_processes(shared_job: MPResult) -> None:
    """test_every_op_matches_numpy_across_processes's case [2-1-auto]."""
    assert_ok(shared_job)
    assert_every_op_checked(shared_job, 2, 1, "auto")
    assert_no_segments_left(shared_job)


def test_single_copy_needs_every_process_to_offer_it(shared_job: MPResult) -> None:
    res = shared_job
    assert_ok(res)
    for rank in range(2):
        assert "SINGLE COPY ROUNDS 0" in res.output[rank], res.format()


def test_late_process_within_the_deadline_completes_past_it_fails_at_the_deadline(
        shared_job: MPResult) -> None:
    res = shared_job
    for rank in range(2):
        assert f"WITHIN {[0.0, 1.0]}" in res.output[rank], res.format()
    line = next((l for l in res.output[0].splitlines() if "ERROR" in l), "")
    assert line.startswith("ERROR DEADLINE_EXCEEDED"), res.format()
    assert "timed out" in line and "process 1" in line and "ranks [1]" in line, line
    assert "did not arrive at this call" in line and "jaxcomm.all_gather" in line, line
    # Not before the deadline, nor long after it (a generous bound for a loaded machine).
    elapsed = float(next(l for l in res.output[0].splitlines() if l.startswith("ELAPSED")).split()[1])
    assert 2.0 <= elapsed < 30.0, elapsed


TWO_MESHES = """
devices = np.asarray(jax.devices())
dp = jax.sharding.Mesh(devices.reshape(NPROC, LOCAL), ("dp", "ep"))
ep = jax.sharding.Mesh(devices.reshape(NPROC, LOCAL).T, ("ep", "dp"))
def program(mesh):
    def body(v):
        a = jaxcomm.all_reduce(v, "dp")
        b = jaxcomm.all_gather(v, "ep", tiled=True)
        return a + b.reshape(-1, *v.shape).sum(0)
    spec = P(("dp", "ep") if mesh is dp else ("ep", "dp"))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)), spec
X = np.arange(jax.device_count() * 3, dtype=np.float32).reshape(-1, 3)
for it in range(3):
    for mesh in (dp, ep):
        f, spec = program(mesh)
        out = f(jax.device_put(X, NamedSharding(mesh, spec)))
        flat = list(mesh.devices.reshape(-1))
        grid = np.arange(len(flat)).reshape(mesh.devices.shape)
        for shard in out.addressable_shards:
            p = flat.index(shard.device)
            i, j = map(int, np.argwhere(grid == p)[0])
            dp_axis = mesh.axis_names.index("dp")
            dp_group = grid[:, j] if dp_axis == 0 else grid[i, :]
            ep_group = grid[i, :] if dp_axis == 0 else grid[:, j]
            want = X[dp_group].sum(0) + X[ep_group].sum(0)
            np.testing.assert_allclose(np.asarray(shard.data)[0], want, err_msg=f"iteration {it}")
print("ALTERNATED", flush=True)
"""


def test_two_meshes_used_alternately_never_mix() -> None:
    res = run_script(TWO_MESHES, 2, 2, timeout_s=120)
    assert_ok(res)
    assert all("ALTERNATED" in res.output[r] for r in range(2))


# Both processes' device threads start on core 0, then may run on cores 0 and 1: within
# the first loop, a thread that waits for the other on its own core moves (PeerSpin).
# Left alone, the scheduler separated them after some 30 ms of the loop, sometimes at
# once, and where each thread is after the loop is the scheduler's too: what is asserted
# is that every thread keeps its affinity and the results are right (the move itself:
# test_leave_core_moves_the_thread_and_keeps_its_affinity).
SHARED_CORE = """
import ctypes
from jaxcomm import _jaxcomm
sched_getcpu = ctypes.CDLL(None).sched_getcpu
mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("x",))
step = jax.jit(jax.shard_map(
    lambda v: jax.lax.fori_loop(0, 2000, lambda i, a: jaxcomm.all_reduce(a, "x") * 0.5, v),
    mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
x = jax.device_put(np.ones((NPROC,), np.float32), NamedSharding(mesh, P("x")))
os.sched_setaffinity(0, {0})
step(x).block_until_ready()
moves = _jaxcomm.core_moves()
os.sched_setaffinity(0, {0, 1})
out = step(x)
out.block_until_ready()
np.testing.assert_allclose(np.asarray(out.addressable_shards[0].data), 1.0)
print("PLACED", sched_getcpu(), sorted(os.sched_getaffinity(0)), _jaxcomm.core_moves() - moves, flush=True)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0),
                    reason="needs cores 0 and 1")
def test_processes_spinning_on_one_core_keep_their_affinity() -> None:
    res = run_script(SHARED_CORE, 2, 1, timeout_s=120)
    assert_ok(res)
    placed = [re.search(r"PLACED (\d+) \[([\d, ]+)\] (\d+)", res.output[r]) for r in range(2)]
    assert all(placed), res.format()
    assert all(m.group(2) == "0, 1" for m in placed), res.format()


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs cores 0 and 1")
def test_leave_core_moves_the_thread_and_keeps_its_affinity() -> None:
    import ctypes
    from jaxcomm import _jaxcomm
    sched_getcpu = ctypes.CDLL(None).sched_getcpu
    saved = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {0, 1})
        cpu = sched_getcpu()
        assert _jaxcomm.leave_core(cpu) is True
        assert sched_getcpu() != cpu
        assert os.sched_getaffinity(0) == {0, 1}
        # Nowhere else to go: it stays, and its affinity too.
        os.sched_setaffinity(0, {cpu})
        assert _jaxcomm.leave_core(cpu) is False
        assert sched_getcpu() == cpu
        assert os.sched_getaffinity(0) == {cpu}
    finally:
        os.sched_setaffinity(0, saved)


FT_ALL_REDUCE = """
import signal
mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("dp",))
f = jax.jit(jax.shard_map(lambda v: jaxcomm.ft.all_reduce(v, "dp", timeout_s=10.0), mesh=mesh,
                          in_specs=P("dp"), out_specs=(P(), P()), check_vma=False))
x = jax.make_array_from_process_local_data(
    NamedSharding(mesh, P("dp")), np.full((LOCAL, 3), 10.0 ** RANK, np.float32))
for step in range(5):
    if RANK == int(os.environ["FT_VICTIM"]) and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    total, mask = f(x)
    print("RESULT", json.dumps({"step": step,
          "total": np.asarray(total.addressable_shards[0].data).tolist(),
          "mask": np.asarray(mask.addressable_shards[0].data).tolist(),
          "excluded": jaxcomm.ft.excluded()}), flush=True)
"""


# Process 0 too: the launcher runs JAX's coordination service in a process of its own.
@pytest.mark.parametrize("transport,victim", [("auto", 2), ("tcp", 2), ("tcp", 0)])
def test_ft_all_reduce_leaves_a_killed_process_out_and_keeps_going(transport: str, victim: int,
                                                                   tmp_path) -> None:
    res = run_script("import json\n" + FT_ALL_REDUCE, 4, 1, keep_going=True, timeout_s=120,
                     env={"JAXCOMM_TRANSPORT": transport, "JAXCOMM_TRACE_DIR": str(tmp_path),
                          "FT_VICTIM": str(victim)})
    assert res.launch.returncodes[victim] == -9 and res.launch.terminated == [], res.format()
    assert [c for r, c in enumerate(res.launch.returncodes) if r != victim] == [0] * 3
    for rank in sorted(set(range(4)) - {victim}):
        steps = [json.loads(l.split(" ", 1)[1]) for l in res.output[rank].splitlines()
                 if l.startswith("RESULT ")]
        assert [s["step"] for s in steps] == list(range(5)), res.format()
        for s in steps:
            alive = [r for r in range(4) if not (r == victim and s["step"] >= 2)]
            assert s["mask"] == [r in alive for r in range(4)], s
            np.testing.assert_allclose(s["total"], [[sum(10.0 ** r for r in alive)] * 3])
        assert steps[-1]["excluded"] == [victim]
    # The survivors' flight recorders name the rank they went on without, from its call.
    import jaxcomm.trace
    report = jaxcomm.trace.analyze(tmp_path)
    assert report.kind == "dead" and report.exit_code == 1, report.text()
    finding = report.findings[0]
    assert finding.culprits == [victim] and finding.op == "ft.all_reduce", report.text()
    assert finding.execution == 3 and finding.processes == [victim], report.text()


# Process 2 starts its own replacement (same process index, same program) and dies; the
# replacement calls jaxcomm.ft.rejoin() and, having no state, contributes only its
# constant until it has synced the step counter from the others.
REJOIN = """
import json, signal, subprocess, time
restarted = os.environ.get("JAXCOMM_TEST_RESTARTED") == "1"
if restarted:
    jaxcomm.ft.rejoin()
mesh = Mesh(np.asarray(jax.devices()), ("dp",))
f = jax.jit(jax.shard_map(lambda v: jaxcomm.ft.all_reduce(v, "dp", timeout_s=10.0), mesh=mesh,
                          in_specs=P("dp"), out_specs=(P(), P()), check_vma=False))
# At least STEPS steps, and on until the replacement is back: the survivors must not
# finish before it could rejoin (it starts a new Python and jax, slow on a loaded machine).
STEPS, MAX_STEPS = 30, 500
step = 0
has_state = 0.0 if restarted else 1.0
gap = restarted  # whether this process saw a step without process 2
while step < MAX_STEPS:
    if RANK == 2 and not restarted and step == 5:
        subprocess.Popen([sys.executable] + sys.argv, env=dict(os.environ, JAXCOMM_TEST_RESTARTED="1"))
        os.kill(os.getpid(), signal.SIGKILL)
    v = np.asarray([[10.0 ** RANK, has_state, step * has_state]], np.float32)
    total, mask = f(jax.make_array_from_process_local_data(NamedSharding(mesh, P("dp")), v))
    t = np.asarray(total.addressable_shards[0].data)[0]
    m = np.asarray(mask.addressable_shards[0].data).tolist()
    synced = int(round(t[2] / t[1]))  # the step of the processes that have state
    print("RESULT", json.dumps({"step": synced, "total": float(t[0]), "mask": m, "restarted": restarted}), flush=True)
    step, has_state = synced + 1, 1.0
    gap = gap or not all(m)
    if step >= STEPS and gap and all(m):
        break
    time.sleep(0.2)
print("FINISHED", flush=True)
"""


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_restarted_process_rejoins_ft_all_reduce(transport: str) -> None:
    res = run_script(REJOIN, 3, 1, keep_going=True, timeout_s=150,
                     env={"JAXCOMM_TRANSPORT": transport})
    assert res.launch.returncodes == [0, 0, -9], res.format()
    for rank in (0, 1, 2):
        assert "FINISHED" in res.output[rank], res.format()
    steps: dict[int, list[dict]] = {0: [], 1: [], 2: []}
    for rank, text in res.output.items():
        for line in text.splitlines():
            if line.startswith("RESULT "):
                steps[rank].append(json.loads(line.split(" ", 1)[1]))
    for rank in (0, 1):
        masks = [tuple(r["mask"]) for r in steps[rank]]
        assert [r["step"] for r in steps[rank]] == list(range(max(30, len(steps[rank]))))
        # All three, then the two survivors, then all three again: in that order, once.
        phases = [m for i, m in enumerate(masks) if i == 0 or masks[i - 1] != m]
        assert phases == [(True, True, True), (True, True, False), (True, True, True)], masks
        for r in steps[rank]:
            assert r["total"] == (111.0 if all(r["mask"]) else 11.0), r
    replacement = [r for r in steps[2] if r["restarted"]]
    assert replacement and all(all(r["mask"]) and r["total"] == 111.0 for r in replacement)
    # All three stopped after the same step.
    assert steps[0][-1]["step"] == steps[1][-1]["step"] == replacement[-1]["step"]
    # The replacement's results are the survivors' results of the same steps.
    survivor = {r["step"]: r for r in steps[0]}
    assert all(survivor[r["step"]]["mask"] == r["mask"] for r in replacement)
