"""The host backend (ffi/cpu): every op of the table, every dtype of at least a byte (the
reductions: those its kernels reduce), any group; across processes, through jaxcomm's
host transports (shared memory or TCP), which a program links when it is lowered."""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from jaxcomm._src import bootstrap, groups, runtime
from jaxcomm._src.backends import Backend

#: Ops that reduce with the host kernels (ffi/cpu/kernels.cc), and the dtypes those
#: kernels reduce (bool sums are taken as int32, as psum does). Other dtypes of these ops
#: are jax.lax's to compute (ops/common.py use_xla).
REDUCING = ("all_reduce", "reduce_scatter", "ft.all_reduce")
REDUCIBLE_DTYPES = frozenset(np.dtype(d) for d in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    jnp.float16, jnp.bfloat16, np.float32, np.float64, np.complex64, np.complex128))


class CpuBackend(Backend):
    platform = "cpu"
    jax_backend = "cpu"

    def available(self) -> bool:
        return True

    def fallback_reason(self, op: str, dtype: Any, group_size: int | None) -> str:
        if op in REDUCING and dtype is not None and np.dtype(dtype) not in REDUCIBLE_DTYPES:
            return f"no host kernel reduces {np.dtype(dtype).name}"
        return ""

    def register(self) -> None:
        runtime.ensure_registered()

    def prepare_lowering(self, op: str, replica_groups: Sequence[Sequence[int]], axis_context: Any,
                         timeout_ms: int) -> np.ndarray:
        peers = groups.peer_processes(axis_context, tuple(tuple(g) for g in replica_groups))
        if peers:
            bootstrap.ensure_linked(peers)
        return groups.partition_devices(axis_context, "cpu")


BACKEND = CpuBackend()
