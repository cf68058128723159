"""Strangers and broken frames against a running TCP job (ffi/cpu/transport/tcp_link.h).

A 2-process job (``JAXCOMM_TRANSPORT=tcp``) runs all_reduces in a loop and checks every
result, while this test connects to both processes' listeners: garbage, a hello with the
wrong secret, a hello cut short, a flood of connections that say nothing, and, with the
job's secret (a process of the job gone wrong), frames with an impossible length, a
negative round number, and a frame cut short. The job's results stay exact, it
finishes, every stranger is refused at the hello (counted by the listener, logged once
per address and reason), and every bad frame closes its connection.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import struct
import threading
import time

import pytest

from jaxcomm import launch
from jaxcomm._src import distributed

HELLO_MAGIC = 0x6a63686c6c6f0002
N = 2
FLOOD = 150

WORKER = """
import json, os, time
import numpy as np
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxcomm
from jaxcomm import _jaxcomm
from jaxcomm._src import bootstrap

jaxcomm.init()
rank = jax.process_index()
mesh = jax.make_mesh((jax.device_count(),), ("x",))
f = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, "x", timeout_s=60), mesh=mesh,
                          in_specs=P("x"), out_specs=P("x")))
done_file = os.environ["DONE_FILE"]

def step(stop_flag):
    v = np.array([[1.0 + rank, 10.0 * rank, 3.0, stop_flag]], np.float32)
    y = np.asarray(f(jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("x")), v)).addressable_shards[0].data)[0]
    return y[:3].tolist() == [3.0, 10.0, 6.0], y[3] > 0

ok, _ = step(0.0)
print("PORT", rank, bootstrap._endpoint()["transports"]["tcp"]["port"], flush=True)
steps, bad, stop = 0, 0, False
deadline = time.time() + 120
while not stop:  # every process stops at the same step: the flag is all_reduced
    good, stop = step(float(os.path.exists(done_file) or time.time() > deadline))
    steps += 1
    bad += not good
print("RESULT", json.dumps({"steps": steps, "bad": bad, "first_ok": ok,
                            "refused": _jaxcomm.transport_refused()}), flush=True)
"""


class _Lines:
    """A text sink for the launcher's output: lines into a queue, as they come."""

    def __init__(self) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.all: list[str] = []

    def write(self, text: str) -> None:
        for line in text.splitlines():
            self.lines.put(line)
            self.all.append(line)

    def flush(self) -> None:
        pass


def _hello(secret: bytes, process: int, processes: int = N) -> bytes:
    return struct.pack("<QII32sqq", HELLO_MAGIC, 2, 0, secret, process, processes)


def _frame_header(key: int, seq: int, fingerprint: int, nbytes: int) -> bytes:
    return struct.pack("<QqQQ", key, seq, fingerprint, nbytes)


