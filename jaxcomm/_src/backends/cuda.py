"""The CUDA backend (ffi/cuda; Python side in cuda_runtime.py): the table's ops that it has
handlers for, on dtypes NCCL can reduce, in groups its routes serve (ragged_all_to_all:
one rank; the MoE transport: where its kernels reach every peer). At lowering, groups
spanning processes get their NCCL id or host links (cuda_runtime.prepare_lowering)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxcomm._src import cuda_runtime
from jaxcomm._src.backends import Backend

#: Ops that reduce, and so need a dtype NCCL can reduce.
_REDUCING = ("all_reduce", "reduce_scatter")


class CudaBackend(Backend):
    platform = "cuda"
    jax_backend = "gpu"

    def available(self) -> bool:
        return cuda_runtime.available()

    def fallback_reason(self, op: str, dtype: Any, group_size: int | None) -> str:
        return self.reason(op, dtype, group_size)

    @staticmethod
    def reason(op: str, dtype: Any, group_size: int | None,
               flavor: cuda_runtime.Flavor = cuda_runtime.GPU) -> str:
        """fallback_reason of the CUDA backend's build ``flavor`` (the emulation's too)."""
        if op in _REDUCING and dtype is not None and not cuda_runtime.nccl_reducible(dtype):
            return f"NCCL cannot reduce {np.dtype(dtype).name}"
        if not cuda_runtime.serves(op, group_size, flavor):
            return f"the CUDA handler does not serve groups of {group_size}"
        return ""

    def register(self) -> None:
        cuda_runtime.ensure_registered()

    def prepare_lowering(self, op: str, replica_groups: Sequence[Sequence[int]], axis_context: Any,
                         timeout_ms: int) -> np.ndarray:
        return cuda_runtime.prepare_lowering(op, replica_groups, axis_context, timeout_ms)


BACKEND = CudaBackend()
