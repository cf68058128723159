"""python -m jaxcomm.launch and jaxcomm.init() (the benchmark's tests are in test_bench.py).

Every multi-process job here runs on 127.0.0.1 with a job timeout, so a broken launcher
fails a test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import jaxcomm
from jaxcomm import launch
from jaxcomm._src import distributed
from mp_util import assert_ok, results, run_script

# Children import the jaxcomm this test imported (installed, or the built source tree),
# and run from the tests directory: from the repository root, `python -m` would find the
# unbuilt source tree first.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(jaxcomm.__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
_LAUNCH_VARS = distributed.LAUNCH_ENV + ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID",
                                         "SLURM_LOCALID", "SLURM_STEP_NODELIST",
                                         "OMPI_COMM_WORLD_SIZE", "OMPI_MCA_orte_hnp_uri",
                                         "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


def _child_env(**extra: str) -> dict[str, str]:
    """This environment without any multi-process job in it, jaxcomm importable."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


def _python(code: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=HERE)


# ------------------------------------------------------------------ collectives across processes

PSUM_BODY = """
import json
n = jax.device_count()
assert n == NPROC * LOCAL == NPROC * int(os.environ["JAXCOMM_LOCAL_DEVICES"]), (n, NPROC, LOCAL)
data = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
# Axis "a" always crosses processes; "b" stays inside one when a process has 2 devices.
mesh = Mesh(np.asarray(jax.devices()).reshape(2, n // 2), ("a", "b"))
spec = P(("a", "b"))
x = jax.make_array_from_callback((n, 3), NamedSharding(mesh, spec), lambda idx: data[idx])

def f(v):
    return jax.lax.psum(v, ("a", "b")), jax.lax.psum(v, "a"), jax.lax.psum(v, "b")

# Every device returns its own copy of each result: row k is device k's.
g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=(spec, spec, spec)))
rows = {}
for name, arr in zip(("all", "a", "b"), g(x)):
    for shard in arr.addressable_shards:
        rows[f"{name}/{shard.index[0].start}"] = np.asarray(shard.data)[0].tolist()
print("RESULT", json.dumps(rows))
"""


