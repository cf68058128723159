"""The host backend (ffi/cpu): every op of the table, every dtype of at least a byte, any
group; across processes, through jaxcomm's host transports (shared memory or TCP), which
a program links when it is lowered."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxcomm._src import bootstrap, groups, runtime
from jaxcomm._src.backends import Backend


class CpuBackend(Backend):
    platform = "cpu"
    jax_backend = "cpu"

    def available(self) -> bool:
        return True

    def register(self) -> None:
        runtime.ensure_registered()

    def prepare_lowering(self, op: str, replica_groups: Sequence[Sequence[int]], axis_context: Any,
                         timeout_ms: int) -> np.ndarray:
        peers = groups.peer_processes(axis_context, tuple(tuple(g) for g in replica_groups))
        if peers:
            bootstrap.ensure_linked(peers)
        return groups.partition_devices(axis_context, "cpu")


BACKEND = CpuBackend()
