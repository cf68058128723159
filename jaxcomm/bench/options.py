"""The command line of ``python -m jaxcomm.bench`` (collectives), in one process or several.

One parser serves both drivers, so every option means the same in each and ``--help``
lists them all: :mod:`jaxcomm.bench.collectives` runs one process (jaxcomm against XLA's
own collectives on emulated devices), :mod:`jaxcomm.bench.multiprocess` a job of
``--processes N`` (jaxcomm against gloo, mpi4jax and a plain jit). Nothing here imports
jax: the parent of a multi-process job never does.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from jaxcomm.bench import common, method

#: Every op the benchmark knows, in its default order.
ALL_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                            "ppermute", "broadcast")
#: The ops compared by default across processes (broadcast through --ops).
MULTIPROCESS_OPS: tuple[str, ...] = ALL_OPS[:5]
#: Default sizes: one process covers the range the docs' table shows; across processes
#: the four sizes the issue's targets name.
DEFAULT_SIZES = {1: "4B,4KiB,64KiB,1MiB,16MiB,64MiB", "many": "4B,4KiB,1MiB,16MiB"}
LATENCY_SIZES = "4B:4KiB"
#: jaxcomm's deadline per call across processes: a side that cannot complete fails its
#: row in seconds instead of holding every process for JAXCOMM_TIMEOUT_S.
DEFAULT_TIMEOUT_S = 30.0
#: The other benchmarks of ``python -m jaxcomm.bench``: subcommand -> (module, what it
#: measures). Each module has ``main(argv)`` with a ``--help`` of its own, and runs as
#: ``python -m <module>`` too.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "moe": ("jaxcomm.bench.moe",
            "MoE dispatch/combine and a layer's training step, vs a padded all_to_all"),
    "dropin": ("jaxcomm.bench.dropin",
               "a data-parallel step's jax.lax.pmean with and without jaxcomm.use_for_lax()"),
    "faults": ("jaxcomm.bench.faults",
               "how fast 4 processes learn of a fault; the flight recorder's overhead"),
    "docs": ("jaxcomm.bench.docs", "every table of docs/benchmarks.md, measured in one run"),
    "startup": ("jaxcomm.bench.startup",
                "jaxcomm.init() + first collective at N processes, vs jax + gloo; KV ops, links"),
    "tp": ("jaxcomm.bench.tp",
           "a tensor-parallel MLP block: jaxcomm.tp's collective matmuls vs unfused and ring baselines"),
    "instructions": ("jaxcomm.bench.instructions",
                     "instructions per collective across two processes (callgrind)"),
}


def subcommands_help() -> str:
    """The epilog of ``python -m jaxcomm.bench --help``: every sub-benchmark, one a line."""
    width = max(map(len, SUBCOMMANDS))
    lines = ["other benchmarks (python -m jaxcomm.bench SUBCOMMAND --help for their options):"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
    lines += ["", "Sizes are per-device bytes (all_gather: output; reduce_scatter: input). "
              "See docs/benchmarks.md."]
    return "\n".join(lines)


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, but the epilog keeps its lines (one sub-benchmark a line)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" not in text:
            return super()._fill_text(text, width, indent)
        return "\n".join(indent + line for line in text.splitlines())


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m jaxcomm.bench [collectives] [options]``."""
    p = argparse.ArgumentParser(
        prog="python -m jaxcomm.bench [collectives]",
        description="Times jaxcomm's collectives against their peers, every side the same "
                    "way: loops of several lengths n per jitted call, fitted as a + b*n "
                    "(b: per collective, a: fixed per call), the sides in alternating turns, "
                    "medians over rounds. One process (default): against XLA's own "
                    "collectives and a plain jit, on emulated CPU devices. --processes N: "
                    "across N processes on this machine, against gloo (jax.lax), mpi4jax "
                    "(when installed) and a plain jit.",
        epilog=subcommands_help(),
        formatter_class=_Formatter)
    p.add_argument("--processes", type=int, default=1, metavar="N",
                   help="processes of the job: 1 (default) measures in this process; N > 1 "
                        "launches N on this machine (jaxcomm.launch, or mpirun with mpi4jax)")
    p.add_argument("--devices", type=int, default=None, metavar="D",
                   help="CPU devices per process (default 8 in one process, 1 across "
                        "processes; mpi4jax needs 1)")
    p.add_argument("--hosts", type=int, default=1, metavar="H",
                   help="across processes: play H hosts on this machine, the processes split "
                        "into H groups with their own JAXCOMM_HOST_ID (shared memory within "
                        "a group, TCP across; under mpirun, one job with MPI across and one with "
                        "TCP) (default %(default)s)")
    p.add_argument("--ops", default=None,
                   help=f"comma list of ops (default {','.join(ALL_OPS)} in one process, "
                        f"{','.join(MULTIPROCESS_OPS)} across processes)")
    p.add_argument("--sizes", default=None,
                   help="a comma list of sizes, one size, or START:END multiplied by "
                        f"--factor; units B, KiB, MiB, GiB (default {DEFAULT_SIZES[1]} in one "
                        f"process, {DEFAULT_SIZES['many']} across processes)")
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
                   help="across processes: 'cores' binds each process to its share of the "
                        "cores (mpirun --bind-to core, jaxcomm.launch --bind cores), 'none' "
                        "leaves it to the scheduler, 'both' runs each in its own job "
                        "(default %(default)s)")
    p.add_argument("--no-mpi4jax", dest="mpi4jax", action="store_false",
                   help="across processes: do not compare with mpi4jax (compared when mpirun, "
                        "mpi4py and mpi4jax are installed, with --devices 1; the "
                        "job is then started by mpirun)")
    p.add_argument("--no-gloo", dest="gloo", action="store_false",
                   help="across processes: do not compare with jax.lax's collectives (gloo: "
                        "0.1-5 ms each, the longest part of a run with loops of 1000)")
    p.add_argument("--dtype", default="float32", help="element type (default %(default)s)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="jaxcomm's deadline per call (default: JAXCOMM_TIMEOUT_S or 300 in "
                        f"one process, {DEFAULT_TIMEOUT_S:g} across processes)")
    p.add_argument("--hugetlb", choices=("off", "on", "both"), default="off",
                   help="run with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 off, on, or both (one "
                        "process: the setting it was not started with runs in a child "
                        "process; across processes: off or on) (default %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write the records as a JSON list")
    p.add_argument("--show", metavar="FILE",
                   help="print the tables of a run saved with --json (measures nothing)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="plot bus bandwidth per collective against size (needs matplotlib)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="do not compare the peers' results with jaxcomm's")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress display")
    p.add_argument("--targets", action="store_true",
                   help="one process: also check jaxcomm's own performance targets against "
                        "XLA (those of docs/benchmarks.md), met or missed")
    p.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                   help="across processes: launcher grace period after a process fails "
                        "(default %(default)g)")
    # Internal: the workers of a multi-process job, and the child of a one-process run
    # for the other HugeTLB setting.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--launcher", choices=("jaxcomm", "mpi"), default="jaxcomm", help=argparse.SUPPRESS)
    p.add_argument("--emit-json", help=argparse.SUPPRESS)
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parses and checks ``argv``, filling the defaults that depend on --processes; exits
    with status 2 and a message on bad input."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if args.show:
        return args
    many = args.processes > 1
    if args.processes < 1:
        parser.error(f"need --processes >= 1, got {args.processes}")
    if args.devices is None:
        args.devices = 1 if many else 8
    if args.devices < 1:
        parser.error(f"need --devices >= 1, got {args.devices}")
    if not 1 <= args.hosts <= args.processes:
        parser.error(f"need 1 <= --hosts <= --processes, got {args.hosts}")
    if many and args.hugetlb == "both":
        parser.error("--hugetlb both runs in one process only; across processes choose off or on")
    if args.timeout is None and many:
        args.timeout = DEFAULT_TIMEOUT_S
    if args.latency:
        args.ops, args.sizes = "all_reduce", LATENCY_SIZES
    args.ops = args.ops or ",".join(MULTIPROCESS_OPS if many else ALL_OPS)
    args.sizes = args.sizes or DEFAULT_SIZES["many" if many else 1]
    ops = op_list(args)
    bad = [o for o in ops if o not in ALL_OPS]
    if bad or not ops:
        parser.error(f"--ops: unknown op(s) {bad}; choose from {','.join(ALL_OPS)}")
    try:
        common.parse_sizes(args.sizes, args.factor)
        method.lengths_for(1, length_list(args))
    except ValueError as exc:
        parser.error(str(exc))
    if args.rounds < 1 or args.warmup < 0:
        parser.error(f"need --rounds >= 1 and --warmup >= 0, got {args.rounds} and {args.warmup}")
    return args


def op_list(args: argparse.Namespace) -> list[str]:
    return [o.strip() for o in args.ops.split(",") if o.strip()]


def length_list(args: argparse.Namespace) -> list[int]:
    try:
        return [int(v) for v in args.lengths.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--lengths must be a comma list of integers, got {args.lengths!r}") from None
