"""Collective benchmark across processes: ``python -m jaxcomm.bench --processes N``.

    python -m jaxcomm.bench --processes 2 [--devices 1] [--hosts 1] [--sizes 4B:16MiB] [--latency]

Starts N processes (x ``--devices`` CPU devices each) with :mod:`jaxcomm.launch`; in each,
:func:`jaxcomm.bench.collectives.run` times jaxcomm's collectives against XLA's
multi-process ones (gloo over TCP) on one mesh spanning every device of the job, in the
same run, with the same programs, sizes and conventions as the single-process benchmark
(see :mod:`jaxcomm.bench.collectives`; sizes up to 64 KiB are timed as a
``lax.fori_loop`` of 100 collectives in one program). ``--latency`` measures only that
loop for all_reduce at 4 B..4 KiB. ``--hosts H`` has the processes play H hosts
(``JAXCOMM_HOST_ID``): shared memory within each, TCP across, hierarchical all_reduce.

The processes keep in step through the jax.distributed key-value store, not through
collectives: for each case they agree which sides compiled and ran everywhere (a side
that failed in one process, e.g. jaxcomm before its multi-process transport exists, is
reported as that row's error and skipped by all), and each timed iteration lasts from
the last process's dispatch to the last process's result (:meth:`KVSync.combine`).
Process 0 writes the records; this process (which never
creates a JAX backend) prints the tables.

Afterwards, when ``mpirun`` and mpi4jax are installed, the same sizes are compared with
mpi4jax in an MPI job (:mod:`jaxcomm.bench.mpi4jax_compare`; ``--no-mpi4jax`` skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from typing import Any, Sequence

from jaxcomm.bench import collectives, common, report

#: The ops issue 4 compares across processes (broadcast is available through --ops).
DEFAULT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute")
#: jaxcomm's rendezvous deadline here: a side that cannot complete fails its row in
#: seconds instead of holding every process for JAXCOMM_TIMEOUT_S.
DEFAULT_TIMEOUT_S = 30.0
LATENCY_SIZES = "4B:4KiB"

#: Issue 4's throughput target against gloo (the mpi4jax targets need mpi4jax).
TARGETS: tuple[tuple[str, Any, float], ...] = (
    ("every op at >= 1MiB: >= 3x the throughput of XLA's gloo collectives",
     lambda r: r["bytes"] >= 1 << 20, 3.0),
)


class KVSync(collectives.Sync):
    """Keeps the processes of the benchmark in step through jax.distributed's store.

    Each call is an all-gather of a small JSON value under a fresh key; every wait for
    another process is bounded by ``timeout_s``.
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
                raw = self.client.blocking_key_value_get(f"{key}/{r}",
                                                         int(self.timeout_s * 1000))
            except Exception as exc:
                raise RuntimeError(f"benchmark: rank {r} did not reach step {self.step - 1} "
                                   f"within {self.timeout_s:g} s (died or stuck?): "
                                   f"{exc}") from exc
            values.append(json.loads(raw))
        return values

    @staticmethod
    def _merge(messages: list[tuple[int, str]], n: int) -> str:
        """One message if every process said the same, else each one's, by rank."""
        texts = {m for _, m in messages}
        if len(messages) == n and len(texts) == 1:
            return messages[0][1]
        return "; ".join(f"rank {r}: {m}" for r, m in messages)

    def agree(self, failures: dict[str, str]) -> dict[str, str]:
        everyone = self.all_gather(failures)
        sides = sorted({side for f in everyone for side in f})
        return {side: self._merge([(r, f[side]) for r, f in enumerate(everyone) if side in f],
                                  self.n)
                for side in sides}

    def combine(self, samples: dict[str, list[collectives.Span]], errors: list[str]
                ) -> tuple[dict[str, list[float]], list[str]]:
        """Each call lasts from the last process's dispatch to the last result.

        The processes run on one machine (the launcher starts them), so their spans share
        one clock. Counting from the first dispatch instead would charge a call with how
        unevenly the previous one ended: with the sides interleaved, jaxcomm's calls were
        charged with gloo's uneven ends (4 MiB all_to_all: 0.8-1.0 ms in the benchmark,
        0.5 ms back to back), and a barrier before each call leaves 0-150 us of its own.
        """
        everyone = self.all_gather({"samples": samples, "errors": errors})
        merged: dict[str, list[float]] = {}
        for side in samples:
            series = [e["samples"].get(side) for e in everyone]
            if all(s is not None and len(s) == len(samples[side]) for s in series):
                merged[side] = [max(t1 for _, t1 in call) - max(t0 for t0, _ in call)
                                for call in zip(*series)]
        all_errors = sorted({e for rec in everyone for e in rec["errors"]})
        merged_errors = [self._merge([(r, e) for r, rec in enumerate(everyone)
                                      if e in rec["errors"]], self.n) for e in all_errors]
        return merged, merged_errors


