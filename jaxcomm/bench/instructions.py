"""Instructions per collective across two processes, counted by callgrind.

    python -m jaxcomm.bench.instructions [--op all_reduce] [--size 4B] [--length 200]

Wall-clock figures of a microsecond-scale collective move by 2-5x with the machine's
load; the instructions the CPU executes for it move much less. This runs two processes of
one job on this machine: process 0 under ``valgrind --tool=callgrind``, process 1
natively, with a spin budget long enough that it waits for the slow process 0 in the
inline exchange instead of handing its rounds to the progress thread. What callgrind
counts in process 0 is every thread of it, from the custom call's entry in XLA to its
completion, including the flight recorder and any progress-thread activity.

Process 1 is meant to be there first, but a loaded machine deschedules it: process 0 then
spins (counted) and, past its own spin budget, hands the round to the completion pool.
Process 0 says how many of its rounds completed inline; compare runs with similar
counts. On 2026-12-01 at load averages near 20, one run had 540 of 600 rounds inline; in
two earlier ones (before the count was printed) most instructions were under the
completion pool's worker.

Process 0 runs, after compiling and a warmup call of each, ``--calls`` calls of two
programs of ``--length`` loop steps each: the plain loop (an elementwise op in place of
the collective) and jaxcomm's. Callgrind dumps its counters at each marker (a call of
``getppid``, which nothing else in the process makes), so each phase is counted apart;
the result is

    instructions per collective = (Ir(jaxcomm loop) - Ir(plain loop)) / (calls * length)

and the functions that take the most of it (inclusive, per collective). Needs valgrind
(``apt-get install valgrind``); takes 2-5 minutes, most of it importing jax under
valgrind.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from typing import Sequence

#: The libc function whose calls mark the phases (callgrind --dump-before).
MARKER = "getppid"


def _worker(args: argparse.Namespace) -> int:
    """One process: compile and warm up both programs, then the marked phases."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np
    import jaxcomm
    if not jaxcomm.init():
        print("jaxcomm.bench.instructions --worker: not in a job", file=sys.stderr)
        return 2
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxcomm import _jaxcomm
    from jaxcomm.bench import collectives as col, common

    rank = jax.process_index()
    mesh = jax.make_mesh((len(jax.devices()),), (col.AXIS,))
    n = mesh.size
    (op, nbytes, count), = col.plan([args.op], [common.parse_size(args.size)], n, 4)
    spec = col.OPS[op]
    elems = spec.in_elems(count, n)
    local = ((np.arange(elems) + rank) % 4).astype(np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(col.AXIS)), local)
    # The benchmark's own programs (its loop body and feedback), the length a device scalar.
    steps = col.mesh_steps(mesh)(args.length)
    plain = col.mesh_program(mesh, op, col.plain_step)
    ours = col.mesh_program(mesh, op, lambda c, n: spec.jaxcomm(c, n, None))
    for fn in (plain, ours):
        jax.block_until_ready(fn(x, steps))
    phases = [("plain", plain)] if rank == 0 else []
    phases.append(("jaxcomm", ours))
    for name, fn in phases:
        if rank == 0:
            os.getppid()  # marker: the counts so far are dumped, the phase starts from zero
        before = _jaxcomm.inline_rounds()
        for _ in range(args.calls):
            jax.block_until_ready(fn(x, steps))
        inline = _jaxcomm.inline_rounds() - before
    if rank == 0:
        os.getppid()
        # Which path the counts are of: the inline exchange, or rounds completed by the
        # completion pool (a round whose peer was not there within the spin budget).
        print(f"# process 0: {inline} of {args.calls * args.length} jaxcomm rounds completed "
              "inline on the device thread", flush=True)
    return 0


def _total(path: str) -> int:
    """The instructions counted in one callgrind dump."""
    with open(path) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError(f"{path}: no totals line")


def _top(path: str, per: float, limit: int) -> list[str]:
    """The functions with most inclusive instructions in a dump, per collective."""
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", f"--threshold=100", path],
                         capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        m = re.match(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(\S.*)$", line)
        if m:
            rows.append(f"{int(m.group(1).replace(',', '')) / per:12.1f}  {m.group(2)[:150]}")
    return rows[:limit]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxcomm.bench.instructions",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--op", default="all_reduce", help="the collective (default %(default)s)")
    p.add_argument("--size", default="4B", help="bytes per device (default %(default)s)")
    p.add_argument("--length", type=int, default=200, help="loop steps per call (default %(default)s)")
    p.add_argument("--calls", type=int, default=3, help="timed calls per program (default %(default)s)")
    p.add_argument("--top", type=int, default=40, help="functions listed (default %(default)s)")
    p.add_argument("--keep", metavar="DIR", help="keep callgrind's dumps in DIR")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    if shutil.which("valgrind") is None:
        print("needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    out_dir = args.keep or tempfile.mkdtemp(prefix="jaxcomm-callgrind-")
    os.makedirs(out_dir, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = dict(os.environ, JAX_PLATFORMS="cpu", JAXCOMM_COORDINATOR=f"127.0.0.1:{port}",
                JAXCOMM_NUM_PROCESSES="2", JAXCOMM_LOCAL_DEVICES="1",
                JAXCOMM_JOB_ID=f"cg{os.getpid()}", JAXCOMM_TIMEOUT_S="600",
                # Process 0 runs 20-100x slower under valgrind: JAX's coordination service
                # must neither give up on its joining nor take its slow heartbeats for death.
                JAXCOMM_INIT_TIMEOUT_S="1800", JAXCOMM_HEARTBEAT_TIMEOUT_S="600",
                JAXCOMM_SHUTDOWN_TIMEOUT_S="600",
                XLA_FLAGS="--xla_force_host_platform_device_count=1")
    worker = [sys.executable, "-m", "jaxcomm.bench.instructions", "--worker", "--op", args.op,
              "--size", args.size, "--length", str(args.length), "--calls", str(args.calls)]
    valgrind = ["valgrind", "--tool=callgrind", f"--dump-before={MARKER}",
                f"--callgrind-out-file={out_dir}/callgrind.out", "--trace-children=no"]
    procs = [subprocess.Popen(valgrind + worker, env=dict(base, JAXCOMM_PROCESS_ID="0")),
             subprocess.Popen(worker, env=dict(base, JAXCOMM_PROCESS_ID="1",
                                               JAXCOMM_SPIN_US="600000000"))]
    codes = [proc.wait() for proc in procs]
    if any(codes):
        print(f"error: the processes exited with {codes}", file=sys.stderr)
        return 1
    dumps = sorted(glob.glob(f"{out_dir}/callgrind.out.*"), key=lambda f: int(f.rsplit(".", 1)[1]))
    if len(dumps) < 3:
        print(f"error: expected the marked dumps in {out_dir}, found {dumps}", file=sys.stderr)
        return 1
    plain, ours = dumps[-2], dumps[-1]  # the dumps made at the second and third markers
    steps = args.calls * args.length
    plain_ir, ours_ir = _total(plain), _total(ours)
    print(f"# {args.op} {args.size}, 2 processes x 1 device, {args.calls} calls of loops of "
          f"{args.length}: instructions of process 0 (every thread) per loop step")
    print(f"plain loop step      {plain_ir / steps:10.0f}")
    print(f"jaxcomm loop step    {ours_ir / steps:10.0f}")
    print(f"per collective       {(ours_ir - plain_ir) / steps:10.0f}")
    print(f"\n# inclusive instructions per collective, top {args.top} functions of the jaxcomm loop")
    for row in _top(ours, steps, args.top):
        print(row)
    if not args.keep:
        shutil.rmtree(out_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
