"""jaxcomm benchmarks: ``python -m jaxcomm.bench [subcommand] ...``.

Subcommands:

* (none) -- collectives: in one process against XLA's own (:mod:`jaxcomm.bench.collectives`),
  with ``--processes N`` across processes against gloo, mpi4jax and a plain jit
  (:mod:`jaxcomm.bench.multiprocess`); both by the method of :mod:`jaxcomm.bench.method`.
  ``python -m jaxcomm.bench --help``.
* ``docs`` -- every table of docs/benchmarks.md in one run (:mod:`jaxcomm.bench.docs`).
* ``instructions`` -- instructions per collective across two processes, counted by
  callgrind (:mod:`jaxcomm.bench.instructions`).
* ``moe`` -- MoE dispatch/combine (:mod:`jaxcomm.bench.moe`, where installed).
* ``dropin`` -- a data-parallel step's ``jax.lax.pmean`` with and without
  ``jaxcomm.use_for_lax()`` (:mod:`jaxcomm.bench.dropin`).
* ``faults`` -- fault detection across 4 processes and the flight recorder's overhead
  (:mod:`jaxcomm.bench.faults`).
* ``startup`` -- ``jaxcomm.init()`` and a first collective at N processes against
  ``jax.distributed.initialize`` and a first gloo psum: time, key-value operations,
  connections, memory (:mod:`jaxcomm.bench.startup`).

The list the command line knows is :data:`jaxcomm.bench.options.SUBCOMMANDS`.

From Python (after jax is initialised, e.g. with 8 emulated CPU devices)::

    from jaxcomm import bench
    records = bench.run(["all_reduce", "ppermute"], "4B,4KiB", devices=8, rounds=5)
    bench.report.print_report(records)

:func:`run` and :mod:`report` are imported on first use, so importing this package does
not import jax's submodules before the command line has configured the process.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ALL_OPS", "collectives", "common", "measure", "method", "options", "report", "run"]


def __getattr__(name: str) -> Any:
    if name in ("run", "ALL_OPS"):
        return getattr(importlib.import_module("jaxcomm.bench.collectives"), name)
    if name in ("collectives", "common", "measure", "method", "options", "report"):
        return importlib.import_module(f"jaxcomm.bench.{name}")
    raise AttributeError(f"module 'jaxcomm.bench' has no attribute {name!r}")