def build_parser() -> argparse.ArgumentParser:
    """The single-process benchmark's command line, plus the multi-process options."""
    p = collectives.build_parser()
    p.description = ("Times jaxcomm's collectives against XLA's multi-process ones (gloo) "
                     "across --processes processes started by jaxcomm.launch.")
    p.add_argument("--processes", type=int, required=True, metavar="N",
                   help="run across N processes of --devices CPU devices each")
    p.add_argument("--latency", action="store_true",
                   help=f"only the latency loop: all_reduce at {LATENCY_SIZES}")
    p.add_argument("--hosts", type=int, default=1, metavar="H",
                   help="play H hosts on this machine: the processes split into H consecutive "
                        "groups with their own JAXCOMM_HOST_ID (shared memory within a group, "
                        "TCP across; all_reduce hierarchical) (default %(default)s)")
    p.add_argument("--bind", choices=("none", "cores"), default="none",
                   help="the launcher's --bind (default %(default)s)")
    p.add_argument("--no-mpi4jax", dest="mpi4jax", action="store_false",
                   help="skip the comparison with mpi4jax (run when mpirun and mpi4jax are "
                        "installed; see jaxcomm.bench.mpi4jax_compare)")
    p.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                   help="launcher grace period after a process fails (default %(default)g)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(ops=",".join(DEFAULT_OPS), sizes="4B:16MiB", factor=4, devices=1,
                   hugetlb="off", timeout=DEFAULT_TIMEOUT_S)
    for action in p._actions:
        # Same options, other meaning or default: say so in --help.
        if action.dest == "devices":
            action.help = "CPU devices per process (default %(default)s)"
        elif action.dest in ("ops", "sizes", "factor", "hugetlb", "timeout"):
            action.help = (action.help or "").split(" (default")[0] + " (default %(default)s)"
    return p