@pytest.mark.parametrize("nproc,devices", [(2, 2), (4, 1)])
def test_psum_across_processes(nproc, devices):
    res = run_script(PSUM_BODY, nproc, devices)
    assert_ok(res)
    per_rank = results(res)
    assert sorted(per_rank) == list(range(nproc)), res.format()
    rows = {k: v for r in per_rank.values() for k, v in r.items()}
    n = nproc * devices
    data = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    grid = data.reshape(2, n // 2, 3)
    expected = {}
    for k in range(n):
        i, j = divmod(k, n // 2)
        expected[f"all/{k}"] = data.sum(0).tolist()
        expected[f"a/{k}"] = grid[:, j].sum(0).tolist()
        expected[f"b/{k}"] = grid[i].sum(0).tolist()
    assert rows == expected


# --------------------------------------------------------------------------------- output

PRINTER = """\
import os, sys, time
r = os.environ["JAXCOMM_PROCESS_ID"]
for i in range(3):
    # Half a line, a pause, the rest: the other rank writes in between.
    sys.stdout.write(f"out {r} {i} first-half "); sys.stdout.flush(); time.sleep(0.05)
    sys.stdout.write("second-half\\n"); sys.stdout.flush()
print(f"err {r}", file=sys.stderr)
print("ENV", os.environ["JAXCOMM_NUM_PROCESSES"], os.environ["JAXCOMM_COORDINATOR"],
      os.environ["JAXCOMM_JOB_ID"], os.environ["JAXCOMM_LOCAL_DEVICES"],
      os.environ["XLA_FLAGS"])
sys.stdout.write(f"tail {r}")   # the last line has no newline
"""


def test_cli_prefixes_every_line_with_its_rank(tmp_path):
    script = tmp_path / "printer.py"
    script.write_text(PRINTER)
    env = _child_env(XLA_FLAGS="--xla_cpu_enable_fast_math=false "
                               "--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-m", "jaxcomm.launch", "-n", "2", "-d", "3",
                           "--timeout", "60", str(script)],
                          env=env, capture_output=True, text=True, timeout=90, cwd=HERE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out, err = proc.stdout.splitlines(), proc.stderr.splitlines()
    assert out and all(re.match(r"^\[[01]\] ", line) for line in out), proc.stdout
    for r in (0, 1):
        for i in range(3):
            assert f"[{r}] out {r} {i} first-half second-half" in out
        assert f"[{r}] tail {r}" in out
        assert f"[{r}] err {r}" in err
    assert not any("err" in line for line in out)
    envs = [line.split()[1:] for line in out if line.split()[1] == "ENV"]
    assert len(envs) == 2
    (_, n0, coord0, job0, dev0, *flags0), (_, n1, coord1, job1, dev1, *flags1) = envs
    assert n0 == n1 == "2" and dev0 == dev1 == "3"
    assert coord0 == coord1 and re.fullmatch(r"127\.0\.0\.1:\d+", coord0)
    assert job0 == job1 and distributed.is_valid_job_id(job0)
    assert flags0 == flags1 == ["--xla_cpu_enable_fast_math=false",
                                "--xla_force_host_platform_device_count=3"]


# -------------------------------------------------------------------------------- failures

@pytest.mark.parametrize("bind", ["none", "cores"])
def test_bind_gives_each_process_its_own_cores(bind):
    body = """
    import os
    print("CORES", sorted(os.sched_getaffinity(0)))
    """
    n = 2
    res = run_script(body, n, bind=bind, prologue=False)
    assert res.returncode == 0, res.format()
    usable = sorted(os.sched_getaffinity(0))
    for rank in range(n):
        line = next(l for l in res.output[rank].splitlines() if "CORES" in l)
        want = usable if bind == "none" or n > len(usable) else sorted(launch.rank_cores(rank, n))
        assert line.endswith(f"CORES {want}"), line


def test_rank_cores_share_the_usable_cores_out():
    usable = sorted(os.sched_getaffinity(0))
    shares = [launch.rank_cores(r, len(usable)) for r in range(len(usable))]
    assert shares == [{c} for c in usable]
    assert launch.rank_cores(0, len(usable) + 1) is None
    assert launch.rank_cores(0, 1) == set(usable)


def test_bad_bind_is_refused():
    with pytest.raises(ValueError, match="bind must be 'cores' or 'none', got 'all'"):
        launch.launch(["x.py"], 1, bind="all")


def test_failing_process_terminates_the_others_after_the_grace_period():
    body = """
    import time
    if RANK == 1:
        raise RuntimeError("process 1 fails on purpose")
    time.sleep(120)
    """
    res = run_script(body, 3, grace_s=1.0)
    job = res.launch
    assert res.returncode == 1, res.format()
    assert job.failed_process == job.failed_rank == 1 and not job.timed_out
    assert job.terminated == [0, 2], res.format()
    assert all(job.returncodes[r] < 0 for r in (0, 2)), job.returncodes
    assert "process 1 fails on purpose" in res.output[1]
    # The launcher's words: processes (a rank is a device's place in a collective).
    assert "process 1 exited with status 1; giving processes [0, 2] 1 s to finish" in res.output[-1], (
        res.format())
    assert "terminated processes [0, 2]" in res.output[-1], res.format()


def test_other_processes_may_report_their_own_errors_within_the_grace_period():
    body = """
    import time
    if RANK == 1:
        raise RuntimeError("process 1 fails on purpose")
    time.sleep(0.5)
    raise RuntimeError(f"process {RANK} reports its own error")
    """
    res = run_script(body, 2, grace_s=30.0)
    assert res.returncode == 1, res.format()
    assert res.launch.failed_process == 1
    assert res.launch.terminated == [], res.format()
    assert "process 0 reports its own error" in res.output[0]


def test_process_killed_by_a_signal():
    body = """
    import signal, time
    if RANK == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
    """
    res = run_script(body, 2, grace_s=1.0)
    assert res.returncode == 128 + signal.SIGKILL, res.format()
    assert res.launch.failed_process == 1
    assert "process 1 was killed by SIGKILL" in res.output[-1]


def test_job_timeout():
    res = run_script("import time\ntime.sleep(120)\n", 2, timeout_s=2.0, prologue=False)
    assert res.returncode == launch.TIMEOUT_EXIT, res.format()
    assert res.launch.timed_out and res.launch.terminated == [0, 1]


def test_leftover_shared_memory_of_the_job_is_removed():
    job_id = distributed.new_job_id()
    decoy = f"/dev/shm/jaxcomm-{job_id}0-not-this-job"  # another job's id extends ours
    body = """
    import os
    rank = os.environ["JAXCOMM_PROCESS_ID"]
    with open(f"/dev/shm/jaxcomm-{os.environ['JAXCOMM_JOB_ID']}-left-by-{rank}", "w") as f:
        f.write("x")
    """
    try:
        with open(decoy, "w") as f:
            f.write("x")
        res = run_script(body, 2, prologue=False, job_id=job_id)
        assert_ok(res)
        left = [f"/dev/shm/jaxcomm-{job_id}-left-by-{r}" for r in (0, 1)]
        assert res.launch.removed_shm == left
        assert not any(os.path.exists(p) for p in left)
        assert os.path.exists(decoy)
        assert "removed 2 shared-memory segment(s)" in res.output[-1]
    finally:
        for path in [decoy] + [f"/dev/shm/jaxcomm-{job_id}-left-by-{r}" for r in (0, 1)]:
            if os.path.exists(path):
                os.unlink(path)


# SIGINT is blocked before "ready" is printed and then waited for: it is taken whenever it
# comes, even while the rank is still printing (a KeyboardInterrupt raised inside print,
# before a try block, failed this test on a loaded machine).
SLEEPER = """\
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
print("ready", flush=True)
if signal.sigtimedwait([signal.SIGINT], 60) is not None:
    print("interrupted", os.environ["JAXCOMM_PROCESS_ID"], flush=True)
    sys.exit(1)
"""


def test_ctrl_c_is_forwarded_to_every_rank(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    proc = subprocess.Popen([sys.executable, "-m", "jaxcomm.launch", "-n", "2", "--grace", "20",
                             "--timeout", "60", str(script)],
                            env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=HERE)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while not {"[0] ready", "[1] ready"} <= {s.strip() for s in seen}:
            seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    while not lines.empty():
        seen.append(lines.get())
    stderr = proc.stderr.read()
    assert proc.returncode == 128 + signal.SIGINT, "".join(seen) + stderr
    text = "".join(seen)
    assert "[0] interrupted 0" in text and "[1] interrupted 1" in text, text + stderr


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


WAITER = """\
import os, time, jaxcomm
jaxcomm.init()
print("pid", os.getpid(), flush=True)
time.sleep(60)
"""


def test_ranks_stop_when_the_launcher_is_killed(tmp_path):
    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    proc = subprocess.Popen([sys.executable, "-m", "jaxcomm.launch", "-n", "2", "--timeout",
                             "60", str(script)], env=_child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=HERE)
    pids: list[int] = []
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout],
                         daemon=True).start()
        deadline = time.monotonic() + 60
        while len(pids) < 2:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if " pid " in line:
                pids.append(int(line.split()[-1]))
        proc.kill()  # SIGKILL: the launcher cannot clean up
        proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), f"ranks {pids} outlived their launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------------------- jaxcomm.init()

