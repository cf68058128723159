"""Collectives across processes, jaxcomm against its peers: ``python -m jaxcomm.bench --processes N``.

    python -m jaxcomm.bench --processes 2 [--sizes 4B,4KiB,1MiB,16MiB] [--bind both]
    python -m jaxcomm.bench --processes 2 --latency          # all_reduce, 4 B to 4 KiB
    python -m jaxcomm.bench --processes 4 --hosts 2          # 2 played hosts of 2 processes

Every side runs in the same processes, on the same inputs, in programs of the same shape
(``jit`` of a ``lax.fori_loop`` of n collectives whose carry is the previous result), and
is measured by the method of :mod:`jaxcomm.bench.method` (:func:`jaxcomm.bench.measure.measure`):
loops of several lengths n, fitted as ``a + b * n`` (``b`` per collective, ``a`` fixed
per call), the sides taking turns in alternating order, medians over the rounds. The
sides:

* ``jaxcomm``: jaxcomm's collective in ``jit(shard_map(...))`` over a mesh of every device
  of the job;
* ``gloo``: ``jax.lax``'s collective in the same program (XLA:CPU's own, gloo over TCP);
* ``mpi4jax``: mpi4jax's in a process-local ``jit`` (its ordered effects allow one device
  per program), when ``mpirun`` and mpi4jax are installed (``pip install mpi4py
  mpi4jax`` with an MPI such as Open MPI); the job is then started by ``mpirun`` instead
  of :mod:`jaxcomm.launch`, so all sides share its processes and their placement;
* ``plain``: the same ``jit(shard_map(...))`` loop with an elementwise op in place of the
  collective: the fixed cost per call of a plain jit, to compare ``a`` with.

Each timed call starts after a barrier, and lasts from the last process's dispatch to the
last process's result (the processes share one clock). ``--bind cores`` gives each
process its own share of the cores (``mpirun --bind-to core``, ``jaxcomm.launch --bind
cores``), ``--bind none`` lets the scheduler place them, ``--bind both`` (default) runs
both placements, each in its own job; the tables say which. ``--hosts H`` has the
processes play H hosts (``JAXCOMM_HOST_ID``: shared memory within each, TCP across);
under ``mpirun`` (mpi4jax installed) it runs two jobs, one with jaxcomm's MPI transport
between the hosts (``JAXCOMM_TRANSPORT=mpi``), one with its TCP transport
(``JAXCOMM_TRANSPORT=shm+tcp``), each with gloo, mpi4jax and the plain jit.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable, Sequence

from jaxcomm.bench import common, measure, method, options, report

#: The ops mpi4jax has a counterpart of.
MPI4JAX_OPS = ("all_reduce", "all_gather", "all_to_all", "ppermute")


def mpi4jax_missing() -> str:
    """Why the mpi4jax side cannot run here, or ""."""
    if shutil.which("mpirun") is None:
        return "no mpirun on PATH"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed"
    if importlib.util.find_spec("mpi4jax") is None:
        return "mpi4jax is not installed"
    return ""


# -------------------------------------------------------------------- keeping in step

class MPISync:
    """Barriers and all-gathers through MPI (the job was started by mpirun)."""

    def __init__(self) -> None:
        from mpi4py import MPI
        self.comm = MPI.COMM_WORLD

    def barrier(self) -> None:
        self.comm.Barrier()

    def all_gather(self, value: Any) -> list[Any]:
        return self.comm.allgather(value)


class KVSync:
    """Barriers and all-gathers through jax.distributed's key-value store (the job was
    started by jaxcomm.launch). Every wait for another process is bounded by ``timeout_s``.
    """

    def __init__(self, timeout_s: float, prefix: str = "jaxcomm/bench") -> None:
        import jax
        from jaxcomm._src import distributed
        self.client = distributed.kv_client()
        if self.client is None:
            raise RuntimeError("KVSync needs jax.distributed to be initialized "
                               "(call jaxcomm.init() first)")
        self.rank = jax.process_index()
        self.n = jax.process_count()
        self.timeout_s = timeout_s
        self.prefix = prefix
        self.step = 0

    def all_gather(self, value: Any) -> list[Any]:
        """``value`` of every process, by rank (a JSON-serialisable value)."""
        key = f"{self.prefix}/{self.step}"
        self.step += 1
        self.client.key_value_set(f"{key}/{self.rank}", json.dumps(value))
        values = []
        for r in range(self.n):
            try:
                raw = self.client.blocking_key_value_get(f"{key}/{r}", int(self.timeout_s * 1000))
            except Exception as exc:
                raise RuntimeError(f"benchmark: rank {r} did not reach step {self.step - 1} "
                                   f"within {self.timeout_s:g} s (died or stuck?): {exc}") from exc
            values.append(json.loads(raw))
        return values

    def barrier(self) -> None:
        self.all_gather(None)


# ------------------------------------------------------------------------------ worker

def _mpi4jax_collectives(n: int) -> dict[str, Callable]:
    """mpi4jax's counterparts, on a process's local operand."""
    import mpi4jax
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    return {
        "all_reduce": lambda c, n: mpi4jax.allreduce(c, op=MPI.SUM, comm=comm),
        "all_gather": lambda c, n: mpi4jax.allgather(c, comm=comm).reshape(-1),
        "all_to_all": lambda c, n: mpi4jax.alltoall(c.reshape(n, -1), comm=comm).reshape(-1),
        "ppermute": lambda c, n: mpi4jax.sendrecv(c, c, source=(rank - 1) % n, dest=(rank + 1) % n,
                                                  comm=comm),
    }


def _sides(args: argparse.Namespace) -> list[str]:
    sides = ["jaxcomm"] + (["gloo"] if args.gloo else [])
    if args.launcher == "mpi":
        sides.append("mpi4jax")
    sides.append("plain")
    return sides


def worker(args: argparse.Namespace) -> int:
    """One process of the job: joins it, measures every case, process 0 writes records."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np
    import jaxcomm
    if args.launcher == "jaxcomm" and not jaxcomm.init():
        print("jaxcomm.bench --worker must run under jaxcomm.launch", file=sys.stderr)
        return 2
    if args.launcher == "mpi":
        jaxcomm.init()
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxcomm.bench import collectives as col

    rank, procs = jax.process_index(), jax.process_count()
    if args.hosts > 1:
        # Read when the first program is lowered (jaxcomm/_src/bootstrap.py).
        os.environ["JAXCOMM_HOST_ID"] = f"bench-host-{rank * args.hosts // procs}"
    sync: Any = MPISync() if args.launcher == "mpi" else KVSync(timeout_s=2 * args.timeout + 120)
    mesh = jax.make_mesh((len(jax.devices()),), (col.AXIS,))
    n = mesh.size
    local_devices = len(jax.local_devices())
    dtype = np.dtype(jnp.dtype(args.dtype))
    sides = _sides(args)
    steps = {"mesh": col.mesh_steps(mesh),
             "local": lambda m: jax.device_put(np.int32(m), jax.local_devices()[0])}
    by_side: dict[str, dict[str, Callable]] = {
        "jaxcomm": {op: (lambda c, n, spec=spec: spec.jaxcomm(c, n, args.timeout))
                    for op, spec in col.OPS.items()},
        "gloo": {op: spec.xla for op, spec in col.OPS.items()},
        "plain": {op: col.plain_step for op in col.OPS}}
    if "mpi4jax" in sides:
        by_side["mpi4jax"] = _mpi4jax_collectives(n)
    tol = col.tolerance(dtype)
    rtol, atol = tol if tol is not None else (0.0, 0.0)

    def compare(a: Any, b: Any) -> bool:
        return a.shape == b.shape and bool(np.allclose(a, b, rtol=rtol, atol=atol))
    records = []
    notes: list[str] = []
    cases = col.plan(options.op_list(args), common.parse_sizes(args.sizes, args.factor), n,
                     dtype.itemsize, notes)
    for note in notes if rank == 0 else ():
        print(f"note: {note}", file=sys.stderr, flush=True)
    with common.ProgressDisplay(len(cases), title=f"{procs} processes",
                                enabled=args.progress and rank == 0) as bar:
        for op, nbytes, count in cases:
            bar.step(f"{op} {common.format_bytes(nbytes)}")
            elems = col.OPS[op].in_elems(count, n)
            first = rank * local_devices
            local = np.concatenate([((np.arange(elems) + first + d) % 4).astype(dtype)
                                    for d in range(local_devices)])
            x_global = jax.make_array_from_process_local_data(NamedSharding(mesh, P(col.AXIS)), local)
            sides_here = {}
            for side in sides:
                if op not in by_side[side]:
                    continue
                if side == "mpi4jax":
                    sides_here[side] = measure.Side(
                        jax.jit(col.loop_body(op, by_side[side][op], n)),
                        jax.device_put(local, jax.local_devices()[0]), steps["local"], np.asarray)
                else:
                    sides_here[side] = measure.Side(col.mesh_program(mesh, op, by_side[side][op]),
                                                    x_global, steps["mesh"], _local_part)
            measure.jaxcomm_rounds(op)  # from zero
            rec = measure.measure(sides_here, method.lengths_for(nbytes, options.length_list(args)),
                                  args.rounds, args.warmup, sync, compare if args.check else None)
            rec.update(op=op, bytes=nbytes, count=count, dtype=dtype.name, processes=procs, devices=n,
                       bind=args.bind, launcher=args.launcher, hosts=args.hosts,
                       hugetlb=common.hugetlb_enabled(), load=method.load_average(),
                       jaxcomm_rounds=measure.jaxcomm_rounds(op))
            if rec["error"]:
                bar.note(f"{op} {common.format_bytes(nbytes)}: {rec['error']}")
            records.append(rec)
    if rank == 0 and args.emit_json:
        report.write_json(records, args.emit_json)
    return 0


