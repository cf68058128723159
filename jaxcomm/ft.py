"""Fault-tolerant collectives for data-parallel replicas in multi-process jobs.

``jaxcomm.ft.all_reduce(x, axis_name)`` sums over the processes that are still alive and
on time, returns which contributed, and leaves the failed ones out of later calls, until
a restarted process calls ``jaxcomm.ft.rejoin()``.
Survivors keep running only if JAX itself keeps them alive: start the job with
``jaxcomm.init(recoverable=True)`` (JAX's ``jax_enable_recoverability``), and launch it so
that one process's death does not end the others (``python -m jaxcomm.launch
--keep-going``). ``jaxcomm.ft.excluded()`` lists the processes left out so far.
"""

from __future__ import annotations

from jaxcomm import _jaxcomm
from jaxcomm._src import bootstrap
from jaxcomm._src.ops.ft import all_reduce

__all__ = ["all_reduce", "excluded", "rejoin"]


def excluded() -> list[int]:
    """Process indices this process has left out after they failed in ft.all_reduce."""
    return sorted(_jaxcomm.excluded_processes())


def rejoin(timeout_s: float | None = None) -> None:
    """Readmits this process, restarted with its old process index, into the job.

    Call it after ``jaxcomm.init()`` in the replacement of a process the others left out.
    The first ``ft.all_reduce`` of this process then waits (at most ``timeout_s``,
    default JAXCOMM_TIMEOUT_S) until the survivors agree to readmit it, and takes part
    from their next round of that call on; its ``contributed`` mask shows it back. The
    restarted process must run the same program as the survivors (compiled in the same
    order), and should contribute nothing that depends on state it lost: e.g. average
    parameters over the processes that have them in its first step.

    Works over shared memory and TCP alike (the request travels in the survivors'
    control blocks, or as a frame on a new connection to each of them).

    Example (the restarted process, in a job under ``python -m jaxcomm.launch --keep-going``)::

        >>> import jaxcomm
        >>> jaxcomm.init()                               # doctest: +SKIP
        True
        >>> jaxcomm.ft.rejoin()                          # doctest: +SKIP
        >>> total, alive = train_step(params, batch)     # doctest: +SKIP
    """
    bootstrap.rejoin(timeout_s)