def test_init_is_a_no_op_outside_a_job(monkeypatch):
    import jax
    import jaxcomm
    for var in _LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    assert jaxcomm.init() is False
    assert not jax.distributed.is_initialized()


def test_init_refuses_once_a_backend_exists():
    env = _child_env(JAXCOMM_COORDINATOR="127.0.0.1:1", JAXCOMM_NUM_PROCESSES="2",
                     JAXCOMM_PROCESS_ID="0")
    proc = _python("""
        import jax, jaxcomm
        jax.devices()
        jaxcomm.init()
    """, env)
    assert proc.returncode != 0
    assert "must run before anything creates a JAX backend" in proc.stderr, proc.stderr


def test_launch_spec_validates_the_variables():
    base = {"JAXCOMM_COORDINATOR": "127.0.0.1:5", "JAXCOMM_NUM_PROCESSES": "2",
            "JAXCOMM_PROCESS_ID": "1", "JAXCOMM_JOB_ID": "ab12"}
    assert distributed.launch_spec({}) is None
    assert distributed.launch_spec(base) == dict(coordinator="127.0.0.1:5", num_processes=2,
                                                 process_id=1, local_devices=None,
                                                 job_id="ab12")
    for bad, message in (({"JAXCOMM_PROCESS_ID": "2"}, "0 <= JAXCOMM_PROCESS_ID"),
                         ({"JAXCOMM_NUM_PROCESSES": "two"}, "not an integer"),
                         ({"JAXCOMM_JOB_ID": "a-b"}, "letters or digits")):
        with pytest.raises(ValueError, match=message):
            distributed.launch_spec({**base, **bad})
    with pytest.raises(ValueError, match="JAXCOMM_PROCESS_ID"):
        distributed.launch_spec({"JAXCOMM_COORDINATOR": "127.0.0.1:5",
                                 "JAXCOMM_NUM_PROCESSES": "2"})


def test_cluster_detection():
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0"}
    assert distributed.detected_cluster({}) is None
    assert distributed.detected_cluster({**slurm, "SLURM_NTASKS": "1"}) is None
    assert distributed.detected_cluster({**slurm, "SLURM_NTASKS": "4"}) == "slurm"
    assert distributed.detected_cluster({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:5",
                                         "OMPI_COMM_WORLD_SIZE": "2"}) == "ompi"
    assert distributed.detected_cluster({"OMPI_COMM_WORLD_SIZE": "1"}) is None


def test_importing_jaxcomm_initializes_no_backend():
    proc = _python("""
        import jaxcomm, jaxcomm.launch, jaxcomm.moe, jaxcomm.bench
        import jax
        from jax._src import xla_bridge
        assert not xla_bridge.backends_are_initialized(), list(xla_bridge._backends)
        assert not jax.distributed.is_initialized()
        assert jaxcomm.init() is False          # no job: still nothing initialized
        assert not xla_bridge.backends_are_initialized(), list(xla_bridge._backends)
        print("clean")
    """, _child_env())
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr


def test_job_id_is_the_launchers_in_every_process():
    res = run_script("""
    import json
    from jaxcomm._src import distributed
    print("RESULT", json.dumps([distributed.get_job_id(), distributed.shm_prefix()]))
    """, 2)
    assert_ok(res)
    job = res.launch.job_id
    assert results(res) == {0: [job, f"jaxcomm-{job}-"], 1: [job, f"jaxcomm-{job}-"]}
