"""Start-up of a multi-process job, jaxcomm against jax's own: ``python -m jaxcomm.bench startup``.

    python -m jaxcomm.bench startup --processes 2,4,8,16,32,64 [--mesh 1d,3d]
                                    [--transport auto|tcp] [--repeat 1] [--json out.json]

Each job of N processes (:mod:`jaxcomm.launch`, one CPU device a process) runs one side:

* ``jaxcomm``: :func:`jaxcomm.init`, then a program of ``jaxcomm.all_reduce`` over the
  mesh's axes, lowered, compiled and run twice;
* ``gloo``: the same :func:`jaxcomm.init` (which is ``jax.distributed.initialize`` with
  the launcher's coordination service, and gloo chosen for XLA:CPU's collectives; it opens
  no jaxcomm transport), then the same program with ``jax.lax.psum``.

Meshes: ``1d`` (one axis over every process: one group of N) and ``3d`` (N as a x b x c,
as even as it goes, an all_reduce over each axis in turn: 3 groups per process, N/a + N/b
+ N/c groups in the job). The sides take turns job by job (jaxcomm, gloo, then gloo,
jaxcomm with ``--repeat 2``...).

Per process it records: the seconds of ``init()``, of lowering (where jaxcomm links the
peers of the program's groups), compiling, the first and the second call; jaxcomm's
key-value store operations (counted around the bootstrap's client; gloo's rendezvous
reaches the store from C++, where they cannot be counted); its TCP connections (the
kernel's table of established sockets this process holds, less the one to the
coordination service) and jaxcomm's shared-memory links; and :func:`jaxcomm.memory`.
The table gives, per job, the slowest process's figures (start-up is as slow as the last
process) and the mean and largest counts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import socket
import statistics
import sys
import time
from typing import Any, Sequence

from jaxcomm.bench import method

SIDES = ("jaxcomm", "gloo")
#: Key-value reads each process times, all at once, after its start-up.
KV_PROBES = 200
_TAG = "STARTUP "


def mesh_shape(n: int, kind: str) -> tuple[int, ...]:
    """``(n,)`` for "1d"; for "3d", a x b x c = n with a >= b >= c as close as they go.

    Example: ``mesh_shape(64, "3d") == (4, 4, 4)``, ``mesh_shape(32, "3d") == (4, 4, 2)``.
    """
    if kind == "1d":
        return (n,)
    if kind != "3d":
        raise ValueError(f"mesh must be 1d or 3d, got {kind!r}")
    best = (n, 1, 1)
    for c in range(1, n + 1):
        for b in range(c, n + 1):
            if n % (b * c) == 0 and n // (b * c) >= b:
                shape = (n // (b * c), b, c)
                if max(shape) - min(shape) < max(best) - min(best):
                    best = shape
    return best


# ------------------------------------------------------------------------------ worker

class _CountingClient:
    """The coordination service's client, counting what jaxcomm's bootstrap asks of it."""

    def __init__(self, client: Any, counts: dict[str, int]) -> None:
        self._client, self._counts = client, counts

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._counts[name] = self._counts.get(name, 0) + 1
            return attr(*args, **kwargs)
        return counted


def _count_kv(counts: dict[str, int]) -> None:
    """Counts the key-value operations of jaxcomm's bootstrap (jaxcomm._src.bootstrap and
    .distributed reach the client only through these two functions). jax's own use of the
    client (gloo's rendezvous, in C++) is not seen here: the keys it leaves are counted."""
    from jaxcomm._src import bootstrap as transport, distributed

    real_kv = distributed.kv_client
    real_client = transport._client

    def kv_client() -> Any:
        c = real_kv()
        return None if c is None else _CountingClient(c, counts)

    distributed.kv_client = kv_client
    transport._client = lambda: _CountingClient(real_client(), counts)


def _time_linking(spent: dict[str, float]) -> None:
    """Adds the seconds jaxcomm's bootstrap spends linking peers (within lowering) to
    ``spent["link_s"]``: the endpoint, the key-value reads, the links themselves."""
    from jaxcomm._src import bootstrap as transport

    real = transport.ensure_linked

    def ensure_linked(processes: Any) -> None:
        t0 = time.perf_counter()
        try:
            real(processes)
        finally:
            spent["link_s"] = spent.get("link_s", 0.0) + time.perf_counter() - t0

    transport.ensure_linked = ensure_linked


def _socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def tcp_connections(exclude_port: int) -> int:
    """Established TCP connections this process holds, less those to or from
    ``exclude_port`` (the coordination service's)."""
    mine = _socket_inodes()
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            if state != "01" or inode not in mine:  # 01: ESTABLISHED
                continue
            ports = {int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)}
            if exclude_port not in ports:
                count += 1
    return count


