"""Strangers and broken frames against a running TCP job (ffi/cpu/transport/tcp_link.h).

A 2-process job (``JAXCOMM_TRANSPORT=tcp``) runs all_reduces in a loop and checks every
result, while this test connects to both processes' listeners: garbage, a hello with the
wrong secret, a hello cut short, a flood of connections that say nothing, and, with the
job's secret (a process of the job gone wrong), frames with an impossible length, a
negative round number, a frame cut short, and a frame over the budget for frames of calls
not reached yet (left unread). The job's results stay exact, it
finishes, every stranger is refused at the hello (counted by the listener, logged once
per address and reason), and every bad frame closes its connection.
"""

from __future__ import annotations

import json
import os
import queue
import re
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
#: The early-frame budget (ffi/cpu/transport/tcp_link.cc EarlyBudget: at most 256 MiB and
#: at most JAXCOMM_COMM_MEMORY_MB), set low to keep the tests' memory small, and a frame
#: over it that fits in memory.
COMM_MEMORY_MB = 64
EARLY_MIB = 96

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


def _bytes_taken(sock: socket.socket, limit: int, within_s: float) -> int:
    """How many bytes (up to ``limit``) the other end lets ``sock`` send within
    ``within_s``: the socket buffers' worth when it reads nothing."""
    sock.setblocking(False)
    chunk, sent = b"\0" * (1 << 20), 0
    deadline = time.monotonic() + within_s
    while sent < limit and time.monotonic() < deadline:
        try:
            sent += sock.send(chunk[:limit - sent])
        except BlockingIOError:
            time.sleep(0.01)
    return sent


def test_intruders_are_refused_and_the_job_is_undisturbed(tmp_path) -> None:
    secret = distributed.new_job_secret()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    done = tmp_path / "done"
    sink = _Lines()
    env = dict(os.environ, JAXCOMM_TRANSPORT="tcp", JAX_PLATFORMS="cpu", DONE_FILE=str(done),
               JAXCOMM_JOB_SECRET=secret, JAXCOMM_COMM_MEMORY_MB=str(COMM_MEMORY_MB))
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
        early: dict[int, int] = {}
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
            s.shutdown(socket.SHUT_WR)
            # Seen closed before the next connection: the listener keeps one connection per
            # process it holds (the latest), so one it took after the next would replace it.
            closed[f"cut frame->{rank}"] = _closed_by_peer(s)
            # With the secret, a frame that fits this machine's memory but not the budget
            # for frames of calls the process has not reached (COMM_MEMORY_MB): left unread
            # (so never allocated) while it waits for its call; the sender's send stalls
            # once the socket buffers are full.
            s = _connect(port)
            s.sendall(_hello(secret_bytes, other) + _frame_header(0x5EED, 1, 0, EARLY_MIB << 20))
            early[rank] = _bytes_taken(s, EARLY_MIB << 20, within_s=4)
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
    # The early frame over the budget: at most the socket buffers' worth taken (here at
    # most 32 MiB received and 4 MiB sent, net.ipv4.tcp_rmem and tcp_wmem), not 96 MiB.
    assert all(taken < (EARLY_MIB << 20) // 2 for taken in early.values()), early
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


# Process 1 runs a ppermute to process 0 whose frame (96 MiB) is over the early-frame
# budget (64 MiB: JAXCOMM_COMM_MEMORY_MB) while process 0, waiting in Python, has not
# reached the call. Process 0 must leave the frame unread and allocate nothing for it:
# process 1's send waits until its call's deadline, then fails naming process 0; process
# 0's link gives up when its own wait for the call (the job's JAXCOMM_TIMEOUT_S) ends, and
# its next call fails naming process 1 and the budget.
SEND_S = 3      # process 1's deadline for the oversized call
EARLY_S = 6     # JAXCOMM_TIMEOUT_S: how long process 0 keeps an early frame waiting
EARLY_WORKER = f"""
import json, time
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxcomm
from jaxcomm._src import distributed
from jaxcomm.trace import causes

def peak_rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024

jaxcomm.init()
rank = jax.process_index()
kv = distributed.kv_client()
mesh = jax.make_mesh((2,), ("x",))
smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
small = smap(lambda v: jaxcomm.all_reduce(v, "x", timeout_s=60))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), np.ones((1, 4), np.float32))
jax.block_until_ready(small(x))  # linked, and every buffer of a small call allocated
n = ({EARLY_MIB} << 20) // 4

def timed(tag, program):  # prints how long program(x) took, and its error
    start = time.monotonic()
    try:
        jax.block_until_ready(program(x))
        error = None
    except Exception as e:
        error = causes.clean(str(e))
    print(tag, json.dumps({{"elapsed": time.monotonic() - start, "error": error}}), flush=True)

if rank == 1:
    timed("SENDER", smap(lambda v: jaxcomm.ppermute(jnp.broadcast_to(v[:, :1], (1, n)), "x", [(1, 0)],
                                                     timeout_s={SEND_S})))
    kv.key_value_set("early/sent", "1")
else:
    before = peak_rss_mib()
    kv.blocking_key_value_get("early/sent", 120_000)
    after = peak_rss_mib()
    print("RECEIVER", json.dumps({{"before_mib": before, "after_mib": after}}), flush=True)
    kv.key_value_set("early/measured", "1")
kv.blocking_key_value_get("early/measured", 120_000)
timed("NEXT", small)
"""


def test_an_early_frame_over_the_budget_is_left_unread(tmp_path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(EARLY_WORKER)
    env = dict(os.environ, JAXCOMM_TRANSPORT="tcp", JAX_PLATFORMS="cpu",
               JAXCOMM_TIMEOUT_S=str(EARLY_S), JAXCOMM_COMM_MEMORY_MB=str(COMM_MEMORY_MB))
    res = launch.launch([str(script)], N, env=env, capture=True, timeout_s=180, grace_s=30,
                        cwd=str(tmp_path))
    out = res.format()

    def tagged(rank: int, tag: str) -> dict:
        line = next((l for l in res.output(rank).splitlines() if l.startswith(tag + " ")), None)
        assert line is not None, out
        return json.loads(line[len(tag) + 1:])

    sender, receiver = tagged(1, "SENDER"), tagged(0, "RECEIVER")
    # The receiver neither read nor allocated the frame: its peak memory did not grow by
    # anything near the frame's size.
    assert receiver["after_mib"] - receiver["before_mib"] < EARLY_MIB / 4, (receiver, out)
    # The sender's send waited (the receiver read nothing) until its call's deadline, and
    # the call failed then, naming the peer.
    assert sender["error"] is not None and sender["elapsed"] >= SEND_S, (sender, out)
    assert "jaxcomm.ppermute over axis 'x'" in sender["error"], sender
    assert re.search(r"sending to process 0 \(host \S+ \(127\.0\.0\.1\), pid \d+\) with ranks \[0\]",
                     sender["error"]), sender
    assert "timed out sending (the peer does not read)" in sender["error"], sender
    # The receiver's link to it gave up on the frame, naming the sender and the budget.
    following = tagged(0, "NEXT")
    assert following["error"] is not None, (following, out)
    assert re.search(r"process 1 \(host \S+ \(127\.0\.0\.1\), pid \d+\) with ranks \[1\]",
                     following["error"]), following
    assert (f"the peer sent {EARLY_MIB << 20} bytes for round 1 of call " in following["error"]
            and f"beyond its budget for early frames ({COMM_MEMORY_MB << 20} bytes, "
            "JAXCOMM_COMM_MEMORY_MB)" in following["error"]), following
