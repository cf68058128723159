"""One case of the benchmark, every side measured alike: compile, agree, check, take
turns, fit (the method of :mod:`jaxcomm.bench.method`).

Both drivers call :func:`measure`: one process (:mod:`jaxcomm.bench.collectives`, with
:class:`LocalSync`) and a job of several (:mod:`jaxcomm.bench.multiprocess`, whose syncs
go through MPI or jax.distributed's key-value store). A side is a jitted program
``f(x, steps)`` running ``steps`` collectives chained in a ``lax.fori_loop``: one
compiled program per side serves every loop length, which is a device scalar argument,
so the lengths of a side differ only in their trip count.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Protocol, Sequence

from jaxcomm.bench import common, method


class Sync(Protocol):
    """How the processes of a job keep in step: one barrier, one all-gather."""

    def barrier(self) -> None: ...

    def all_gather(self, value: Any) -> list[Any]:
        """``value`` of every process, by rank (a JSON-serialisable value)."""
        ...


class LocalSync:
    """A job of one process: nothing to wait for."""

    def barrier(self) -> None:
        pass

    def all_gather(self, value: Any) -> list[Any]:
        return [value]


@dataclasses.dataclass
class Side:
    """One side of a case.

    Attributes:
      program: ``f(x, steps)``, jitted.
      operand: its ``x``.
      steps: the ``steps`` argument for a loop length n.
      local_result: this process's part of a result, for comparing the sides.
    """

    program: Callable[[Any, Any], Any]
    operand: Any
    steps: Callable[[int], Any]
    local_result: Callable[[Any], Any]


def agree(sync: Sync, failures: dict[str, str]) -> dict[str, str]:
    """Every process's failed sides: a side that failed anywhere is dropped everywhere
    (the others would wait for it in its collectives)."""
    merged: dict[str, str] = {}
    everyone = sync.all_gather(failures)
    for rank, theirs in enumerate(everyone):
        for side, msg in theirs.items():
            merged.setdefault(side, f"process {rank}: {msg}" if len(everyone) > 1 else msg)
    return merged


def measure(sides: dict[str, Side], lengths: Sequence[int], rounds: int, warmup: int,
            sync: Sync, compare: Callable[[Any, Any], bool] | None,
            ours: str = "jaxcomm", unchecked: Sequence[str] = ("plain",)) -> dict[str, Any]:
    """Compiles, checks and times every side over ``lengths``; the case's record.

    ``compare(ours_result, their_result)`` (None: no check) decides, in every process,
    whether a side's first result (the shortest loop's) equals ``ours``'s; ``match``
    holds, per side not in ``unchecked``, whether it did in all of them.

    Returns ``lengths``, ``sides`` (per side: ``per_call_us`` a, ``per_collective_us``
    b, ``medians_us`` and ``fastest_us`` per length), ``<side>_per_call_us``,
    ``<side>_per_collective_us``, ``<side>_best_per_collective_us`` (b through each
    length's fastest call), ``match`` and ``error`` (None, or what failed; a failed
    side has no figures).
    """
    import jax

    rec: dict[str, Any] = dict(lengths=list(lengths), sides={}, match={}, error=None)
    failures: dict[str, str] = {}
    firsts: dict[str, Any] = {}
    steps = {side: {m: s.steps(m) for m in lengths} for side, s in sides.items()}
    # Called through jit, not compiled ahead: mpi4jax's ordered effects need jit's calling
    # convention (a token argument), and every side pays for the same dispatch path.
    for name, side in sides.items():
        try:
            firsts[name] = side.local_result(jax.block_until_ready(
                side.program(side.operand, steps[name][lengths[0]])))
            for m in lengths:
                for _ in range(warmup):
                    jax.block_until_ready(side.program(side.operand, steps[name][m]))
        except Exception as exc:
            failures[name] = common.short_error(exc)
        # Agreed side by side: a later side must not start its collectives in a process
        # whose peers gave up on an earlier one.
        failures.update(agree(sync, {name: failures[name]} if name in failures else {}))
    live = [s for s in sides if s not in failures]
    for name in failures:
        firsts.pop(name, None)
    if compare is not None and ours in firsts:
        for name in firsts:
            if name == ours or name in unchecked:
                continue
            try:
                ok = bool(compare(firsts[ours], firsts[name]))
            except Exception:  # a shape or dtype mismatch is a wrong result too
                ok = False
            rec["match"][name] = all(sync.all_gather(ok))
    firsts.clear()
    errors = [f"{name}: {msg}" for name, msg in failures.items()]
    spans: dict[str, dict[int, list[tuple[float, float]]]] = {s: {m: [] for m in lengths} for s in live}
    try:
        for r in range(rounds):
            for name in method.turn_order(live, r):
                side = sides[name]
                for m in lengths:
                    sync.barrier()
                    t0 = time.perf_counter()
                    out = side.program(side.operand, steps[name][m])
                    jax.block_until_ready(out)
                    t1 = time.perf_counter()
                    del out  # freed before the next call allocates its own
                    spans[name][m].append((t0, t1))
    except Exception as exc:
        errors.append(f"while timing: {common.short_error(exc)}")
        spans = {}
    everyone = sync.all_gather({s: {str(m): v for m, v in by.items()} for s, by in spans.items()})
    for name in spans:
        samples = {m: call_times_us([e[name][str(m)] for e in everyone]) for m in lengths}
        fill_side(rec, name, samples)
    rec["error"] = "; ".join(errors) or None
    return rec


def jaxcomm_rounds(op: str, reset: bool = True) -> dict[str, int]:
    """This process's jaxcomm rounds of ``op`` since the last reset, by how their data
    moved (``jaxcomm.stats()``'s algorithm: "shm", "tcp", "in-process zero-copy", ...):
    proof that a side called jaxcomm ran jaxcomm's own transport, and which path.
    Empty where the flight recorder is off."""
    import jaxcomm
    rounds: dict[str, int] = {}
    for s in jaxcomm.stats(reset=reset):
        if s.op == op:
            rounds[s.algorithm] = rounds.get(s.algorithm, 0) + s.calls
    return rounds


def call_times_us(per_process: Sequence[Sequence[Sequence[float]]]) -> list[float]:
    """The time of each call of a job: from the last process's dispatch to the last
    process's result (the processes of one machine share the monotonic clock), so a side
    is not charged with how unevenly the previous call ended. ``per_process``: each
    process's ``(start, end)`` per call, in seconds."""
    return [(max(t1 for _, t1 in call) - max(t0 for t0, _ in call)) * 1e6
            for call in zip(*per_process)]


def fill_side(rec: dict[str, Any], side: str, samples: dict[int, list[float]]) -> None:
    """Fits a side's call times (us, per loop length) into ``rec``: a and b through the
    medians, and b through each length's fastest call (what the side does when the
    machine leaves it alone; on a loaded machine the medians show the load too)."""
    f = method.fit(samples)
    best = method.fit({m: [min(ts)] for m, ts in samples.items() if ts})
    rec["sides"][side] = {"per_call_us": f.per_call_us, "per_collective_us": f.per_collective_us,
                          "medians_us": {str(m): t for m, t in f.medians_us.items()},
                          "fastest_us": {str(m): t for m, t in best.medians_us.items()}}
    rec[f"{side}_per_call_us"] = f.per_call_us
    rec[f"{side}_per_collective_us"] = f.per_collective_us
    rec[f"{side}_best_per_collective_us"] = best.per_collective_us