def worker(side: str, mesh_kind: str) -> None:
    """One process of a job: times its start-up and prints one ``STARTUP {json}`` line."""
    t: dict[str, float] = {}
    kv: dict[str, int] = {}
    import numpy as np
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxcomm
    from jaxcomm._src import distributed

    _count_kv(kv)
    spent: dict[str, float] = {}
    _time_linking(spent)
    t["init0"] = time.time()
    jaxcomm.init()
    t["init1"] = time.time()
    n = jax.process_count()
    shape = mesh_shape(n * jax.local_device_count(), mesh_kind)
    names = ("x",) if len(shape) == 1 else ("a", "b", "c")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(shape), names)
    reduce = jaxcomm.all_reduce if side == "jaxcomm" else jax.lax.psum

    def body(v: Any) -> Any:
        for axis in names:
            v = reduce(v, axis)
        return v

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=P(names),
                              check_vma=False))
    # Not device_put: from host data it checks that every process holds the same value,
    # with an XLA collective (gloo), which would link gloo in jaxcomm's jobs too.
    ones = np.ones((mesh.size * 4,), np.float32)
    x = jax.make_array_from_callback(ones.shape, NamedSharding(mesh, P(names)), lambda i: ones[i])
    t["lower0"] = time.time()
    lowered = f.lower(x)
    t["lower1"] = time.time()
    compiled = lowered.compile()
    t["compile1"] = time.time()
    out = compiled(x)
    out.block_until_ready()
    t["first1"] = time.time()
    compiled(x).block_until_ready()
    t["second1"] = time.time()
    want = float(mesh.size)
    got = float(np.asarray(out.addressable_shards[0].data)[0])
    if got != want:
        raise AssertionError(f"{side} all_reduce over {shape}: got {got}, want {want}")
    port = int(os.environ[distributed.ENV_COORDINATOR].rsplit(":", 1)[1])
    record: dict[str, Any] = dict(
        process=jax.process_index(), side=side, mesh=mesh_kind, shape=list(shape),
        init_s=t["init1"] - t["init0"], lower_s=t["lower1"] - t["lower0"],
        compile_s=t["compile1"] - t["lower1"], first_s=t["first1"] - t["compile1"],
        second_s=t["second1"] - t["first1"], link_s=spent.get("link_s", 0.0), t=t, kv=dict(kv),
        tcp=tcp_connections(port), max_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if side == "jaxcomm":
        from jaxcomm import _jaxcomm
        kinds = [_jaxcomm.transport_kind(q) for q in range(n) if q != jax.process_index()]
        record["links"] = {k: kinds.count(k) for k in set(kinds) if k}
        if hasattr(jaxcomm, "memory"):
            record["memory"] = jaxcomm.memory().as_dict()
    client = distributed.kv_client()
    # The coordination service's cost per operation, every process asking at once: the
    # model of docs/multiprocess.md extrapolates from it.
    mine = f"jaxcomm_bench/kv/{jax.process_index()}"
    client.key_value_set(mine, "x" * 200)
    client.wait_at_barrier("jaxcomm_bench_startup_counted", 600_000)
    t0 = time.time()
    for _ in range(KV_PROBES):
        client.blocking_key_value_get(mine, 60_000)
    record["kv_get_s"] = (time.time() - t0) / KV_PROBES
    record["kv_t"] = [t0, time.time()]
    client.wait_at_barrier("jaxcomm_bench_startup_probed", 600_000)
    print(_TAG + json.dumps(record), flush=True)


# ------------------------------------------------------------------------------ driver

def run_job(side: str, mesh_kind: str, n: int, transport: str,
            timeout_s: float) -> list[dict[str, Any]]:
    """One job of ``n`` processes of ``side``; each process's record."""
    from jaxcomm import launch

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXCOMM_TRANSPORT": transport,
           "JAXCOMM_INIT_TIMEOUT_S": str(int(timeout_s)), "JAXCOMM_TIMEOUT_S": str(int(timeout_s))}
    res = launch.launch(["jaxcomm.bench.startup", "--worker", side, "--mesh", mesh_kind], n,
                        module=True, env=env, capture=True, timeout_s=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"{side} job of {n} processes ({mesh_kind}) failed "
                           f"({res.returncode}):\n{res.format()[-4000:]}")
    records = []
    for rank in range(n):
        for line in res.output(rank, "stdout").splitlines():
            if line.startswith(_TAG):
                records.append(json.loads(line[len(_TAG):]))
    return records


