"""``jaxcomm.stats()``: per-op, per-group counters of this process's collectives.

The numbers come from the flight recorder's sites (ffi/core/flight_recorder.h), which
count every round this process took part in, also those that fell out of the ring.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from jaxcomm import _jaxcomm
from jaxcomm._src import config


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for ``op`` over ``n`` ranks (nccl-tests conventions)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "ragged_all_to_all"):
        return (n - 1) / n
    return 1.0  # ppermute (a shift), broadcast, MoE transport


def message_bytes(op: str, operand_bytes: int, n: int) -> int:
    """The nccl-tests "size" of one call from one rank's operand bytes.

    all_gather counts its output (n operands); every other op its operand.
    """
    return operand_bytes * n if op == "all_gather" else operand_bytes


@dataclasses.dataclass(frozen=True)
class OpStats:
    """Counters of one op over one group and algorithm, summed over the call sites.

    Attributes:
      op: the jaxcomm op (``"all_reduce"``, ...).
      group: the partitions of the group, in rank order.
      axis: the axis name(s) as written at the (first) call site.
      algorithm: how the data moved (``"in-process zero-copy"``, ``"shm"``, ``"shm stream"``
        (operands of 1 MiB and more per rank, streamed through shared memory in chunks),
        ``"tcp"``, ``"shm+tcp"``, ``"hierarchical shm+tcp"`` (across hosts, in phases
        through the hosts' leaders), ``"tcp reduce-scatter+all-gather"`` (all_reduce of
        512 KiB and more per rank over three or more processes linked by TCP)).
      calls: rounds completed or failed (one per execution of the group, not per rank).
      failed: rounds that failed (timeouts, transport errors).
      bytes: message bytes (nccl-tests "size") summed over the completed rounds.
      total_us: time of the completed rounds, each from the last local rank's arrival
        (the data movement's start) to completion: the collective's own duration.
      wait_us: time from each round's first local arrival to its start: waiting for
        late ranks (and, across processes, for the other processes).
      mean_us: total_us / completed rounds.
      algbw_gbps, busbw_gbps: bytes / total_us, and busbw as nccl-tests (GB = 1e9 B).
    """

    op: str
    group: tuple[int, ...]
    axis: str
    algorithm: str
    calls: int
    failed: int
    bytes: int
    total_us: float
    wait_us: float
    mean_us: float
    algbw_gbps: float
    busbw_gbps: float


def _aggregate(sites: Iterable[dict[str, Any]]) -> list[OpStats]:
    # Calls of one op over one group that moved data differently (e.g. small ones copied
    # whole and large ones streamed) are counted apart: their speeds differ.
    acc: dict[tuple[str, tuple[int, ...], str], dict[str, Any]] = {}
    for s in sites:
        n = len(s["group"])
        key = (s["op"], tuple(s["group"]), s["algorithm"])
        a = acc.setdefault(key, dict(axis=s["axis"], calls=0, failed=0, bytes=0, busy=0, wait=0))
        a["calls"] += s["calls"]
        a["failed"] += s["failed"]
        a["bytes"] += message_bytes(s["op"], s["bytes"], n)
        a["busy"] += s["busy_us"]
        a["wait"] += s["wait_us"]
    out = []
    for (op, group, algorithm), a in sorted(acc.items()):
        if a["calls"] == 0:
            continue
        done = a["calls"] - a["failed"]
        algbw = a["bytes"] / (a["busy"] * 1e-6) / 1e9 if a["busy"] > 0 else 0.0
        out.append(OpStats(op=op, group=group, axis=a["axis"], algorithm=algorithm,
                           calls=a["calls"], failed=a["failed"], bytes=a["bytes"],
                           total_us=float(a["busy"]), wait_us=float(a["wait"]),
                           mean_us=a["busy"] / done if done else 0.0,
                           algbw_gbps=algbw, busbw_gbps=algbw * bus_factor(op, len(group))))
    return out


def stats(reset: bool = False) -> list[OpStats]:
    """Per op, group and algorithm: calls, bytes, total and mean time, bus bandwidth of this process.

    Counts every round since start (or the last reset), also when the flight recorder's
    ring has wrapped; nothing is counted while recording is off (JAXCOMM_TRACE_ENTRIES=0
    or ``jaxcomm.trace.set_enabled(False)``). ``reset=True`` returns the counters and
    zeroes them.

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
        >>> f = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, "x"), mesh=mesh,
        ...                           in_specs=P("x"), out_specs=P()))
        >>> _ = jaxcomm.stats(reset=True)         # start counting from here
        >>> _ = jax.block_until_ready(f(x))
        >>> [(s.op, s.group, s.calls) for s in jaxcomm.stats()]
        [('all_reduce', (0, 1, 2, 3, 4, 5, 6, 7), 1)]
    """
    sites = list(_jaxcomm.trace_stats())
    if config.emulate_cuda():  # the emulated CUDA backend's calls (its own extension)
        from jaxcomm._src.backends import cuda_emulated
        sites += cuda_emulated.trace_stats()
    out = _aggregate(sites)
    if reset:
        reset_stats()
    return out


def reset_stats() -> None:
    """Zeroes the counters behind :func:`stats`."""
    _jaxcomm.trace_reset_stats()
    if config.emulate_cuda():
        from jaxcomm._src.backends import cuda_emulated
        cuda_emulated.reset_stats()