def _local_part(out: Any) -> Any:
    """This process's part of a result, as one NumPy array (its devices in id order)."""
    import numpy as np
    if hasattr(out, "addressable_shards") and not out.is_fully_addressable:
        return np.concatenate([np.asarray(s.data) for s in
                               sorted(out.addressable_shards, key=lambda s: s.device.id)])
    return np.asarray(out)


# ------------------------------------------------------------------------------ driver

def _worker_argv(argv: Sequence[str], launcher: str, bind: str, path: str) -> list[str]:
    return [*argv, "--worker", "--launcher", launcher, "--bind", bind, "--emit-json", path]


def _run_job(argv: Sequence[str], args: argparse.Namespace, launcher: str, bind: str,
             transport: str | None = None) -> tuple[list[dict[str, Any]], bool, str]:
    """One job of the benchmark's processes; (process 0's records, success, how started).
    ``transport``: the job's JAXCOMM_TRANSPORT (None: as the environment has it)."""
    fd, path = tempfile.mkstemp(prefix="jaxcomm-bench-mp-", suffix=".json")
    os.close(fd)
    env = common.hugetlb_env(args.hugetlb == "on")
    env["JAX_PLATFORMS"] = "cpu"
    if transport is not None:
        env["JAXCOMM_TRANSPORT"] = transport
    try:
        if launcher == "mpi":
            crowded = args.processes > (os.cpu_count() or 1)
            # More processes than cores: Open MPI binds them to shared cores only if told.
            to = ("core:overload-allowed" if crowded else "core") if bind == "cores" else "none"
            cmd = ["mpirun", "-n", str(args.processes), "--bind-to", to] + \
                (["--oversubscribe"] if crowded else [])
            how = " ".join(cmd)
            if transport is not None:
                how = f"JAXCOMM_TRANSPORT={transport} {how}"
            # Open MPI refuses to run as root unless told.
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            cmd += [sys.executable, "-m", "jaxcomm.bench.multiprocess",
                    *_worker_argv(argv, launcher, bind, path)]
            returncode = subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr).returncode
        else:
            from jaxcomm import launch
            how = f"python -m jaxcomm.launch -n {args.processes} --bind {bind}"
            res = launch.launch(["jaxcomm.bench.multiprocess", *_worker_argv(argv, launcher, bind, path)],
                                args.processes, devices_per_process=args.devices, module=True,
                                env=env, grace_s=args.grace, bind=bind,
                                stdout=sys.stderr, stderr=sys.stderr,
                                forward_signals=threading.current_thread() is threading.main_thread())
            returncode = res.returncode
        try:
            records = report.read_json(path)
        except (OSError, ValueError):
            records = []
        ok = returncode == 0 and bool(records)
        if not ok:
            print(f"error: the benchmark's processes ({how}) exited with status {returncode}"
                  + ("" if records else " and no results"), file=sys.stderr)
        return records, ok, how
    finally:
        os.unlink(path)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m jaxcomm.bench --processes N ...``; the exit status.

    Exit status 1 when a job failed, a case failed, or a peer's result differed from
    jaxcomm's.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = options.parse(argv)
    if args.worker:
        return worker(args)
    if args.show:
        report.print_report(report.read_json(args.show))
        return 0
    launcher, why = "jaxcomm", ""
    if args.mpi4jax:
        why = mpi4jax_missing() or ("it needs --devices 1" if args.devices != 1 else "")
        launcher = "jaxcomm" if why else "mpi"
    print(f"# jaxcomm benchmark across processes, {datetime.date.today().isoformat()}: "
          f"{args.processes} processes x {args.devices} device(s), {os.cpu_count()} cpus, "
          f"rounds {args.rounds}, hugetlb {args.hugetlb}"
          + (f"; mpi4jax not compared: {why}" if why else ""), flush=True)
    binds = ["cores", "none"] if args.bind == "both" else [args.bind]
    all_records: list[dict[str, Any]] = []
    failed = False
    # Played hosts under mpirun: jaxcomm's MPI transport between them in one job, its TCP
    # transport in another (one process links a peer through one transport); gloo,
    # mpi4jax and the plain jit run in both, alternated with jaxcomm as everywhere.
    transports: list[str | None] = ["mpi", "shm+tcp"] if launcher == "mpi" and args.hosts > 1 else [None]
    jobs = [(bind, t) for bind in binds for t in transports]
    for bind, transport in jobs:
        records, ok, how = _run_job(argv, args, launcher, bind, transport)
        failed |= not ok
        load = method.load_average()
        for r in records:
            r.update(started_by=how, load_after=load)
        report.print_report(records)
        all_records.extend(records)
    if args.json:
        report.write_json(all_records, args.json)
    if args.plot and all_records:
        report.plot(all_records, args.plot)
    return 1 if failed or report.failed(all_records) else 0


if __name__ == "__main__":
    sys.exit(main())