def _ops_and_sizes(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    if args.latency:
        return ["all_reduce"], common.parse_sizes(LATENCY_SIZES, args.factor)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    return ops, common.parse_sizes(args.sizes, args.factor)


def worker(args: argparse.Namespace) -> int:
    """One process of the job: joins it, measures, and (process 0) writes the records."""
    import jaxcomm
    if not jaxcomm.init():
        print("jaxcomm.bench --worker must run under jaxcomm.launch", file=sys.stderr)
        return 2
    import jax
    ops, sizes = _ops_and_sizes(args)
    rank = jax.process_index()
    if args.hosts > 1:
        # Read when the first program is lowered (jaxcomm/_src/transport.py).
        os.environ["JAXCOMM_HOST_ID"] = f"bench-host-{rank * args.hosts // jax.process_count()}"
    # Generous: a process may be a whole jaxcomm timeout plus a compilation behind.
    sync = KVSync(timeout_s=2 * (args.timeout or DEFAULT_TIMEOUT_S) + 120)
    records = collectives.run(
        ops, sizes, None, args.dtype, args.iters, args.warmup, timeout_s=args.timeout,
        check=args.check, inplace=args.inplace, progress=args.progress and rank == 0,
        title=f"{jax.process_count()} processes, hugetlb="
              f"{'on' if common.hugetlb_enabled() else 'off'}",
        sync=sync)
    if rank == 0 and args.emit_json:
        report.write_json(records, args.emit_json)
    return 0


def _launch_once(argv: Sequence[str], args: argparse.Namespace, hugetlb: bool
                 ) -> tuple[list[dict[str, Any]], bool]:
    """Runs the workers with malloc's huge pages ``hugetlb``.

    Returns process 0's records (empty if it wrote none) and whether the job succeeded.
    """
    from jaxcomm import launch
    fd, path = tempfile.mkstemp(prefix="jaxcomm-bench-mp-", suffix=".json")
    os.close(fd)
    try:
        worker_argv = ["jaxcomm.bench.multiprocess", *argv, "--worker",
                       "--hugetlb", "on" if hugetlb else "off", "--emit-json", path]
        # The ranks' output (progress, errors) goes to stderr: stdout is for the tables.
        res = launch.launch(worker_argv, args.processes, devices_per_process=args.devices,
                            module=True, env=common.hugetlb_env(hugetlb), grace_s=args.grace,
                            bind=args.bind,
                            stdout=sys.stderr, stderr=sys.stderr,
                            forward_signals=threading.current_thread() is threading.main_thread())
        try:
            with open(path) as f:
                records = json.load(f)
        except (OSError, ValueError):
            records = None
        ok = res.returncode == 0 and bool(records)
        if not ok:
            print(f"error: the benchmark's processes (hugetlb={'on' if hugetlb else 'off'}) "
                  f"exited with status {res.returncode}"
                  + ("" if records else " and no results"), file=sys.stderr)
        return records or [], ok
    finally:
        os.unlink(path)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m jaxcomm.bench --processes N ...``; the exit status.

    Exit status 1 when the job failed, some case failed, or jaxcomm disagreed with XLA.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.processes < 1 or args.devices < 1:
        parser.error(f"need --processes >= 1 and --devices >= 1, got {args.processes} and "
                     f"{args.devices}")
    if not 1 <= args.hosts <= args.processes:
        parser.error(f"need 1 <= --hosts <= --processes, got {args.hosts}")
    try:
        ops, sizes = _ops_and_sizes(args)
        import jax.numpy as jnp
        jnp.dtype(args.dtype)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    bad = [o for o in ops if o not in collectives.OPS]
    if bad or not ops:
        parser.error(f"--ops: unknown op(s) {bad}; choose from {','.join(collectives.ALL_OPS)}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (fail now, not after the whole run)
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib)")
    import jax
    import jaxcomm
    report.print_header({
        "jax": jax.__version__, "jaxcomm": jaxcomm.__version__,
        "processes": args.processes, "devices/process": args.devices, "hosts": args.hosts,
        "xla collectives": "gloo", "JAXCOMM_BACKEND": os.environ.get("JAXCOMM_BACKEND", "auto"),
        "dtype": args.dtype, "iters": args.iters, "warmup": args.warmup,
        "cpus": os.cpu_count(), "hugetlb": args.hugetlb, "inplace": args.inplace,
        "THP": common.transparent_hugepage_mode()})
    settings = {"off": [False], "on": [True], "both": [False, True]}[args.hugetlb]
    all_records: list[dict[str, Any]] = []
    failed = False
    for setting in settings:
        records, ok = _launch_once(argv, args, setting)
        failed |= not ok
        report.print_tables(records)
        all_records.extend(records)
    bad_records = report.finish(all_records, args.json, args.plot, targets=TARGETS)
    if args.mpi4jax and args.devices == 1 and not args.hosts > 1:
        from jaxcomm.bench import mpi4jax_compare
        listed = ",".join(f"{size}B" for size in sizes)
        failed |= mpi4jax_compare.run(args.processes, listed, args.iters, args.warmup) != 0
    return 1 if bad_records or failed else 0


if __name__ == "__main__":
    sys.exit(main())
