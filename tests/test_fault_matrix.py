"""The fault matrix: one injected fault per job of 4 processes, each kind at process 0,
a middle process and the last one, over shared memory and over TCP.

Each cell launches ``python -m jaxcomm.launch``'s job with ``JAXCOMM_TRACE_DIR`` set and
``JAXCOMM_FAULT`` making one process hang, exit, or arrive far later than the deadline
at the second call of a loop of all_reduces, then checks that

* the flight recorder's verdict names the faulty process first (its first finding's
  processes are exactly that one), whatever the others did after giving up on it;
* the launcher's summary leads back to the same process;
* no process of the job is left running (workers, what they started, the coordination
  service).

The three cells of one fault kind (process 0, 2, 3) run as three jobs at once: they
share nothing but the CPUs (own coordinator, job id, ports, trace directory), the loop's
deadline (5 s) is long against a call (microseconds), and every process passes a
barrier with a generous deadline after compiling, before the short deadlines start.

A cell costs about 4 processes' start (jax import, compile: ~3 s of CPU each), so the
18 cells take 2-3 minutes on 2 cores. The test suite runs half of them: every fault
kind at every position, over shared memory or TCP in turn (9 cells, ~80 s); the other
half, each of those over the other transport, runs with ``JAXCOMM_TEST_SLOW=1``.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import textwrap

import pytest

from jaxcomm import launch
from jaxcomm.trace import analyzer
from slow_util import slow

# Under pytest-xdist, one worker runs the cells' tests one after the other: each already
# runs its three jobs at once (12 processes on 2 cores).
pytestmark = pytest.mark.xdist_group("fault_matrix")

N = 4
#: The deadline of the faulty loop's all_reduce, seconds.
DEADLINE_S = 5
POSITIONS = {"first": 0, "middle": 2, "last": N - 1}
ACTIONS = {"hang": "hang", "exit": "exit", "delay": f"delay:{DEADLINE_S * 8}"}

SCRIPT = textwrap.dedent(f"""
    import numpy as np
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxcomm

    jaxcomm.init()
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    def barrier(v):
        return jaxcomm.all_reduce(v, "x", timeout_s=120)

    def faulty(v):
        return jaxcomm.all_reduce(v, "x", timeout_s={DEADLINE_S})

    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                               np.ones((1, 4), np.float32))
    step = smap(faulty).lower(x).compile()  # compiled before the barrier: no skew after it
    jax.block_until_ready(smap(barrier)(x))
    for i in range(4):
        y = jax.block_until_ready(step(x))
    assert float(np.asarray(y.addressable_shards[0].data)[0, 0]) == {N}
    print("RAN-OK", flush=True)
""")


def _job_processes(job_id: str) -> list[int]:
    """Pids of live processes whose environment holds this job's id."""
    needle = f"JAXCOMM_JOB_ID={job_id}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read():
                    with open(f"/proc/{entry}/stat") as s:
                        if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                            found.append(int(entry))
        except OSError:
            continue
    return found


def _cell(tmp_path, transport: str, kind: str, position: str) -> tuple[launch.LaunchResult, str]:
    """Runs one cell; returns the launch result and its trace directory."""
    faulty = POSITIONS[position]
    work = tmp_path / f"{kind}-{position}-{transport}"
    work.mkdir()
    (work / "script.py").write_text(SCRIPT)
    trace_dir = work / "trace"
    env = dict(os.environ, JAXCOMM_TRANSPORT=transport, JAXCOMM_TRACE_DIR=str(trace_dir),
               JAX_PLATFORMS="cpu",
               JAXCOMM_FAULT=f"process={faulty},site=(faulty),call=2,action={ACTIONS[kind]}")
    res = launch.launch([str(work / "script.py")], N, env=env, capture=True, timeout_s=150,
                        grace_s=2, cwd=str(work))
    return res, str(trace_dir)


def _transport(kind: str, position: str, half: str) -> str:
    """Shared memory or TCP for a cell: alternating over kinds and positions; the other
    half of the matrix takes the other one."""
    turn = (sorted(ACTIONS).index(kind) + list(POSITIONS).index(position)) % 2
    return ("auto", "tcp")[turn if half == "core" else 1 - turn]


@pytest.mark.parametrize("half", [
    "core",
    slow("rest", reason="the other half of the fault matrix"),
])
@pytest.mark.parametrize("kind", sorted(ACTIONS))
def test_fault_matrix(tmp_path, kind: str, half: str) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(POSITIONS)) as pool:
        runs = {pos: pool.submit(_cell, tmp_path, _transport(kind, pos, half), kind, pos)
                for pos in POSITIONS}
        results = {pos: f.result() for pos, f in runs.items()}
    verdicts = {}
    for position, (res, trace_dir) in results.items():
        faulty = POSITIONS[position]
        transport = _transport(kind, position, half)
        cell = f"{kind} at process {faulty} over {transport}"
        assert _job_processes(res.job_id) == [], f"{cell}: processes left running"
        assert res.returncode != 0 and all(c is not None for c in res.returncodes), (
            f"{cell}: {res.returncodes}\n{res.format()}")
        report = analyzer.analyze(trace_dir)
        verdicts[position] = report.verdict
        named = re.findall(r"process (\d+)", report.verdict)
        assert named and int(named[0]) == faulty, f"{cell}: {report.text()}\n{res.format()}"
        top = report.findings[0]
        assert top.processes == [faulty], f"{cell}: {report.text()}"
        assert top.kind == ("dead" if kind == "exit" else "hang"), f"{cell}: {report.text()}"
        assert top.op == "all_reduce" and "(faulty)" in top.call_site, report.text()
        # Every process left its records, the faulty one included (a ring file survives
        # _exit and SIGTERM alike).
        assert report.processes == list(range(N)), f"{cell}: {report.text()}"
        assert res.cause == [faulty], f"{cell}: {res.cause}\n{res.format()}"
        assert res.verdict == report.verdict
        assert f"the failure starts at process {faulty}" in res.format()
    print("\n".join(f"{kind} at {pos} ({_transport(kind, pos, half)}): {v}"
                    for pos, v in verdicts.items()))

