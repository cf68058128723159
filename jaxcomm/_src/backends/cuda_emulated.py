"""The CUDA backend on the CPU emulation of the CUDA runtime (``JAXCOMM_EMULATE_CUDA=1``).

The CUDA backend's handlers (ffi/cuda/), built against the emulated runtime
(ffi/cuda_emu/) into the ``_jaxcomm_emu`` extension, registered with XLA:CPU for
platform ``cpu`` in place of the host backend's: every op the CUDA backend has a handler
for runs its code (routes, streams, events, kernels) under ``jax.jit`` on CPU. The ops
it has no handler for (the host backend's own: the fused MoE dispatch, ft.all_reduce)
keep the host handlers. ``jaxcomm.stats()`` prefixes these calls' algorithm with
``cuda (emulated): ``.

Jobs of several processes take the CUDA backend's routes between processes: the same
setup as on GPUs (cuda_runtime.prepare_lowering with :data:`cuda_runtime.EMULATED`:
devices published in the key-value store, NCCL ids exchanged for the mock NCCL, host
links for the CUDA IPC route). XLA:CPU's device k of a process is its emulated GPU k,
which ``CUDA_VISIBLE_DEVICES`` maps to a physical emulated GPU as CUDA does (so that
processes can hold distinct GPUs, as NCCL requires of its ranks). The XLA seam stages
every buffer of a call in emulated device memory (ffi/cuda_emu/seam/staging.h), so that
the CUDA IPC route can export it.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Sequence

import jax
import numpy as np

from jaxcomm._src import cuda_runtime, runtime
from jaxcomm._src.backends import Backend
from jaxcomm._src.backends import cpu as cpu_backend
from jaxcomm._src.backends import cuda as cuda_backend

#: What jaxcomm.stats() puts before the route of an emulated call.
ALGORITHM_PREFIX = "cuda (emulated): "


def module() -> ModuleType:
    """The ``_jaxcomm_emu`` extension (built by every ``pip install .``)."""
    from jaxcomm import _jaxcomm_emu
    return _jaxcomm_emu


def _cuda_ops() -> frozenset[str]:
    from jaxcomm._src.ops import table
    return frozenset(name for name, entry in table._load()[0].items() if "cuda" in entry.backends)


class EmulatedCudaBackend(Backend):
    """Platform ``cpu`` served by the CUDA backend's code (see the module docstring)."""

    platform = "cpu"
    jax_backend = "cpu"
    #: The op table's backends this one serves (both: the host handlers fill the gaps).
    table_names = ("cpu", "cuda")

    def available(self) -> bool:
        return True

    def fallback_reason(self, op: str, dtype: Any, group_size: int | None) -> str:
        if op.replace(".", "_") not in _cuda_ops():
            return cpu_backend.BACKEND.fallback_reason(op, dtype, group_size)
        return cuda_backend.CudaBackend.reason(op, dtype, group_size, cuda_runtime.EMULATED)

    def register(self) -> None:
        ensure_registered()

    def prepare_lowering(self, op: str, replica_groups: Sequence[Sequence[int]], axis_context: Any,
                         timeout_ms: int) -> np.ndarray:
        # XLA:CPU's device k (of this process) is emulated GPU k.
        return cuda_runtime.prepare_lowering(op, replica_groups, axis_context, timeout_ms,
                                             flavor=cuda_runtime.EMULATED)


@functools.cache
def ensure_registered() -> None:
    """Registers the emulated CUDA handlers (and the host ones of the ops CUDA lacks) with
    XLA:CPU, once."""
    emu = module()
    runtime.check_configuration()
    jax.devices("cpu")  # the FFI type registry lives in the CPU client
    from jaxcomm import _jaxcomm
    jax.ffi.register_ffi_type("jaxcomm_instruction_state", _jaxcomm.state_type(), platform="cpu")
    jax.ffi.register_ffi_type("jaxcomm_cuda_instruction_state", emu.cuda_state_type(), platform="cpu")
    cuda_targets = emu.emu_cuda_targets()
    for op, stages in _jaxcomm.cpu_targets().items():
        if op not in cuda_targets:
            jax.ffi.register_ffi_target(runtime.target_name(op), stages, platform="cpu")
            runtime.mark_batch_partitionable(runtime.target_name(op))
    for op, stages in cuda_targets.items():
        jax.ffi.register_ffi_target(runtime.target_name(op), stages, platform="cpu")
        runtime.mark_batch_partitionable(runtime.target_name(op))
    for op, stages in emu.emu_cuda_local_targets().items():
        jax.ffi.register_ffi_target(runtime.target_name(op), stages, platform="cpu")
    _jaxcomm.set_process_index(jax.process_index())
    emu.set_process_index(jax.process_index())
    # XLA:CPU tells a handler its device's id in the job; the CUDA backend wants the local
    # ordinal (its CUDA device), as XLA:GPU gives it.
    emu.emu_set_local_devices([d.id for d in jax.local_devices(backend="cpu")])
    # The CUDA IPC route meets its peers over the host backend's links (bootstrap.py links
    # them into _jaxcomm's registry); this module's own registry borrows them.
    emu.emu_borrow_cross_process(_jaxcomm.cross_process_capsule())


def trace_stats() -> list[dict[str, Any]]:
    """The emulated calls' flight-recorder sites, their algorithm prefixed (stats.py)."""
    rows = []
    for s in module().trace_stats():
        s = dict(s)
        s["algorithm"] = ALGORITHM_PREFIX + s["algorithm"]
        rows.append(s)
    return rows


def reset_stats() -> None:
    module().trace_reset_stats()


def strict_violations() -> list[str]:
    """Takes the emulated runtime's strict-check reports (misuse of the CUDA API) so far."""
    return list(module().emu_strict_violations())


BACKEND = EmulatedCudaBackend()
