"""Every table of docs/benchmarks.md, measured again in one run: ``python -m jaxcomm.bench docs``.

    python -m jaxcomm.bench docs --out bench-results          # the docs' settings
    python -m jaxcomm.bench docs --out bench-results --quick  # fewer rounds and lengths
    python -m jaxcomm.bench docs --list                       # what it runs, and how long
    python -m jaxcomm.bench docs --only latency,hosts-2       # some of the tables

Runs each table's command (below, :data:`TABLES`) one after the other, prints its
output, and writes into ``--out``: ``<name>.json`` for the collectives tables (the records;
``python -m jaxcomm.bench --show <name>.json`` prints them again) and ``tables.md``, every
table (the MoE ones included) as a
fenced block under its heading, with the command, the date, the machine and the time it
took, ready to replace the docs' blocks. Run it on a quiet machine: every table states
the load average it was measured at, and the docs should quote none taken at a load
above the core count.

``--quick`` runs every table with 3 rounds and loops of 1, 10 and 100 (the fit is then
steered by the loop of 100, the noisier for it): a check that everything runs, and
figures good to about 2x, in a fraction of the time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Sequence

from jaxcomm.bench import method


@dataclasses.dataclass(frozen=True)
class Table:
    """One table of the docs: its name, the section it fills, and the arguments of
    ``python -m jaxcomm.bench`` that measure it (``env``: set for its processes).
    ``records``: the command is the collectives benchmark, which takes ``--rounds``,
    ``--lengths`` and ``--json`` (the MoE benchmark prints its tables only)."""

    name: str
    section: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    minutes: float = 0.0  # an estimate of its duration on the 2-core development VM (--list)
    records: bool = True


#: Every table of docs/benchmarks.md, in the docs' order.
TABLES: tuple[Table, ...] = (
    Table("two-processes", "2 processes x 1 CPU device: everything, both placements",
          ("--processes", "2", "--sizes", "4B,4KiB,1MiB,16MiB"), minutes=30),
    Table("latency", "all_reduce latency, both placements",
          ("--processes", "2", "--ops", "all_reduce", "--sizes", "4B,64B,1KiB,4KiB", "--no-gloo"),
          minutes=6),
    Table("latency-no-inline", "all_reduce latency without the inline path (JAXCOMM_INLINE=0)",
          ("--processes", "2", "--ops", "all_reduce", "--sizes", "4B,64B,1KiB,4KiB", "--no-gloo"),
          env=(("JAXCOMM_INLINE", "0"),), minutes=6),
    Table("one-process", "One process, 8 emulated devices, jaxcomm against XLA",
          ("--devices", "8", "--sizes", "4B,4KiB,64KiB,1MiB,16MiB,64MiB", "--targets"), minutes=25),
    Table("four-processes", "4 processes x 1 CPU device",
          ("--processes", "4", "--sizes", "4KiB,1MiB,16MiB", "--bind", "none"), minutes=20),
    Table("hosts-4", "4 processes as 4 hosts (TCP between every pair)",
          ("--processes", "4", "--hosts", "4", "--sizes", "4KiB,1MiB,16MiB", "--bind", "none"),
          minutes=15),
    Table("hosts-2", "4 processes as 2 hosts (shared memory within, TCP across)",
          ("--processes", "4", "--hosts", "2", "--sizes", "4KiB,1MiB,16MiB", "--bind", "none"),
          minutes=15),
    Table("moe-decode", "MoE at decode size: normal, low-latency, FP8 and overlap rows",
          ("moe", "--tokens", "128", "--hidden", "7168", "--topk", "8", "--experts", "256",
           "--devices", "8", "--skip-layer", "--dtype", "float32,bfloat16", "--modes", "all"),
          minutes=6, records=False),
    Table("moe-training", "MoE at training size: dispatch and combine, float32 and bfloat16",
          ("moe", "--tokens", "4096", "--hidden", "1024", "--topk", "8", "--experts", "64",
           "--devices", "8", "--skip-layer", "--dtype", "float32,bfloat16", "--modes", "normal"),
          minutes=6, records=False),
)
QUICK = ("--rounds", "3", "--lengths", "1,10,100")
QUICK_MOE = ("--iters", "2", "--warmup", "1")


def command(table: Table, quick: bool, out_dir: str) -> list[str]:
    """The command line that measures ``table`` into ``out_dir``."""
    cmd = [sys.executable, "-m", "jaxcomm.bench", *table.args]
    if not table.records:
        return cmd + list(QUICK_MOE if quick else ())
    return cmd + [*(QUICK if quick else ()), "--no-progress", "--json",
                  os.path.join(out_dir, f"{table.name}.json")]


def _machine() -> str:
    import importlib.metadata as md
    versions = []
    for pkg in ("jax", "jaxlib", "mpi4jax", "mpi4py"):
        try:
            versions.append(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            pass
    mpirun = shutil.which("mpirun")
    mpi = ""
    if mpirun:
        try:
            mpi = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            mpi = "mpirun (version unknown)"
    return (f"{os.cpu_count()} cpus ({platform.machine()}), Linux {platform.release()}, "
            f"Python {platform.python_version()}, " + ", ".join(versions) + (f", {mpi}" if mpi else ""))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxcomm.bench docs",
                                description=__doc__.split("\n\n")[0],
                                epilog="Tables: " + ", ".join(t.name for t in TABLES))
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help="where the JSON records and tables.md go (default %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help=f"every table with {' '.join(QUICK)} (MoE: {' '.join(QUICK_MOE)})")
    p.add_argument("--only", metavar="NAMES", help="comma list of tables to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the tables and their commands, run nothing")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    tables = list(TABLES)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in {t.name for t in TABLES}]
        if unknown:
            p.error(f"--only: unknown table(s) {unknown}; choose from {', '.join(t.name for t in TABLES)}")
        tables = [t for t in TABLES if t.name in names]
    if args.list:
        for t in tables:
            env = " ".join(f"{k}={v}" for k, v in t.env)
            print(f"{t.name:18} ~{t.minutes:3.0f} min  {(env + ' ') if env else ''}python -m "
                  f"jaxcomm.bench {' '.join(t.args)}   ({t.section})")
        print(f"total ~{sum(t.minutes for t in tables):.0f} min (estimated) on the 2-core development VM "
              "(--quick: about a quarter)")
        return 0
    os.makedirs(args.out, exist_ok=True)
    md = [f"# jaxcomm benchmark tables, {datetime.date.today().isoformat()}"
          + (" (--quick)" if args.quick else ""), "", f"Machine: {_machine()}.", ""]
    failed = []
    start = time.monotonic()
    for t in tables:
        cmd = command(t, args.quick, args.out)
        env = dict(os.environ, **dict(t.env))
        shown = " ".join(f"{k}={v}" for k, v in t.env) + (" " if t.env else "") + \
            "python -m jaxcomm.bench " + " ".join(cmd[3:-2] if t.records else cmd[3:])
        print(f"## {t.name}: {shown}", flush=True)
        began = time.monotonic()
        load_before = method.load_average()
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        minutes = (time.monotonic() - began) / 60
        print(proc.stdout, flush=True)
        if proc.returncode != 0:
            failed.append(t.name)
        md += [f"## {t.section}", "", f"`{shown}` ({minutes:.1f} min, load average "
               f"{load_before} before; exit status {proc.returncode})", "", "```",
               proc.stdout.rstrip(), "```", ""]
        with open(os.path.join(args.out, "tables.md"), "w") as f:
            f.write("\n".join(md) + "\n")
    total = (time.monotonic() - start) / 60
    records = any(t.records for t in tables)
    print(f"# {len(tables)} tables in {total:.1f} min; wrote {args.out}/tables.md"
          + (f" and {args.out}/<table>.json" if records else "")
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
