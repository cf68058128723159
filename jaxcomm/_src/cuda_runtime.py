"""The CUDA backend's Python side: detection, NCCL discovery, FFI registration for
platform "CUDA", and the NCCL unique-id exchange for groups that span processes.

jaxcomm serves platform CUDA with its own handlers only when the extension was built
with them (``JAXCOMM_CUDA``, see CMakeLists.txt) *and* this process has a GPU backend;
otherwise its ops lower to jax.lax there, as before. A CPU-only install never imports or
loads anything CUDA: the extension links the CUDA runtime statically and loads NCCL with
dlopen only when a group of more than one rank first needs a communicator.

Every function here is safe to call without a GPU (and is tested so on CPU).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from typing import Any, Iterable, Sequence

import numpy as np

import jax

from jaxcomm import _jaxcomm

log = logging.getLogger("jaxcomm")


#: Dtypes NCCL cannot reduce (jaxcomm lowers those reductions to jax.lax on CUDA).
_NCCL_UNREDUCIBLE = frozenset(np.dtype(d) for d in (np.int16, np.uint16, np.complex64, np.complex128))

_KV_PREFIX = "jaxcomm/nccl_unique_id/"


def built_with_cuda() -> bool:
    """Whether the extension has the CUDA handlers (it was built with nvcc)."""
    return bool(getattr(_jaxcomm, "has_cuda", lambda: False)())


@functools.cache
def gpu_backend_present() -> bool:
    """Whether this process has a CUDA GPU backend (False without a GPU or plugin)."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return False
    return bool(devices) and all(getattr(d, "platform", "") in ("gpu", "cuda") for d in devices) \
        and "rocm" not in str(getattr(devices[0].client, "platform_version", "")).lower()


def available() -> bool:
    """Whether jaxcomm's CUDA handlers serve GPU programs in this process."""
    return built_with_cuda() and gpu_backend_present()


def nccl_library_path() -> str | None:
    """libnccl.so.2 of the installed nvidia-nccl-cu13 wheel, or None.

    Found without importing the package (the ``nvidia`` namespace package has no code).
    ``JAXCOMM_NCCL_LIBRARY`` names a library to use instead.
    """
    override = os.environ.get("JAXCOMM_NCCL_LIBRARY")
    if override:
        return override
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for root in spec.submodule_search_locations or ():
        for name in ("libnccl.so.2", "libnccl.so"):
            path = os.path.join(root, "lib", name)
            if os.path.exists(path):
                return path
    return None


def serves(op: str, group_size: int | None) -> bool:
    """Whether the CUDA handler of ``op`` serves a group of ``group_size`` ranks.

    ragged_all_to_all: one-rank groups only (larger ones lower to its pure-JAX form). The
    MoE transport: groups whose GPUs are all in this process (peer access; groups across
    processes take the composed transport). Every other op: any group.
    """
    if group_size in (None, 1):
        return True
    if op == "ragged_all_to_all":
        return False
    if op == "moe_transport":
        return jax.process_count() == 1
    return True


def nccl_reducible(dtype: Any) -> bool:
    """Whether NCCL can reduce ``dtype`` (else the reduction lowers to jax.lax on CUDA)."""
    return np.dtype(dtype) not in _NCCL_UNREDUCIBLE


def group_key(group: Sequence[int], partition_devices: np.ndarray) -> str:
    """A group's identity across processes; must equal CudaState::GroupKey (ffi/cuda/comms.cc).

    Args:
      group: partition ids of the members, in rank order.
      partition_devices: flattened (process index, local device id) per partition.
    """
    pd = np.asarray(partition_devices, dtype=np.int64).reshape(-1, 2)
    return "nccl:" + ",".join(f"{int(pd[p, 0])}/{int(pd[p, 1])}" for p in group)


@functools.cache
def ensure_registered() -> None:
    """Registers the CUDA handlers and their state type with XLA's CUDA backend, once."""
    if not available():
        raise RuntimeError("jaxcomm: the CUDA handlers need a build with JAXCOMM_CUDA and a GPU backend")
    from jaxcomm._src import runtime  # late: runtime imports this module
    path = nccl_library_path()
    if path:
        _jaxcomm.cuda_set_nccl_path(path)
    jax.ffi.register_ffi_type("jaxcomm_cuda_instruction_state", _jaxcomm.cuda_state_type(),
                              platform="CUDA")
    from jax._src.lib import xla_client  # CustomCallTargetTraits has no public home
    traits = xla_client.CustomCallTargetTraits
    for op, (stages, graph_ok) in _jaxcomm.cuda_targets().items():
        name = runtime.target_name(op)
        jax.ffi.register_ffi_target(
            name, stages, platform="CUDA",
            traits=traits.COMMAND_BUFFER_COMPATIBLE if graph_ok else traits.DEFAULT)
        jax.ffi.register_ffi_target_as_batch_partitionable(name)
    _jaxcomm.set_process_index(jax.process_index())


def _kv_client() -> Any:
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jaxcomm: a CUDA group spans processes but jax.distributed is not "
                           "initialized (call jax.distributed.initialize())")
    return client


_exchanged: set[str] = set()


def exchange_unique_ids(groups: Iterable[Sequence[int]], partition_devices: np.ndarray,
                        timeout_ms: int) -> None:
    """Gives the C++ registry the NCCL unique id of every multi-process group of a call.

    Runs when a program is lowered (on every process, in the same order): the process
    holding a group's rank 0 makes the id and publishes it in the jax.distributed
    key-value store; the others wait for it (with the collective's deadline). Groups
    inside one process need nothing: their id is made locally at initialization.
    """
    pd = np.asarray(partition_devices, dtype=np.int64).reshape(-1, 2)
    me = jax.process_index()
    for group in groups:
        procs = {int(pd[p, 0]) for p in group}
        if len(group) < 2 or procs == {me} or me not in procs:
            continue
        key = group_key(group, partition_devices)
        if key in _exchanged:
            continue
        client = _kv_client()
        if int(pd[group[0], 0]) == me:
            uid = _jaxcomm.cuda_nccl_unique_id()
            client.key_value_set_bytes(_KV_PREFIX + key, uid)
        else:
            uid = client.blocking_key_value_get_bytes(_KV_PREFIX + key, int(timeout_ms))
        _jaxcomm.cuda_set_unique_id(key, bytes(uid))
        _exchanged.add(key)


def communicators() -> list[dict[str, Any]]:
    """NCCL communicators created so far: group, rank, size, create_ms, memory_bytes."""
    return list(_jaxcomm.cuda_communicators()) if built_with_cuda() else []
