"""Collectives across processes, jaxcomm against its peers: ``python -m jaxcomm.bench --processes N``.

    python -m jaxcomm.bench --processes 2 [--sizes 4B,4KiB,1MiB,16MiB] [--bind both]
    python -m jaxcomm.bench --processes 2 --latency          # all_reduce, 4 B to 4 KiB

Every side runs in the same processes, on the same inputs, in programs of the same shape
(``jit`` of a ``lax.fori_loop`` of n collectives whose carry is the previous result), and
is measured by the method of :mod:`jaxcomm.bench.method`: loops of several lengths n,
fitted as ``a + b * n`` (``b`` per collective, ``a`` fixed per call), the sides taking
turns in alternating order, medians over the rounds. The sides:

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
mpi4jax is then not compared.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

from jaxcomm.bench import common, method

#: The ops compared by default (broadcast through --ops).
DEFAULT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute")
#: The ops mpi4jax has a counterpart of.
MPI4JAX_OPS = ("all_reduce", "all_gather", "all_to_all", "ppermute")
DEFAULT_SIZES = "4B,4KiB,1MiB,16MiB"
LATENCY_SIZES = "4B:4KiB"
#: jaxcomm's rendezvous deadline here: a side that cannot complete fails its row in
#: seconds instead of holding every process for JAXCOMM_TIMEOUT_S.
DEFAULT_TIMEOUT_S = 30.0
#: The sides in the order of the tables; "jaxcomm" is the one compared with the others.
SIDES = ("jaxcomm", "gloo", "mpi4jax", "plain")
PEERS = ("gloo", "mpi4jax")
PLACEMENTS = {"cores": "bound: a core (share of the cores) per process",
              "none": "not bound: the scheduler places the processes"}


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

def _collectives(n: int, timeout_s: float | None) -> dict[str, dict[str, Callable]]:
    """Per side, per op: the collective ``f(carry)`` of one loop step (``plain``: an
    elementwise op of the operand's shape in its place)."""
    from jaxcomm.bench import collectives as col

    def ours(spec: Any) -> Callable:
        return lambda c: spec.jaxcomm(c, n, timeout_s)

    def theirs(spec: Any) -> Callable:
        return lambda c: spec.xla(c, n)
    return {"jaxcomm": {op: ours(spec) for op, spec in col.OPS.items()},
            "gloo": {op: theirs(spec) for op, spec in col.OPS.items()},
            "plain": {op: (lambda c: c * 0.5 + 0.25) for op in col.OPS}}


def _mpi4jax_collectives(n: int) -> dict[str, Callable]:
    """mpi4jax's counterparts, on a process's local operand."""
    import mpi4jax
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    return {
        "all_reduce": lambda c: mpi4jax.allreduce(c, op=MPI.SUM, comm=comm),
        "all_gather": lambda c: mpi4jax.allgather(c, comm=comm).reshape(-1),
        "all_to_all": lambda c: mpi4jax.alltoall(c.reshape(n, -1), comm=comm).reshape(-1),
        "ppermute": lambda c: mpi4jax.sendrecv(c, c, source=(rank - 1) % n, dest=(rank + 1) % n,
                                               comm=comm),
    }


def _feedback(op: str, n: int) -> Callable:
    """The next carry from the carry and the collective's result, alike for every side.

    all_reduce scales by 1/n (exact for n a power of two) so that 1000 chained sums stay
    finite; the other ops as in :mod:`jaxcomm.bench.collectives`.
    """
    from jaxcomm.bench import collectives as col
    if op == "all_reduce":
        return lambda c, y: y * (1.0 / n)
    return col.OPS[op].feedback


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
    from jaxcomm.bench import collectives as col

    rank, procs = jax.process_index(), jax.process_count()
    if args.hosts > 1:
        # Read when the first program is lowered (jaxcomm/_src/transport.py).
        os.environ["JAXCOMM_HOST_ID"] = f"bench-host-{rank * args.hosts // procs}"
    sync: Any = MPISync() if args.launcher == "mpi" else KVSync(
        timeout_s=2 * (args.timeout or DEFAULT_TIMEOUT_S) + 120)
    mesh = jax.make_mesh((len(jax.devices()),), (col.AXIS,))
    n = mesh.size
    local_devices = len(jax.local_devices())
    dtype = np.dtype(jnp.dtype(args.dtype))
    ops, sizes = _ops_and_sizes(args)
    sides = _sides(args)
    by_side = _collectives(n, args.timeout)
    if "mpi4jax" in sides:
        by_side["mpi4jax"] = _mpi4jax_collectives(n)
    lengths_all = tuple(int(v) for v in args.lengths.split(","))
    records = []
    cases = col.plan(ops, sizes, n, dtype.itemsize)
    with common.ProgressDisplay(len(cases), title=f"{procs} processes",
                                enabled=args.progress and rank == 0) as bar:
        for op, nbytes, count in cases:
            bar.step(f"{op} {common.format_bytes(nbytes)}")
            elems = col.OPS[op].in_elems(count, n)
            first = rank * local_devices
            local = np.concatenate([((np.arange(elems) + first + d) % 4).astype(dtype)
                                    for d in range(local_devices)])
            case_sides = [s for s in sides if op in by_side[s]]
            rec = _measure(op, nbytes, count, elems, local, case_sides, by_side, mesh, n, sync,
                           method.lengths_for(nbytes, lengths_all), args)
            rec.update(processes=procs, devices=n, dtype=dtype.name, bind=args.bind,
                       launcher=args.launcher, hosts=args.hosts,
                       hugetlb=common.hugetlb_enabled())
            if rec["error"]:
                bar.note(f"{op} {common.format_bytes(nbytes)}: {rec['error']}")
            records.append(rec)
    if rank == 0 and args.emit_json:
        with open(args.emit_json, "w") as f:
            json.dump(records, f)
    return 0


def _sides(args: argparse.Namespace) -> list[str]:
    sides = ["jaxcomm"] + (["gloo"] if args.gloo else [])
    if args.launcher == "mpi":
        sides.append("mpi4jax")
    sides.append("plain")
    return sides


def _measure(op: str, nbytes: int, count: int, elems: int, local: Any, sides: list[str],
             by_side: dict[str, dict[str, Callable]], mesh: Any, n: int, sync: Any,
             lengths: tuple[int, ...], args: argparse.Namespace) -> dict[str, Any]:
    """Compiles, checks and times one case on every side; its record."""
    import numpy as np
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxcomm.bench import collectives as col

    feedback = _feedback(op, n)
    sharded = NamedSharding(mesh, P(col.AXIS))
    x_global = jax.make_array_from_process_local_data(sharded, local)
    x_local = jax.device_put(local, jax.local_devices()[0])

    def program(side: str, length: int) -> Callable:
        collective = by_side[side][op]

        def body(x: Any) -> Any:
            return jax.lax.fori_loop(0, length, lambda _, c: feedback(c, collective(c)), x)
        if side == "mpi4jax":
            return jax.jit(body)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(col.AXIS), out_specs=P(col.AXIS),
                                     check_vma=False))

    def operand(side: str) -> Any:
        return x_local if side == "mpi4jax" else x_global

    def local_result(out: Any) -> Any:
        if hasattr(out, "addressable_shards") and len(out.addressable_shards) > 0 and \
                not out.is_fully_addressable:
            return np.concatenate([np.asarray(s.data) for s in
                                   sorted(out.addressable_shards, key=lambda s: s.device.id)])
        return np.asarray(out)

    rec: dict[str, Any] = dict(op=op, bytes=nbytes, count=count, lengths=list(lengths),
                               sides={}, match={}, error=None)
    progs: dict[str, dict[int, Callable]] = {}
    failures: dict[str, str] = {}
    firsts: dict[str, Any] = {}
    # Called through jit, not compiled ahead: mpi4jax's ordered effects need jit's calling
    # convention (a token argument), and every side pays for the same dispatch path.
    for side in sides:
        progs[side] = {m: program(side, m) for m in lengths}
        try:
            firsts[side] = local_result(jax.block_until_ready(progs[side][lengths[0]](operand(side))))
            for m in lengths:  # compiles, then the warmup calls
                for _ in range(1 + args.warmup):
                    jax.block_until_ready(progs[side][m](operand(side)))
        except Exception as exc:
            failures[side] = _short(exc)
        # A side that failed in one process must not be run by the others (they would
        # wait for it in its collectives).
        if _agree(sync, {side: failures[side]} if side in failures else {}):
            failures.setdefault(side, "failed in another process")
    for side in failures:
        progs.pop(side, None)
        firsts.pop(side, None)
    if args.check and "jaxcomm" in firsts:
        for side in firsts:
            if side in ("jaxcomm", "plain"):
                continue
            ok = bool(np.allclose(firsts["jaxcomm"], firsts[side], rtol=1e-5, atol=1e-6))
            rec["match"][side] = all(sync.all_gather(ok))
    errors = [f"{side}: {msg}" for side, msg in failures.items()]
    spans: dict[str, dict[int, list[tuple[float, float]]]] = {s: {m: [] for m in lengths} for s in progs}
    try:
        for r in range(args.rounds):
            for side in method.turn_order(list(progs), r):
                for m in lengths:
                    fn, x = progs[side][m], operand(side)
                    sync.barrier()
                    t0 = time.perf_counter()
                    out = fn(x)
                    jax.block_until_ready(out)
                    t1 = time.perf_counter()
                    del out
                    spans[side][m].append((t0, t1))
    except Exception as exc:
        errors.append(f"while timing: {_short(exc)}")
        spans = {}
    everyone = sync.all_gather({s: {str(m): v for m, v in by.items()} for s, by in spans.items()})
    for side in spans:
        samples = {}
        for m in lengths:
            series = [e[side][str(m)] for e in everyone]
            samples[m] = [(max(t1 for _, t1 in call) - max(t0 for t0, _ in call)) * 1e6
                          for call in zip(*series)]
        f = method.fit(samples)
        # The same line through each length's fastest call: what the side does when the
        # machine leaves it alone (on a loaded machine the medians show the load too).
        best = method.fit({m: [min(ts)] for m, ts in samples.items() if ts})
        rec["sides"][side] = {"per_call_us": f.per_call_us, "per_collective_us": f.per_collective_us,
                              "medians_us": {str(m): t for m, t in f.medians_us.items()},
                              "fastest_us": {str(m): t for m, t in best.medians_us.items()}}
        rec[f"{side}_per_call_us"] = f.per_call_us
        rec[f"{side}_per_collective_us"] = f.per_collective_us
        rec[f"{side}_best_per_collective_us"] = best.per_collective_us
    rec["error"] = "; ".join(errors) or None
    rec["load"] = method.load_average()
    return rec


