"""jaxcomm benchmarks: ``python -m jaxcomm.bench [moe] ...``.

Subcommands:

* (none) -- collectives, jaxcomm against XLA's native ones (:mod:`jaxcomm.bench.collectives`);
  ``python -m jaxcomm.bench --help``.
* ``moe`` -- MoE dispatch/combine (:mod:`jaxcomm.bench.moe`, where installed).

From Python (after jax is initialised, e.g. with 8 emulated CPU devices)::

    from jaxcomm import bench
    records = bench.run(["all_reduce", "ppermute"], "4B:4KiB", devices=8, iters=5)
    bench.report.print_tables(records)

:func:`run` and :mod:`report` are imported on first use, so importing this package does
not import jax's submodules before the command line has configured the process.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ALL_OPS", "collectives", "common", "report", "run"]


def __getattr__(name: str) -> Any:
    if name in ("run", "ALL_OPS"):
        return getattr(importlib.import_module("jaxcomm.bench.collectives"), name)
    if name in ("collectives", "common", "report"):
        return importlib.import_module(f"jaxcomm.bench.{name}")
    raise AttributeError(f"module 'jaxcomm.bench' has no attribute {name!r}")