def _closed_by_peer(sock: socket.socket, within_s: float = 15.0) -> bool:
    """Whether the other end closes ``sock`` within ``within_s``."""
    sock.settimeout(within_s)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def test_intruders_are_refused_and_the_job_is_undisturbed(tmp_path) -> None:
    secret = distributed.new_job_secret()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    done = tmp_path / "done"
    sink = _Lines()
    env = dict(os.environ, JAXCOMM_TRANSPORT="tcp", JAX_PLATFORMS="cpu", DONE_FILE=str(done),
               JAXCOMM_JOB_SECRET=secret)
    result: list[launch.LaunchResult] = []
    job = threading.Thread(target=lambda: result.append(launch.launch(
        [str(script)], N, env=env, stdout=sink, stderr=sink, timeout_s=200, cwd=str(tmp_path))))
    job.start()
    try:
        ports: dict[int, int] = {}
        deadline = time.monotonic() + 120
        while len(ports) < N and time.monotonic() < deadline:
            try:
                line = sink.lines.get(timeout=1)
            except queue.Empty:
                continue
            if " PORT " in line:  # "[r] PORT r port"
                _, _, rank, port = line.split()[:4]
                ports[int(rank)] = int(port)
        assert len(ports) == N, "\n".join(sink.all)
        secret_bytes = bytes.fromhex(secret)
        # The listener takes the job's interface only (here: loopback), not every one.
        with open("/proc/net/tcp") as f:
            listening = {int(cols[1].split(":")[1], 16): cols[1].split(":")[0]
                         for cols in (l.split() for l in f.readlines()[1:]) if cols[3] == "0A"}
        for port in ports.values():
            assert listening.get(port) == "0100007F", (port, listening.get(port))

        closed: dict[str, bool] = {}
        floods: dict[int, list[socket.socket]] = {}
        for rank, port in ports.items():
            other = 1 - rank
            # Strangers: refused at the hello.
            s = _connect(port)
            s.sendall(os.urandom(64))
            closed[f"garbage->{rank}"] = _closed_by_peer(s)
            s = _connect(port)
            s.sendall(_hello(os.urandom(32), other))
            closed[f"wrong secret->{rank}"] = _closed_by_peer(s)
            s = _connect(port)
            s.sendall(_hello(secret_bytes, other)[:20])
            s.close()
            s = _connect(port)
            s.sendall(_hello(secret_bytes, 7))  # not a process of this 2-process job
            closed[f"process 7->{rank}"] = _closed_by_peer(s)
            # With the secret: every bad frame closes its connection, nothing else.
            s = _connect(port)
            s.sendall(_hello(secret_bytes, other) + _frame_header(1, 1, 0, 1 << 62))
            closed[f"2^62 bytes->{rank}"] = _closed_by_peer(s)
            s = _connect(port)
            s.sendall(_hello(secret_bytes, other) + _frame_header(1, -5, 0, 8) + b"x" * 8)
            closed[f"negative round->{rank}"] = _closed_by_peer(s)
            s = _connect(port)
            s.sendall(_hello(secret_bytes, other) + _frame_header(2, 1, 0, 1000) + b"x" * 10)
            s.close()
            # A flood of connections that say nothing (more than the listener keeps).
            floods[rank] = [_connect(port) for _ in range(FLOOD)]
        # Both floods at once: each connection is closed by the time the listener's
        # wait for a hello (5 s, tcp_link.h kHelloTimeout) is over, or soon after.
        for rank, flood in floods.items():
            closed[f"flood->{rank}"] = all(_closed_by_peer(s, 15) for s in flood)
            for s in flood:
                s.close()
        done.write_text("x")
        job.join(180)
        assert not job.is_alive(), "the job did not finish"
    finally:
        done.write_text("x")
        job.join(60)
    res = result[0]
    output = "\n".join(sink.all)
    assert res.returncode == 0, output
    assert all(closed.values()), (closed, output)
    results = {}
    for line in sink.all:
        if " RESULT " in line:
            rank = int(line.split("]", 1)[0].lstrip("["))
            results[rank] = json.loads(line.split(" RESULT ", 1)[1])
    assert sorted(results) == list(range(N)), output
    for rank, r in results.items():
        assert r["first_ok"] and r["bad"] == 0 and r["steps"] > 0, (rank, r)
        # garbage, wrong secret, a cut hello, process 7, and the flood: all at the hello.
        assert r["refused"] >= 4 + FLOOD, (rank, r)
    # Each refusal is logged once per address and reason, then counted.
    for rank in range(N):
        logged = [l for l in sink.all if l.startswith(f"[{rank}] jaxcomm: refused a TCP connection")]
        assert 4 <= len(logged) <= 16, logged


ADDRESS_WORKER = """
import socket
import numpy as np
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxcomm
from jaxcomm._src import bootstrap

def listening_address(port):  # the address a listener on `port` of this host is bound to
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            addr, p = cols[1].split(":")
            if cols[3] == "0A" and int(p, 16) == port:
                return socket.inet_ntoa(bytes.fromhex(addr)[::-1])

jaxcomm.init()
mesh = jax.make_mesh((jax.device_count(),), ("x",))
f = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"),
                          out_specs=P("x")))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                           np.full((1, 2), 1.0 + jax.process_index(), np.float32))
y = np.asarray(f(x).addressable_shards[0].data)
e = bootstrap._endpoint()["transports"]["tcp"]
print("ENDPOINT", e["address"], listening_address(int(e["port"])), y.tolist(), flush=True)
"""


def test_listener_takes_the_address_it_is_given(tmp_path) -> None:
    """JAXCOMM_TCP_ADDRESS names the interface: the listener binds it, and only it, and
    the peers connect to it (127.0.0.2: another address of this host's loopback)."""
    script = tmp_path / "worker.py"
    script.write_text(ADDRESS_WORKER)
    env = dict(os.environ, JAXCOMM_TRANSPORT="tcp", JAX_PLATFORMS="cpu",
               JAXCOMM_TCP_ADDRESS="127.0.0.2", JAXCOMM_TIMEOUT_S="60")
    res = launch.launch([str(script)], N, env=env, capture=True, timeout_s=120,
                        cwd=str(tmp_path))
    assert res.returncode == 0, res.format()
    for rank in range(N):
        (line,) = [l for l in res.output(rank).splitlines() if l.startswith("ENDPOINT ")]
        assert line == "ENDPOINT 127.0.0.2 127.0.0.2 [[3.0, 3.0]]", res.format()
