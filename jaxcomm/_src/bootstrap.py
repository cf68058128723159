"""The job's bootstrap: links this process to the other processes of a jax.distributed job.

A group whose ranks live in several processes moves data between them through jaxcomm's
own transports (ffi/cpu/transport/: World and the transports behind its interface):
shared memory between processes of one host, TCP between hosts. They are set up lazily,
when a program with such a group is first lowered (every process of the job lowers it),
only for the processes that program's groups reach, through the job's key-value store
(the jax.distributed coordination service): each process opens its transports and
publishes their endpoints once (:func:`transports` says which, with their settings: a
shared-memory control block, a TCP listener on an ephemeral port), and links each peer
it needs; the C++ side picks each link's transport (the first both ends opened that
reaches the peer).

Between hosts the job's links are TCP, or MPI when the job was started by an MPI launcher
and mpi4py imports (or ``JAXCOMM_TRANSPORT=mpi``; jaxcomm/_src/mpi.py).
``JAXCOMM_TRANSPORT=tcp`` makes every link TCP, so that the cross-host path runs on one
machine.

The TCP listener takes one address: the interface this host reaches the coordinator by
(the job's network), or ``JAXCOMM_TCP_ADDRESS``; and it admits only connections that
start with the job's secret (:func:`jaxcomm._src.distributed.job_secret`) and claim
another process of the job (ffi/cpu/transport/tcp_link.h, docs/multiprocess.md "Security").
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
from typing import Any, Iterable

import jax

from jaxcomm import _jaxcomm
from jaxcomm._src import config, mpi

_KEY = "jaxcomm/endpoint/{}"
_lock = threading.Lock()  # one bootstrap at a time (the links themselves live in C++)


@functools.cache
def machine_identity() -> str:
    """Names this machine: hostname, boot id and pid namespace (processes with the same
    string can see each other's pids and memory)."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id",):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            pass
    try:  # processes in different pid namespaces cannot open each other's /proc/<pid>/fd
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    return "/".join(parts)


def host_identity() -> str:
    """Names this host for the purpose of sharing memory: same string, same machine.

    ``JAXCOMM_HOST_ID`` replaces it: processes of one machine given different ids link
    through TCP (or MPI) as if on different hosts (how the tests exercise multi-host
    algorithms).
    """
    return config.host_id() or machine_identity()


def _reachable_address(coordinator: str | None) -> str:
    """An address of this host that the coordinator's host (and so the job) can reach."""
    if coordinator:
        host = coordinator.rsplit(":", 1)[0].strip("[]")
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, 9))  # no packet is sent: this only picks the route
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "jaxcomm: this program's groups span processes, but jax.distributed is not "
            "initialized in this process (call jaxcomm.init() or jax.distributed.initialize())")
    return client


def transports(me: int) -> list[tuple[str, dict[str, str]]]:
    """The transports process ``me`` opens, in the order of preference for a link, each with
    its settings (``{field: text}``, read by its C++ side: ffi/cpu/transport/factory.h).

    Example (two processes of one host, the default settings)::

        [name for name, _ in transports(0)]   # ['shm', 'tcp']
    """
    from jax._src import distributed

    from jaxcomm._src import distributed as jaxcomm_distributed

    opened: list[tuple[str, dict[str, str]]] = []
    if config.transport() != "tcp":
        opened.append(("shm", {}))
    if mpi.wanted():  # between hosts, MPI instead of TCP
        opened.append(("mpi", mpi.settings(machine_identity(), config.timeout_ms() / 1000, me,
                                           jax.process_count())))
        return opened
    listen = config.tcp_address() or _reachable_address(
        distributed.global_state.coordinator_address)
    opened.append(("tcp", dict(
        listen_address=listen, address=_published_address(listen),
        secret=jaxcomm_distributed.job_secret().hex(), processes=str(jax.process_count()),
        early_wait_ms=str(config.timeout_ms()))))
    return opened


def _published_address(listen: str) -> str:
    """The address peers connect to: where the listener listens, or, listening on every
    interface (asked for), one the job reaches."""
    if listen != "0.0.0.0":
        return listen
    from jax._src import distributed
    return _reachable_address(distributed.global_state.coordinator_address)


