"""How every comparison in jaxcomm's benchmarks is measured, whoever the peer is.

A collective's cost to a program has two parts that a single timing mixes up: what each
collective costs (the transport), and what each call of the jitted program costs however
many collectives it runs (dispatch, argument handling, a library's own setup per call).
A loop of 100 collectives in one program hides 100x less of the second than one call,
and a peer with a large fixed cost per call (mpi4jax's ordered effects: about 290 us
here, against 7-9 us for a plain jit) then looks slow per collective when it is not.

So each side is timed as programs of several loop lengths n (by default 1, 10, 100 and
1000 collectives chained in a ``lax.fori_loop``; fewer for large messages), and the
median time of a call of each length is fitted as ``a + b * n``: ``b`` is the cost of one
collective, ``a`` the fixed cost of a call. Every side gets the same lengths, inputs,
loop body and process placement, and the sides take turns round by round in an
alternating order (A B C, C B A, A B C, ...) so that drift in the machine's load falls on
all of them alike; each figure is the median over the rounds.

Nothing here imports jax: the plan, the fit and the summaries are plain Python, shared by
the benchmark's drivers and tested on their own.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Iterable, Mapping, Sequence

from jaxcomm.bench.common import format_bytes

#: Loop lengths (collectives per jitted call) when no size limit applies.
DEFAULT_LENGTHS: tuple[int, ...] = (1, 10, 100, 1000)
#: A length is dropped when its collectives would move more than this many bytes per
#: call (per process and side): 16 MiB messages keep 1 and 10, 1 MiB ones up to 100.
MAX_BYTES_PER_CALL = 256 << 20


def lengths_for(nbytes: int, lengths: Sequence[int] = DEFAULT_LENGTHS,
                max_bytes: int = MAX_BYTES_PER_CALL) -> tuple[int, ...]:
    """The loop lengths timed for messages of ``nbytes``: the two shortest always (a line
    needs two points), longer ones while ``n * nbytes <= max_bytes``.

    >>> lengths_for(4), lengths_for(1 << 20), lengths_for(16 << 20)
    ((1, 10, 100, 1000), (1, 10, 100), (1, 10))
    """
    ordered = sorted(set(int(n) for n in lengths))
    if not ordered or ordered[0] < 1:
        raise ValueError(f"loop lengths must be positive integers, got {list(lengths)}")
    return tuple(n for i, n in enumerate(ordered) if i < 2 or n * nbytes <= max_bytes)


def turn_order(sides: Sequence[str], round_index: int) -> list[str]:
    """The order in which the sides take their turn in round ``round_index``: as given in
    even rounds, reversed in odd ones (A B, B A, A B, ...)."""
    return list(sides) if round_index % 2 == 0 else list(sides)[::-1]


@dataclasses.dataclass(frozen=True)
class Fit:
    """``a + b * n`` through the median call times of a side.

    Attributes:
      per_call_us: ``a``, the fixed cost of one call of the jitted program.
      per_collective_us: ``b``, the cost of one more collective in it.
      medians_us: the median call time per loop length, the points fitted.
    """

    per_call_us: float
    per_collective_us: float
    medians_us: dict[int, float]


def fit(samples_us: Mapping[int, Sequence[float]]) -> Fit:
    """``a + b * n`` through the median of each length's samples.

    ``samples_us``: per loop length n, the call times (us) of the rounds. The medians
    are fitted, not the samples, so a round disturbed by the machine does not pull the
    line. ``b`` is the least-squares slope through the medians, which the longest loops
    decide; ``a`` is the shortest loop's median less its collectives (``t(n_min) - b *
    n_min``), not the line's intercept: the intercept carries the longest loop's noise,
    hundreds of times the fixed cost on a busy machine. With one length, ``b`` is that
    median / n and ``a`` is 0.

    >>> f = fit({1: [12.0, 11.0, 40.0], 10: [30.0, 29.0, 31.0], 100: [210.0]})
    >>> round(f.per_collective_us, 3), round(f.per_call_us, 3)
    (2.0, 10.0)
    """
    medians = {int(n): float(statistics.median(ts)) for n, ts in samples_us.items() if ts}
    if not medians:
        raise ValueError("no samples to fit")
    if len(medians) == 1:
        (n, t), = medians.items()
        return Fit(0.0, t / n, medians)
    xs, ys = list(medians), list(medians.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    shortest = min(medians)
    return Fit(medians[shortest] - b * shortest, b, medians)


def load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages (``/proc/loadavg``), or
    ``"unknown"``: printed with every table, since other work on the machine moves
    every figure."""
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def ratio(peer_us: float | None, ours_us: float | None) -> float | None:
    """``peer / ours`` (above 1: jaxcomm takes less time), or None without both."""
    if peer_us is None or ours_us is None or ours_us <= 0:
        return None
    return peer_us / ours_us


def summary_line(peer: str, rows: Iterable[Mapping[str, object]], ours: str = "jaxcomm") -> str:
    """One line on how ``ours`` fares against ``peer`` per collective, naming every case
    where it is behind, and their fixed costs per call.

    ``rows``: records with ``op``, ``bytes`` and per side ``<side>_per_collective_us``
    and ``<side>_per_call_us`` (None where the side failed).
    """
    ahead, behind, missing, unfit = [], [], [], []
    calls: dict[str, list[float]] = {ours: [], peer: []}
    for r in rows:
        case = f"{r['op']} {format_bytes(int(r['bytes']))}"
        b_peer, b_ours = r.get(f"{peer}_per_collective_us"), r.get(f"{ours}_per_collective_us")
        q = ratio(b_peer, b_ours)  # type: ignore[arg-type]
        if b_peer is None or b_ours is None:
            missing.append(case)
        elif q is None or q <= 0:
            unfit.append(case)  # a slope <= 0: the load, not the collective, made the line
        elif q >= 1:
            ahead.append((q, case))
        else:
            behind.append((q, case))
        for side in calls:
            a = r.get(f"{side}_per_call_us")
            if isinstance(a, (int, float)):
                calls[side].append(float(a))
    total = len(ahead) + len(behind)
    parts = [f"vs {peer}: {ours} faster per collective in {len(ahead)} of {total} cases"]
    if ahead:
        best = max(ahead)
        parts[0] += f" (up to {best[0]:.2f}x, {best[1]})"
    parts.append("behind in " + (", ".join(f"{c} {q:.2f}x" for q, c in sorted(behind))
                                 if behind else "none"))
    if missing:
        parts.append("not measured: " + ", ".join(missing))
    if unfit:
        parts.append("no fit (a slope <= 0): " + ", ".join(unfit))
    if calls[ours] and calls[peer]:
        parts.append(f"fixed cost per call (median over cases) {ours} "
                     f"{statistics.median(calls[ours]):.1f} us, {peer} "
                     f"{statistics.median(calls[peer]):.1f} us")
    return "; ".join(parts)
