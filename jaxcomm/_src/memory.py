"""``jaxcomm.memory()``: the bytes this process holds for its collectives.

Everything is allocated on first use: nothing before a program with a cross-process group
runs (no control block, no listener buffers), nothing for a call site that never ran, a
flight recorder ring only for a rank that recorded a call. Shared-memory data segments
grow by generations as calls need buffers, and are bounded, with the TCP links'
early-frame budget, by ``JAXCOMM_COMM_MEMORY_MB`` (docs/configuration.md).
"""

from __future__ import annotations

import dataclasses

from jaxcomm import _jaxcomm


@dataclasses.dataclass(frozen=True)
class CommMemory:
    """What one process holds for communication, in bytes.

    Attributes:
      shm_control: its shared-memory control block (slot table, wait board, doorbell);
        0 until a program links another process of its host.
      shm_data: its shared-memory data segments, as mapped (pages are committed only
        when written, so the resident part is at most this).
      shm_data_used: of ``shm_data``, what its calls' buffers take: two buffers of a
        call's contribution per cross-process call (a stream's ring for large ones).
      link_buffers: what its links hold beyond shared memory: frames waiting in its TCP
        links' inboxes and their reusable buffers.
      staging: buffers kept for reuse between rounds (single-copy reads' bounce buffers;
        a hierarchical round's partial result is not counted).
      recorder: the flight recorder's rings (one per local rank that recorded a call,
        ``JAXCOMM_TRACE_ENTRIES`` entries of 96 B) and its call sites.
      calls: cross-process calls (call site x group) holding shared-memory buffers.
      limit: ``JAXCOMM_COMM_MEMORY_MB`` in bytes, the bound on shared memory and TCP
        early frames.
      total: the sum of shm_control, shm_data, link_buffers, staging and recorder.
    """

    shm_control: int
    shm_data: int
    shm_data_used: int
    link_buffers: int
    staging: int
    recorder: int
    calls: int
    limit: int

    @property
    def total(self) -> int:
        return self.shm_control + self.shm_data + self.link_buffers + self.staging + self.recorder

    def as_dict(self) -> dict[str, int]:
        """The fields and ``total``, e.g. for a JSON record."""
        return {**dataclasses.asdict(self), "total": self.total}


def memory() -> CommMemory:
    """The bytes this process holds for jaxcomm's collectives, now (see :class:`CommMemory`).

    Example (one process, before any cross-process program)::

        >>> import jaxcomm
        >>> m = jaxcomm.memory()
        >>> (m.shm_control, m.shm_data, m.link_buffers)
        (0, 0, 0)
        >>> m.limit == 1024 << 20                 # JAXCOMM_COMM_MEMORY_MB's default
        True
    """
    return CommMemory(**_jaxcomm.memory_report())