@functools.cache
def _endpoint() -> dict[str, Any]:
    """Opens this process's transports and publishes their endpoints through the key-value
    store: ``{"host", "hostname", "address", "pid", "transports": {name: endpoint}}``."""
    from jax._src import distributed

    me = jax.process_index()
    # With TCP forced, no two processes share memory: each is its own "host".
    host = f"tcp-only process {me}" if config.transport() == "tcp" else host_identity()
    address = _published_address(config.tcp_address() or _reachable_address(
        distributed.global_state.coordinator_address))
    hostname = socket.gethostname()
    endpoints = _jaxcomm.transport_open(me, host, f"{hostname} ({address})", transports(me))
    endpoint = dict(host=host, hostname=hostname, address=address, pid=os.getpid(),
                    transports=endpoints)
    # A restarted process (jaxcomm.ft.rejoin) replaces the endpoint of its previous life.
    _client().key_value_set(_KEY.format(me), json.dumps(endpoint), allow_overwrite=True)
    return endpoint


def _link(peer: int, theirs: dict[str, Any], timeout_ms: int, rejoining: bool = False) -> None:
    _jaxcomm.transport_link(peer, f"{theirs['hostname']} ({theirs['address']})", theirs["host"],
                            theirs["pid"], theirs["transports"], timeout_ms, rejoining=rejoining)


#: Peers that make up more than this share of the job have their endpoints listed from the
#: store in one request (then a read each only for those not published yet), instead of a
#: read each: a group that spans the job.
LIST_SHARE = 0.5


def _published(peers: list[int]) -> dict[int, str]:
    """The endpoints of ``peers`` already in the store, in one listing when they are most
    of the job (``LIST_SHARE``), else none (each is read on its own)."""
    if len(peers) <= LIST_SHARE * jax.process_count():
        return {}
    wanted = set(peers)
    found = {}
    for key, raw in _client().key_value_dir_get(_KEY.format("").rstrip("/")):
        index = key.rsplit("/", 1)[-1]
        if index.isdigit() and int(index) in wanted:
            found[int(index)] = raw
    return found


def ensure_linked(processes: Iterable[int]) -> None:
    """Links this process to each of ``processes`` (other than itself), once.

    Blocks until each peer has published its endpoint (it lowers the same program), at
    most the collective timeout (JAXCOMM_TIMEOUT_S). The peers of higher index come
    first: this process connects to those, and the others connect to it, so no process
    waits on one that itself waits (the links of a job are made at once, not one after
    another down the process indices).
    """
    me = jax.process_index()
    others = sorted(set(processes) - {me})
    wanted = [p for p in others if p > me] + [p for p in others if p < me]
    wanted = [p for p in wanted if not _jaxcomm.transport_linked(p)]
    if not wanted:
        return
    with _lock:
        _endpoint()
        timeout_ms = config.timeout_ms()
        published = _published(wanted)
        for peer in wanted:
            if _jaxcomm.transport_linked(peer):
                continue
            raw = published.get(peer)
            try:
                if raw is None:
                    raw = _client().blocking_key_value_get(_KEY.format(peer), timeout_ms)
            except Exception as e:  # the coordination service reports a timeout as an error
                raise RuntimeError(
                    f"jaxcomm: process {me} waited {timeout_ms / 1000:g} s for process {peer} "
                    f"to publish its endpoint (does it run the same program?): {e}") from e
            _link(peer, json.loads(raw), timeout_ms)


def rejoin(timeout_s: float | None = None) -> None:
    """Links a restarted process to every other process and marks it as rejoining.

    The request to be readmitted is posted by this process's first fault-tolerant call.
    Raises when another process cannot be reached (down as well): rejoining while other
    processes are down is not supported.
    """
    import time

    me = jax.process_index()
    timeout_ms = config.timeout_ms(timeout_s, "ft.rejoin")
    unreachable: list[str] = []
    with _lock:
        _endpoint()
        for peer in range(jax.process_count()):
            if peer == me or _jaxcomm.transport_linked(peer):
                continue
            theirs = json.loads(_client().blocking_key_value_get(_KEY.format(peer), timeout_ms))
            try:
                _link(peer, theirs, timeout_ms, rejoining=True)
            except RuntimeError as e:
                unreachable.append(f"process {peer}: {e}")
        if unreachable:
            raise RuntimeError(
                "jaxcomm.ft.rejoin: cannot reach every other process (rejoining while others "
                "are down is not supported): " + "; ".join(unreachable))
        _jaxcomm.transport_rejoin(time.time_ns())