def summarize(records: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """A job's row: the slowest process's seconds, mean and largest counts."""
    def worst(key: str) -> float:
        return max(r[key] for r in records)

    # From the moment the last process entered init() (all had imported jax) to the last
    # first result: the job's start-up, as its slowest process sees it.
    start = max(r["t"]["init0"] for r in records)
    first = max(r["t"]["first1"] for r in records)
    kv_ops = [sum(r["kv"].values()) for r in records]
    tcp = [r["tcp"] for r in records]
    shm = [r.get("links", {}).get("shm", 0) for r in records]
    row = dict(processes=n, side=records[0]["side"], mesh=records[0]["mesh"],
               shape=records[0]["shape"], startup_s=first - start, init_s=worst("init_s"),
               lower_s=worst("lower_s"), compile_s=worst("compile_s"), first_s=worst("first_s"),
               second_s=worst("second_s"), link_s=worst("link_s"), kv_ops_mean=statistics.fmean(kv_ops),
               kv_ops_max=max(kv_ops), tcp_mean=statistics.fmean(tcp), tcp_max=max(tcp),
               shm_mean=statistics.fmean(shm), shm_max=max(shm))
    # The service's throughput with every process asking: reads over the probes' span.
    span = max(r["kv_t"][1] for r in records) - min(r["kv_t"][0] for r in records)
    row["kv_get_s"] = statistics.median(r["kv_get_s"] for r in records)
    row["kv_ops_per_s"] = len(records) * KV_PROBES / span
    row["max_rss_mib"] = max(r["max_rss_mib"] for r in records)
    mem = [r["memory"]["total"] for r in records if "memory" in r]
    if mem:
        row["memory_mean"] = statistics.fmean(mem)
        row["memory_max"] = max(mem)
    return row


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = ("| processes | mesh | side | start-up s | init s | lower s | compile s | 1st call s "
            "| 2nd call s | of lower: linking s | jaxcomm KV ops/process | TCP conns/process (max) "
            "| shm links/process (max) | jaxcomm memory/process (max) | KV get ms, all asking "
            "| service gets/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        mem = f"{r['memory_max'] / 1024:.0f} KiB" if "memory_max" in r else "-"
        kv = f"{r['kv_ops_mean']:.1f} ({r['kv_ops_max']})" if r["side"] == "jaxcomm" else "-"
        lines.append(
            f"| {r['processes']} | {r['mesh']} {'x'.join(map(str, r['shape']))} | {r['side']} "
            f"| {r['startup_s']:.2f} | {r['init_s']:.2f} | {r['lower_s']:.2f} | {r['compile_s']:.2f} "
            f"| {r['first_s']:.3f} | {r['second_s']:.4f} | {r['link_s']:.3f} | {kv} "
            f"| {r['tcp_mean']:.1f} ({r['tcp_max']}) | {r['shm_mean']:.1f} ({r['shm_max']}) | {mem} "
            f"| {r['kv_get_s'] * 1e3:.2f} | {r['kv_ops_per_s']:.0f} |")
    return "\n".join(lines)


def caption() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {socket.gethostname()}, {cpu}, "
            f"{os.cpu_count()} cores, load average {method.load_average()}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxcomm.bench startup",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", default="2,4,8", help="comma list of job sizes (default %(default)s)")
    p.add_argument("--mesh", default="1d,3d", help="1d, 3d or both (default %(default)s)")
    p.add_argument("--sides", default=",".join(SIDES), help="jaxcomm, gloo or both")
    p.add_argument("--transport", default="auto", choices=("auto", "tcp"),
                   help="JAXCOMM_TRANSPORT of the jaxcomm side (default %(default)s)")
    p.add_argument("--repeat", type=int, default=1, help="jobs per side and size, alternated")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job")
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--worker", default=None, choices=SIDES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.mesh)
        return 0
    sides = [s for s in args.sides.split(",") if s]
    rows = []
    print(caption(), flush=True)
    for n in [int(s) for s in args.processes.split(",")]:
        for mesh_kind in args.mesh.split(","):
            for i in range(args.repeat):
                for side in (sides if i % 2 == 0 else sides[::-1]):
                    row = summarize(run_job(side, mesh_kind, n, args.transport, args.timeout), n)
                    row["transport"] = args.transport if side == "jaxcomm" else "gloo"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(caption())
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
