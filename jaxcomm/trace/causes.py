"""What jaxcomm's errors say about other processes, and which failure caused which.

A jaxcomm error about another process names it the same way everywhere
(``ffi/cpu/transport/world.cc``, ``world_stream.cc``)::

    process 3 (host vm (10.0.0.2), pid 4711) with ranks [3] (partitions [3]) failed: it
    exited before it arrived at this call

:func:`blames` reads every process an error names and what it says of it (``dead``,
``missing``, ``mismatch``, ``excluded``). :func:`consequences` then orders the failures of
a job by cause: a process whose own error names another process, before anyone named
it, failed because of that other process (it gave up waiting for it, then exited, and
the others saw it exit). The flight recorder's analyzer and the launcher's summary both
use it. :func:`clean` (from the library, ``jaxcomm._src.error_text``) strips what JAX's
asynchronous dispatch wraps around an error.

A mismatch error (different collectives on different processes, each waiting for the
other; ``ffi/core/mismatch.h``) starts with ``MISMATCH:`` and names each side the same
way, followed by `` waits in <op> at <call site> (execution #N)``; :func:`blames` reads
every side, this process's own included::

    MISMATCH: process 0 (host h, pid 7) with ranks [0] (partitions [0]) waits in
    all_reduce at train.py:9 (step) (execution #1, this call); process 1 (host h, pid 8)
    with ranks [1] (partitions [1]) waits in all_gather at train.py:12 (step)
    (execution #1); each side waits for the other, ...

Example::

    >>> [(b.kind, b.process) for b in blames(
    ...     "process 3 (host h, pid 7) with ranks [3] (partitions [3]) failed: it exited "
    ...     "before it arrived at this call")]
    [('dead', 3)]
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable

# The text of jaxcomm's errors is the library's (jaxcomm/_src/error_text.py); the
# analysis here builds on it, and re-exports what its users call from here.
from jaxcomm._src.error_text import clean, is_jaxcomm_error, is_mismatch

__all__ = ["Blame", "Failure", "blames", "clean", "consequences", "is_jaxcomm_error",
           "is_mismatch", "root_of"]

_PROCESS = re.compile(r"process (\d+) \(host [^,]*, pid (\d+)\) with ranks \[([^\]]*)\] "
                      r"\(partitions \[([^\]]*)\]\)")
# What follows a process's description says what happened to it; the phases of a
# hierarchical or scatter-gather round add what the process is to this call first
# ("(the leader of its host)", "(reduce-scatter)": ffi/core/hierarchical.cc,
# scatter_gather.cc).
_ROLE = r"(?: \((?:the leader of (?:its|this) host|reduce-scatter|all-gather)\))?"
_DEAD = re.compile(_ROLE + r"(?: failed: |: (?=connection (?:closed|reset)))")
_ARRIVED = re.compile(r" (after|before) it arrived at this call")
_MISMATCH_SIDE = re.compile(r" (?:runs a different collective|waits in (\S+) at (.*?)"
                            r"(?: \(execution #(\d+)(?:, this call)?\))?(?:;|$))")
_EXCLUDED = re.compile(_ROLE + r" was left out of the job")
@dataclasses.dataclass(frozen=True)
class Blame:
    """One process an error names, and what it says of it.

    Attributes:
      kind: ``dead`` (it exited or its connection closed), ``missing`` (it never arrived
        at the call, or is behind: the error timed out waiting for it), ``mismatch`` (it
        runs another collective), ``excluded`` (left out after an earlier
        fault-tolerant failure).
      process: its process index; pid: its pid.
      partitions: its ranks' partition ids.
      arrived: for ``dead``: whether it had arrived at the call (None: not said).
      call_site, op, execution: for ``MISMATCH`` errors, where that side waits.
      said: for ``dead``: what the error says happened (``it exited``, ``connection
        closed by the peer (its process exited?)``).
    """

    kind: str
    process: int
    pid: int
    partitions: tuple[int, ...]
    arrived: bool | None = None
    call_site: str = ""
    said: str = ""
    op: str = ""
    execution: int = 0


def blames(error: str | None) -> list[Blame]:
    """Every process ``error`` names, in order, with what it says of each.

    Example::

        blames("timed out (...) waiting for process 2 (host h, pid 9) with ranks [2] "
               "(partitions [2]), which did not arrive at this call")
        # [Blame(kind='missing', process=2, pid=9, partitions=(2,))]
    """
    if not error:
        return []
    out = []
    for m in _PROCESS.finditer(error):
        after = error[m.end():m.end() + 400]
        process, pid = int(m.group(1)), int(m.group(2))
        parts = tuple(int(p) for p in m.group(4).replace(",", " ").split())
        if (dead := _DEAD.match(after)) is not None:
            arrived = _ARRIVED.search(after)
            said = _ARRIVED.split(after[dead.end():], 1)[0].split(";", 1)[0].strip()
            said += ")" * (said.count("(") - said.count(")"))
            out.append(Blame("dead", process, pid, parts,
                             None if arrived is None else arrived.group(1) == "after", said=said))
        elif (side := _MISMATCH_SIDE.match(after)) is not None:
            out.append(Blame("mismatch", process, pid, parts, call_site=(side.group(2) or "").strip(),
                             op=side.group(1) or "", execution=int(side.group(3) or 0)))
        elif _EXCLUDED.match(after):
            out.append(Blame("excluded", process, pid, parts))
        else:
            out.append(Blame("missing", process, pid, parts))
    return out


@dataclasses.dataclass
class Failure:
    """A failure one process reported: when (``time_us``) and the processes it named."""

    process: int
    time_us: float
    blamed: list[Blame]


def consequences(failures: Iterable[Failure]) -> dict[int, tuple[float, list[int]]]:
    """The processes whose failure was a consequence of another process's.

    A process is a consequence when its own error named another process before anyone
    named it as missing: it gave up because of that process (waited for it, saw it
    exit). That others then saw it exit ("it exited after it arrived") follows from its
    error and needs no clock: a process reported dead that had reported an error of its
    own reported it first. A mismatch names no cause: both sides are at fault.

    Returns ``{process: (time its first such error was reported, [processes it named])}``.
    """
    missing_at: dict[int, float] = {}  # when someone first timed out waiting for it
    names: dict[int, tuple[float, list[int]]] = {}
    for f in failures:
        others = sorted({b.process for b in f.blamed
                         if b.process != f.process and b.kind != "mismatch"})
        for b in f.blamed:
            if b.process != f.process and b.kind == "missing":
                missing_at[b.process] = min(missing_at.get(b.process, math.inf), f.time_us)
        if others and (f.process not in names or f.time_us < names[f.process][0]):
            names[f.process] = (f.time_us, others)
    return {p: v for p, v in names.items() if v[0] <= missing_at.get(p, math.inf)}


def root_of(process: int, secondary: dict[int, tuple[float, list[int]]]) -> list[int]:
    """The processes a consequence leads back to (``[process]`` when it is a cause)."""
    roots: list[int] = []
    seen: set[int] = set()
    todo = [process]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        if p in secondary:
            todo.extend(secondary[p][1])
        else:
            roots.append(p)
    # A cycle of consequences (each named another first) has no outside cause: keep them.
    return sorted(roots) or sorted(seen)