def _agree(sync: Any, failures: dict[str, str]) -> dict[str, str]:
    """Every process's failed sides: a side that failed anywhere is dropped everywhere."""
    merged: dict[str, str] = {}
    for rank, theirs in enumerate(sync.all_gather(failures)):
        for side, msg in theirs.items():
            merged.setdefault(side, f"rank {rank}: {msg}")
    return merged


def _short(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= limit else text[:limit] + " ..."


# ------------------------------------------------------------------------------ driver

def _ops_and_sizes(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    if args.latency:
        return ["all_reduce"], common.parse_sizes(LATENCY_SIZES, args.factor)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    return ops, common.parse_sizes(args.sizes, args.factor)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxcomm.bench --processes N",
        description="Times jaxcomm's collectives across processes against gloo (jax.lax), "
                    "mpi4jax (when installed) and a plain jit, in the same processes: "
                    "per collective and fixed per call, from loops of several lengths.",
        epilog="Sizes are per-device bytes (all_gather: output; reduce_scatter: input). "
               "Each figure is fitted as a + b*n through the median call time of each loop "
               "length n (collectives per jitted call): b per collective, a per call. See "
               "docs/benchmarks.md.")
    p.add_argument("--processes", type=int, required=True, metavar="N",
                   help="run across N processes")
    p.add_argument("--devices", type=int, default=1, metavar="D",
                   help="CPU devices per process; mpi4jax needs 1 (default %(default)s)")
    p.add_argument("--hosts", type=int, default=1, metavar="H",
                   help="play H hosts on this machine: the processes split into H groups with "
                        "their own JAXCOMM_HOST_ID (shared memory within a group, TCP across); "
                        "without mpi4jax (default %(default)s)")
    p.add_argument("--ops", default=",".join(DEFAULT_OPS),
                   help="comma list of ops (default %(default)s; also broadcast)")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="a comma list of sizes, one size, or START:END multiplied by --factor; "
                        "units B, KiB, MiB, GiB (default %(default)s)")
    p.add_argument("--factor", type=int, default=4,
                   help="size growth factor of a START:END range (default %(default)s)")
    p.add_argument("--latency", action="store_true",
                   help=f"only all_reduce at {LATENCY_SIZES} (by --factor)")
    p.add_argument("--lengths", default=",".join(map(str, method.DEFAULT_LENGTHS)),
                   help="loop lengths: collectives per jitted call; lengths whose collectives "
                        f"would move over {method.MAX_BYTES_PER_CALL >> 20} MiB per call are "
                        "dropped for large sizes, the two shortest kept (default %(default)s)")
    p.add_argument("--rounds", "--iters", dest="rounds", type=int, default=10,
                   help="timed rounds: in each, every side runs every loop length once, in "
                        "alternating order; medians over the rounds (default %(default)s)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed calls per side and length after compiling (default %(default)s)")
    p.add_argument("--bind", choices=("cores", "none", "both"), default="both",
                   help="process placement: 'cores' binds each process to its share of the "
                        "cores (mpirun --bind-to core, jaxcomm.launch --bind cores), 'none' "
                        "leaves it to the scheduler, 'both' runs each in its own job "
                        "(default %(default)s)")
    p.add_argument("--no-mpi4jax", dest="mpi4jax", action="store_false",
                   help="do not compare with mpi4jax (compared when mpirun, mpi4py and "
                        "mpi4jax are installed, with --devices 1 and --hosts 1; the job is "
                        "then started by mpirun)")
    p.add_argument("--no-gloo", dest="gloo", action="store_false",
                   help="do not compare with jax.lax's collectives (gloo: 0.1-5 ms each, "
                        "the longest part of a run with loops of 1000)")
    p.add_argument("--dtype", default="float32", help="element type (default %(default)s)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="jaxcomm's deadline per call (default %(default)s)")
    p.add_argument("--hugetlb", choices=("off", "on"), default="off",
                   help="run with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (default %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write the records as a JSON list")
    p.add_argument("--show", metavar="FILE",
                   help="print the tables of a run saved with --json (measures nothing)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="do not compare the peers' results with jaxcomm's")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress display")
    p.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                   help="launcher grace period after a process fails (default %(default)g)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--launcher", choices=("jaxcomm", "mpi"), default="jaxcomm", help=argparse.SUPPRESS)
    p.add_argument("--emit-json", help=argparse.SUPPRESS)
    return p


