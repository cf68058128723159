"""jaxcomm across real hosts: processes in network namespaces with their own hostnames.

Each host is a network namespace (tests/netns_util.py): its own veth interfaces, its own
name (``unshare --uts``), an ``/etc/hosts`` that resolves every host's name to its job
address, and a default route through a second network that is not the job's. The job's
coordination service runs on node0 and is reachable only over the job's network; no
process is told which host it is on (no ``JAXCOMM_HOST_ID``): jaxcomm must find out.
Skipped where namespaces cannot be made (not root).
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest

from mp_util import MPResult, assert_ok, results, run_script
from netns_util import VirtualCluster, unavailable
from test_multiprocess import CHECK_OPS, KILLED_MID_COLLECTIVE, assert_every_op_checked

pytestmark = pytest.mark.skipif(unavailable() is not None,
                                reason=f"network namespaces: {unavailable()}")

@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[VirtualCluster]:
    """A fresh cluster of ``request.param`` hosts (default 2), removed however the test ends."""
    c = VirtualCluster(getattr(request, "param", 2))
    try:
        yield c
    finally:
        c.close()


# What each process reports of itself after the checks: its host's name, the address its
# TCP listener is bound to (from the kernel's table of this network namespace's listening
# sockets, /proc/net/tcp, by the port the endpoint published), and the kind of link to each
# other process.
REPORT = """
import json, socket
from jaxcomm._src import bootstrap as _bootstrap
from jaxcomm import _jaxcomm
port = int(_bootstrap._endpoint()["transports"]["tcp"]["port"])
bound = []
with open("/proc/net/tcp") as f:
    for line in f.readlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if state == "0A" and int(p, 16) == port:
            bound.append(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
print("REPORT", json.dumps({"hostname": socket.gethostname(), "listen": bound,
                            "links": {str(q): _jaxcomm.transport_kind(q) for q in range(NPROC) if q != RANK}}),
      flush=True)
"""


def _env(hosts: int) -> dict[str, str]:
    # JAXCOMM_HOST_ID cleared: were it inherited, the test would not show detection.
    return {"JAXCOMM_TRANSPORT": "auto", "JAXCOMM_HOST_ID": "", "CHECK_OPS_HOSTS": str(hosts)}


def test_every_op_across_two_hosts_of_two_processes(cluster: VirtualCluster) -> None:
    """check_ops.py on 2 hosts x 2 processes: shared memory within a host, TCP across,
    hierarchical rounds; listeners on the job's interface; links chosen by host."""
    res = run_script(CHECK_OPS + REPORT, 4, 1, env=_env(2), timeout_s=240,
                     placement=cluster.placement(2))
    assert_ok(res)
    assert_every_op_checked(res, 4, 1, "hosts")
    reports = results(res, "REPORT")
    for rank in range(4):
        host = rank // 2
        r = reports[rank]
        assert r["hostname"] == cluster.hostnames[host], r
        # Bound to the job's interface only: not 0.0.0.0, not the default route's eth1.
        assert r["listen"] == [cluster.addresses[host]], r
        want = {str(q): "shm" if q // 2 == host else "tcp" for q in range(4) if q != rank}
        assert r["links"] == want, r


@pytest.mark.parametrize("cluster", [3], indirect=True)
def test_every_op_across_three_hosts(cluster: VirtualCluster) -> None:
    """check_ops.py on 3 hosts x 1 process x 2 devices: every link TCP, the large
    all_reduces as reduce-scatter then all-gather, each listener on its host's job address."""
    res = run_script(CHECK_OPS + REPORT, 3, 2, env=_env(3), timeout_s=240,
                     placement=cluster.placement(1))
    assert_ok(res)
    assert_every_op_checked(res, 3, 2, "tcp")
    for rank, r in results(res, "REPORT").items():
        assert r["hostname"] == cluster.hostnames[rank] and r["listen"] == [cluster.addresses[rank]], r
        assert set(r["links"].values()) == {"tcp"}, r


def _killed_job(cluster: VirtualCluster, transport: str) -> MPResult:
    return run_script("ELEMENTS = 65536\nALGORITHM = None\n" + KILLED_MID_COLLECTIVE, 2, 1,
                      env={**_env(2), "JAXCOMM_TRANSPORT": transport, "JAXCOMM_TIMEOUT_S": "60"},
                      timeout_s=120, grace_s=20, placement=cluster.placement(1))


def test_killed_host_is_named_by_its_name_and_job_address(cluster: VirtualCluster) -> None:
    """Process 1, alone on node1, dies mid-loop: process 0 on node0 names it by its host's
    name and job address, at once (its connection closed), not at the 60 s deadline."""
    res = _killed_job(cluster, "auto")
    assert res.returncode != 0
    out = res.output[0]
    assert "WARM" in out and "NO ERROR" not in out, res.format()
    line = next(l for l in out.splitlines() if "ERROR" in l)
    assert "timed out" not in line, line
    assert re.search(rf"process 1 \(host node1 \({re.escape(cluster.addresses[1])}\), pid \d+\) "
                     rf"with ranks \[1\]", line), line
    assert "connection closed" in line, line
    assert "jaxcomm.all_reduce over axis 'x'" in line, line


# Process 1's host drops off the network while process 0 waits for it in a collective: no
# connection closes, and process 0 names it at its deadline (8 s), long before JAX's
# heartbeat timeout (60 s here) would end the job. The test cuts the host between the
# first call and the second (files in CUT_DIR say when).
CUT_OFF = """
import time
mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("x",))
f = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"),
                          out_specs=P(), check_vma=False))
x = jax.device_put(np.ones((jax.device_count(),), np.float32), NamedSharding(mesh, P("x")))
f(x).block_until_ready()
open(os.path.join(os.environ["CUT_DIR"], f"warm{RANK}"), "w").close()
if RANK == 1:
    time.sleep(120)  # cut off meanwhile; the launcher ends it
    os._exit(0)
while not os.path.exists(os.path.join(os.environ["CUT_DIR"], "cut")):
    time.sleep(0.05)
start = time.monotonic()
try:
    f(x).block_until_ready()
    print("NO ERROR", flush=True)
except Exception as e:
    print("ELAPSED", time.monotonic() - start, flush=True)
    print("ERROR", str(e).replace("\\n", " "), flush=True)
os._exit(3)
"""


def test_host_cut_off_the_network_is_named_at_the_deadline(cluster: VirtualCluster,
                                                           tmp_path: pathlib.Path) -> None:
    def cut_when_warm() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all((tmp_path / f"warm{r}").exists() for r in range(2)):
                cluster.cut(1)
                (tmp_path / "cut").touch()
                return
            time.sleep(0.05)

    cutter = threading.Thread(target=cut_when_warm, daemon=True)
    cutter.start()
    res = run_script(CUT_OFF, 2, 1, env={**_env(2), "JAXCOMM_TRANSPORT": "auto", "JAXCOMM_TIMEOUT_S": "8",
                                         "JAXCOMM_HEARTBEAT_TIMEOUT_S": "60", "CUT_DIR": str(tmp_path)},
                     timeout_s=150, grace_s=5, placement=cluster.placement(1))
    cutter.join(1)
    out = res.output[0]
    assert (tmp_path / "cut").exists() and "NO ERROR" not in out, res.format()
    line = next(l for l in out.splitlines() if l.startswith("ERROR"))
    assert re.search(rf"timed out .* waiting for process 1 \(host node1 \({re.escape(cluster.addresses[1])}\), "
                     rf"pid \d+\) with ranks \[1\] \(partitions \[1\]\), which did not arrive at this call",
                     line), line


def _mpi() -> tuple[str, str] | None:
    """(mpiexec, this Python) where an MPI launcher is on PATH and mpi4py imports."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        return None
    ok = subprocess.run([sys.executable, "-c", "import mpi4py"], capture_output=True)
    return (mpiexec, sys.executable) if ok.returncode == 0 else None


@pytest.mark.skipif(_mpi() is None, reason="needs an MPI's mpiexec on PATH and mpi4py")
def test_mpi_launches_across_hosts(cluster: VirtualCluster) -> None:
    """An MPI job started on node0 runs ranks on both hosts (the ssh stand-in), and its
    collectives cross them: the helper the MPI transport's tests start from."""
    mpiexec, python = _mpi()
    # One write per line: the launcher forwards each rank's output as it reads it, and
    # print's several writes came out interleaved with another rank's under MPICH's Hydra.
    program = ("from mpi4py import MPI; import os, socket; c = MPI.COMM_WORLD; "
               "line = f'RANK {c.rank} {socket.gethostname()} {c.allreduce(c.rank + 1)}\\n'; "
               "os.write(1, line.encode())")
    res = subprocess.run([*cluster.mpiexec(mpiexec, 4, 2), python, "-c", program],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    ranks = sorted(l.split()[1:] for l in res.stdout.splitlines() if l.startswith("RANK"))
    assert ranks == [["0", "node0", "10"], ["1", "node0", "10"], ["2", "node1", "10"], ["3", "node1", "10"]], res.stdout


@pytest.mark.skipif(_mpi() is None, reason="needs an MPI's mpiexec on PATH and mpi4py")
@pytest.mark.xdist_group("mpi")
def test_mpi_transport_across_hosts(cluster: VirtualCluster) -> None:
    """jaxcomm's MPI transport between real hosts: 2 hosts x 2 processes started by
    mpiexec across the namespaces, no JAXCOMM_HOST_ID (the hosts are found by name), every
    op and MoE dispatch/combine against NumPy, and the hierarchical algorithm over shared
    memory within a host and MPI between them."""
    from mpi_util import format_output, run_mpi
    mpiexec, _ = _mpi()
    body = (pathlib.Path(__file__).parent / "multiprocess" / "check_ops.py").read_text() + """
print("ALGORITHMS", sorted({s.algorithm for s in jaxcomm.stats() if s.algorithm.startswith("hier")}), flush=True)
print("HOST", socket.gethostname(), flush=True)
"""
    code, out = run_mpi("import socket\n" + body, 4, env={**_env(2), "JAXCOMM_TRANSPORT": "mpi"},
                        timeout_s=300, launcher=cluster.mpiexec(mpiexec, 4, 2))
    assert code == 0, format_output(out)
    for rank in range(4):
        assert "ALL CHECKED" in out[rank], format_output(out)
        assert "CHECKED hierarchical" in out[rank], format_output(out)
        assert f"HOST {cluster.hostnames[rank // 2]}" in out[rank], format_output(out)
        assert "'hierarchical shm+mpi'" in out[rank], format_output(out)
