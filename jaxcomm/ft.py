"""Fault-tolerant collectives for data-parallel replicas in multi-process jobs.

``jaxcomm.ft.all_reduce(x, axis_name)`` sums over the processes that are still alive and
on time, returns which contributed, and leaves the failed ones out of later calls.
Survivors keep running only if JAX itself keeps them alive: start the job with
``jaxcomm.init(recoverable=True)`` (JAX's ``jax_enable_recoverability``), and launch it so
that one process's death does not end the others (``python -m jaxcomm.launch
--keep-going``). ``jaxcomm.ft.excluded()`` lists the processes left out so far.
"""

from __future__ import annotations

from jaxcomm import _jaxcomm
from jaxcomm._src.ops.ft import all_reduce

__all__ = ["all_reduce", "excluded"]


def excluded() -> list[int]:
    """Process indices this process has left out after they failed in ft.all_reduce."""
    return sorted(_jaxcomm.excluded_processes())