def _worker_argv(argv: Sequence[str], launcher: str, bind: str, path: str) -> list[str]:
    return [*argv, "--worker", "--launcher", launcher, "--bind", bind, "--emit-json", path]


def _run_job(argv: Sequence[str], args: argparse.Namespace, launcher: str, bind: str
             ) -> tuple[list[dict[str, Any]], bool, str]:
    """One job of the benchmark's processes; (process 0's records, success, how started)."""
    fd, path = tempfile.mkstemp(prefix="jaxcomm-bench-mp-", suffix=".json")
    os.close(fd)
    env = common.hugetlb_env(args.hugetlb == "on")
    env["JAX_PLATFORMS"] = "cpu"
    try:
        if launcher == "mpi":
            how = f"mpirun -n {args.processes} --bind-to {'core' if bind == 'cores' else 'none'}"
            # Open MPI refuses to run as root unless told.
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            cmd = ["mpirun", "-n", str(args.processes), "--bind-to", "core" if bind == "cores" else "none"]
            if args.processes > (os.cpu_count() or 1):
                cmd.append("--oversubscribe")
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
            with open(path) as f:
                records = json.load(f)
        except (OSError, ValueError):
            records = []
        ok = returncode == 0 and bool(records)
        if not ok:
            print(f"error: the benchmark's processes ({how}) exited with status {returncode}"
                  + ("" if records else " and no results"), file=sys.stderr)
        return records, ok, how
    finally:
        os.unlink(path)


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def format_table(records: Sequence[dict[str, Any]], how: str, load: str) -> str:
    """One op's rows: per collective and per call, every side, with ratios to jaxcomm."""
    first = records[0]
    sides = [s for s in SIDES if any(s in r["sides"] for r in records)]
    peers = [s for s in sides if s in PEERS]
    head = ["size", "lengths", "jaxcomm"]
    for p in peers:
        head += [p, f"{p}/jaxcomm"]
    head += ["|"] + [f"{s} /call" for s in sides] + ["|", "fastest:"] + \
        [f"{p}/jaxcomm" for p in peers] + ["ok"]
    rows = []
    for r in records:
        row = [common.format_bytes(r["bytes"]), ",".join(map(str, r["lengths"])),
               _fmt(r.get("jaxcomm_per_collective_us"))]
        for p in peers:
            row += [_fmt(r.get(f"{p}_per_collective_us")),
                    _fmt(method.ratio(r.get(f"{p}_per_collective_us"), r.get("jaxcomm_per_collective_us")))]
        row += ["|"] + [_fmt(r.get(f"{s}_per_call_us"), ".1f") for s in sides] + ["|", ""]
        row += [_fmt(method.ratio(r.get(f"{p}_best_per_collective_us"), r.get("jaxcomm_best_per_collective_us")))
                for p in peers]
        row.append("ERR" if r["error"] else ("NO" if False in r["match"].values() else "yes"))
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    procs, devs = first["processes"], first["devices"] // first["processes"]
    lines = [f"# {first['op']}: {procs} processes x {devs} device{'s' if devs > 1 else ''}, "
             f"{first['dtype']}; {PLACEMENTS.get(first['bind'], first['bind'])} ({how}); "
             f"load average {load}",
             "# us per collective (b of a + b*n through the median call of each loop length; "
             "ratio = peer / jaxcomm, above 1: jaxcomm faster), us per call (a), and the "
             "ratios of b through each length's fastest call",
             "  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines += [f"#   {common.format_bytes(r['bytes'])}: {r['error']}" for r in records if r["error"]]
    return "\n".join(lines)


def summary_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """One line per peer (where jaxcomm is behind too), and the fixed costs per call."""
    lines = []
    for peer in PEERS:
        rows = [r for r in records if peer in r["sides"]]
        if rows:
            lines.append(method.summary_line(peer, rows))
    calls = {s: [r[f"{s}_per_call_us"] for r in records if r.get(f"{s}_per_call_us") is not None]
             for s in SIDES}
    if calls["jaxcomm"] and calls["plain"]:
        ours, plain = statistics.median(calls["jaxcomm"]), statistics.median(calls["plain"])
        lines.append(f"fixed cost per call (median over cases): jaxcomm {ours:.1f} us, plain jit "
                     f"{plain:.1f} us ({ours / plain:.2f}x)"
                     + "".join(f", {p} {statistics.median(calls[p]):.1f} us"
                               for p in PEERS if calls[p]))
    return lines


def print_report(records: Sequence[dict[str, Any]]) -> None:
    """The tables (one per placement and op) and each placement's summary lines."""
    for bind in dict.fromkeys(r["bind"] for r in records):
        mine = [r for r in records if r["bind"] == bind]
        for op in dict.fromkeys(r["op"] for r in mine):
            rows = [r for r in mine if r["op"] == op]
            print(format_table(rows, rows[0].get("started_by", "?"), rows[0].get("load_after", "?")) + "\n",
                  flush=True)
        for line in summary_lines(mine):
            print(f"# [{bind}] {line}")


def refit(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records with every side's a and b fitted again from their saved medians
    (:func:`jaxcomm.bench.method.fit`): a saved run re-read by ``--show``."""
    out = []
    for r in records:
        r = dict(r)
        for side, fig in r["sides"].items():
            f = method.fit({int(m): [t] for m, t in fig["medians_us"].items()})
            r[f"{side}_per_call_us"], r[f"{side}_per_collective_us"] = f.per_call_us, f.per_collective_us
            if "fastest_us" in fig:
                best = method.fit({int(m): [t] for m, t in fig["fastest_us"].items()})
                r[f"{side}_best_per_collective_us"] = best.per_collective_us
        out.append(r)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m jaxcomm.bench --processes N ...``; the exit status.

    Exit status 1 when a job failed, a case failed, or a peer's result differed from
    jaxcomm's.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.show:
        with open(args.show) as f:
            print_report(refit(json.load(f)))
        return 0
    if args.processes < 1 or args.devices < 1:
        parser.error(f"need --processes >= 1 and --devices >= 1, got {args.processes} and "
                     f"{args.devices}")
    if not 1 <= args.hosts <= args.processes:
        parser.error(f"need 1 <= --hosts <= --processes, got {args.hosts}")
    try:
        ops, _ = _ops_and_sizes(args)
        method.lengths_for(1, [int(v) for v in args.lengths.split(",")])
    except ValueError as exc:
        parser.error(str(exc))
    from jaxcomm.bench import collectives
    bad = [o for o in ops if o not in collectives.OPS]
    if bad or not ops:
        parser.error(f"--ops: unknown op(s) {bad}; choose from {','.join(collectives.ALL_OPS)}")
    launcher, why = "jaxcomm", ""
    if args.mpi4jax:
        why = mpi4jax_missing() or ("it needs --devices 1" if args.devices != 1 else "") or \
            ("it needs --hosts 1" if args.hosts != 1 else "")
        launcher = "jaxcomm" if why else "mpi"
    print(f"# jaxcomm benchmark across processes, {datetime.date.today().isoformat()}: "
          f"{args.processes} processes x {args.devices} device(s), {os.cpu_count()} cpus, "
          f"rounds {args.rounds}, hugetlb {args.hugetlb}"
          + (f"; mpi4jax not compared: {why}" if why else ""), flush=True)
    binds = ["cores", "none"] if args.bind == "both" else [args.bind]
    all_records: list[dict[str, Any]] = []
    failed = False
    for bind in binds:
        records, ok, how = _run_job(argv, args, launcher, bind)
        failed |= not ok
        load = method.load_average()
        for r in records:
            r.update(started_by=how, load_after=load)
        print_report(records)
        all_records.extend(records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_records, f, indent=1)
    bad_records = any(r["error"] or False in r["match"].values() for r in all_records)
    return 1 if failed or bad_records else 0


if __name__ == "__main__":
    sys.exit(main())
