"""The CUDA backend's Python side: detection, NCCL discovery, FFI registration for
platform "CUDA", and what a program needs before its groups can meet across processes.

jaxcomm serves platform CUDA with its own handlers only when the extension was built
with them (``JAXCOMM_CUDA``, see CMakeLists.txt) *and* this process has a GPU backend;
otherwise its ops lower to jax.lax there, as before. A CPU-only install never imports or
loads anything CUDA: the extension links the CUDA runtime statically and loads NCCL with
dlopen only when a group of more than one rank first needs a communicator.

Each group takes one route (ffi/cuda/routes.h): a copy (one rank), NCCL, or its ranks
reading each other's buffers in place (within a process through peer access; between the
processes of one host, one rank each, through CUDA IPC). When a program is lowered, every
process publishes once, in the jax.distributed key-value store, its host and its GPUs
(UUIDs); then, per group spanning processes, the processes either exchange an NCCL unique
id or link jaxcomm's host transport, over which the CUDA IPC route sends its handles.

Every function here is safe to call without a GPU (and is tested so on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import logging
import os
from types import ModuleType
from typing import Any, Iterable, Sequence

import numpy as np

import jax

from jaxcomm import _jaxcomm
from jaxcomm._src import config, runtime

log = logging.getLogger("jaxcomm")


#: Dtypes NCCL cannot reduce (jaxcomm lowers those reductions to jax.lax on CUDA).
_NCCL_UNREDUCIBLE = frozenset(np.dtype(d) for d in (np.int16, np.uint16, np.complex64, np.complex128))

_KV_UNIQUE_ID = "jaxcomm/nccl_unique_id/"
_KV_PROCESS = "jaxcomm/cuda/process/{}"


@dataclasses.dataclass(frozen=True)
class Flavor:
    """Which build of the CUDA backend a process's setup serves: the extension module whose
    C++ registry takes the processes' devices, routes and NCCL ids, and the jax backend
    whose devices are its GPUs.

    :data:`GPU` is the real one (``_jaxcomm`` built with nvcc, jax's ``gpu`` devices);
    the emulation (jaxcomm/_src/backends/cuda_emulated.py) runs the same setup on
    ``_jaxcomm_emu`` and XLA:CPU's devices, XLA:CPU's device k being emulated GPU k.
    """

    #: Attribute of the ``jaxcomm`` package: ``_jaxcomm`` or ``_jaxcomm_emu``.
    module_name: str
    #: The jax backend whose local devices are this flavor's GPUs.
    jax_backend: str
    #: Prefix of this flavor's keys in the key-value store (a process may run both).
    kv_prefix: str

    @property
    def module(self) -> ModuleType:
        if self.module_name == "_jaxcomm":
            return _jaxcomm  # the module global (tests replace it)
        return importlib.import_module(f"jaxcomm.{self.module_name}")


GPU = Flavor("_jaxcomm", "gpu", "")
EMULATED = Flavor("_jaxcomm_emu", "cpu", "emu/")

#: ffi/cuda/routes.cc's RouteName of the routes Python acts on.
ROUTE_NCCL = "nccl"
ROUTE_IPC = "cuda ipc across processes"


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


def _cuda_version(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


def unusable_reason() -> str:
    """Why jaxcomm's CUDA handlers cannot run on this process's GPUs, or "".

    Asks the CUDA runtime jaxcomm was built with (linked statically): it must see a device,
    and the driver must support its CUDA major (a runtime of one major runs on a driver of
    that major or newer; a module built with CUDA 13 on a driver older than 580 fails every
    call).
    """
    count = _jaxcomm.cuda_device_count()
    versions = _jaxcomm.cuda_versions()
    runtime_version, driver = versions["runtime"] or versions["built"], versions["driver"]
    if driver == 0:
        return "no CUDA driver"
    if driver // 1000 < runtime_version // 1000:
        return (f"the driver supports CUDA {_cuda_version(driver)}, older than the CUDA "
                f"{_cuda_version(runtime_version)} runtime jaxcomm was built with")
    if count <= 0:
        return (f"the CUDA {_cuda_version(runtime_version)} runtime sees no device "
                f"(driver for CUDA {_cuda_version(driver)})")
    return ""


@functools.cache
def available() -> bool:
    """Whether jaxcomm's CUDA handlers serve GPU programs in this process: built with
    them, a GPU backend, and a device they can run on. Where a GPU backend is present but
    the handlers cannot run, logs why once; jaxcomm's ops then lower to jax.lax there."""
    if not (built_with_cuda() and gpu_backend_present()):
        return False
    reason = unusable_reason()
    if reason:
        log.warning("jaxcomm: not using its CUDA backend (%s); jaxcomm ops on GPU lower to jax.lax", reason)
        return False
    return True


def nccl_library_path() -> str | None:
    """libnccl.so.2 of the installed nvidia-nccl-cu12 or -cu13 wheel (jax's CUDA extra
    brings the one of its CUDA major; both install the same path), or None.

    Found without importing the package (the ``nvidia`` namespace package has no code).
    ``JAXCOMM_NCCL_LIBRARY`` names a library to use instead.
    """
    override = config.nccl_library()
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


def one_rank_nccl() -> bool:
    """JAXCOMM_CUDA_ONE_RANK=nccl: one-rank groups go through NCCL too (to test NCCL on one
    GPU); the C++ handlers read the same variable when a program is instantiated."""
    return config.cuda_one_rank_nccl()


def serves(op: str, group_size: int | None, flavor: Flavor = GPU) -> bool:
    """Whether the CUDA handler of ``op`` serves a group of ``group_size`` ranks.

    ragged_all_to_all: one-rank groups only (larger ones lower to its pure-JAX form). The
    MoE transport: groups whose GPUs are all in this process (peer access), or, in a job
    whose processes all share one host with one GPU each, across them (CUDA IPC); other
    layouts take the composed transport. Every other op: any group.
    """
    if group_size in (None, 1):
        return True
    if op == "ragged_all_to_all":
        return False
    if op == "moe_transport":
        return jax.process_count() == 1 or _one_gpu_per_process_on_one_host(flavor)
    return True


def nccl_reducible(dtype: Any) -> bool:
    """Whether NCCL can reduce ``dtype`` (else the reduction lowers to jax.lax on CUDA)."""
    return np.dtype(dtype) not in _NCCL_UNREDUCIBLE


def group_key(group: Sequence[int], partition_devices: np.ndarray) -> str:
    """A group's identity across processes; must equal CudaState::GroupKey (ffi/cuda/state.cc).

    Args:
      group: partition ids of the members, in rank order.
      partition_devices: flattened (process index, local device ordinal) per partition.
    """
    pd = np.asarray(partition_devices, dtype=np.int64).reshape(-1, 2)
    return "nccl:" + ",".join(f"{int(pd[p, 0])}/{int(pd[p, 1])}" for p in group)


@functools.cache
def ensure_registered() -> None:
    """Registers the CUDA handlers and their state type with XLA's CUDA backend, once.

    jaxlib's GPU plugin refuses custom-call traits (``RegisterCustomCallTarget`` in
    jaxlib/gpu/gpu_plugin_extension.cc: "The plugin does not support custom call traits"),
    so the targets are registered without any; and a target is marked batch-partitionable
    once per name, whichever platform registers it first (a second marking makes XLA log
    "Failed to register custom call partitioner").
    """
    if not available():
        raise RuntimeError("jaxcomm: the CUDA handlers need a build with JAXCOMM_CUDA and a GPU backend")
    runtime.check_configuration()
    path = nccl_library_path()
    if path:
        _jaxcomm.cuda_set_nccl_path(path)
    jax.ffi.register_ffi_type("jaxcomm_cuda_instruction_state", _jaxcomm.cuda_state_type(),
                              platform="CUDA")
    for op, stages in _jaxcomm.cuda_targets().items():
        name = runtime.target_name(op)
        jax.ffi.register_ffi_target(name, stages, platform="CUDA")
        runtime.mark_batch_partitionable(name)
    # Kernels outside any group (the op table's local ops, an execute stage alone): called
    # inside shard_map or on one shard's rows, never partitioned by XLA.
    for op, stages in _jaxcomm.cuda_local_targets().items():
        jax.ffi.register_ffi_target(runtime.target_name(op), stages, platform="CUDA")
    _jaxcomm.set_process_index(jax.process_index())


def _kv_client() -> Any:
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jaxcomm: a CUDA group spans processes but jax.distributed is not "
                           "initialized (call jax.distributed.initialize())")
    return client


# ------------------------------------------------------------------ processes of the job

def _host_identity() -> str:
    from jaxcomm._src import bootstrap  # late: bootstrap imports the extension's host links
    return bootstrap.host_identity()


def _local_ordinal(d: Any) -> int:
    """A local device's ordinal in its runtime: XLA:GPU's local_hardware_id; XLA:CPU's
    devices have none, and are numbered by their index among the process's devices."""
    if d.local_hardware_id is not None:
        return int(d.local_hardware_id)
    if d.platform == "cpu":
        return jax.local_devices(backend="cpu").index(d)
    return int(d.id)


@functools.cache
def _publish_self(flavor: Flavor = GPU) -> dict[str, Any]:
    """Publishes this process's host and GPUs in the key-value store, once."""
    devices = []
    for d in jax.local_devices(backend=flavor.jax_backend):
        ordinal = _local_ordinal(d)
        devices.append(dict(id=int(d.id), ordinal=ordinal,
                            uuid=str(flavor.module.cuda_device_uuid(ordinal))))
    info = dict(host=_host_identity(), devices=devices)
    me = jax.process_index()
    _kv_client().key_value_set(flavor.kv_prefix + _KV_PROCESS.format(me), json.dumps(info),
                               allow_overwrite=True)
    _set_process_info(me, info, flavor)
    return info


#: What each process published, per flavor: {flavor: {process: info}}.
_processes: dict[Flavor, dict[int, dict[str, Any]]] = {}


def _set_process_info(process: int, info: dict[str, Any], flavor: Flavor = GPU) -> None:
    """Caches ``info`` and hands it to the C++ route decision."""
    _processes.setdefault(flavor, {})[process] = info
    uuids = [""] * (1 + max((d["ordinal"] for d in info["devices"]), default=-1))
    for d in info["devices"]:
        uuids[d["ordinal"]] = d["uuid"]
    flavor.module.cuda_set_process_info(process, info["host"], uuids)


def process_info(processes: Iterable[int], timeout_ms: int,
                 flavor: Flavor = GPU) -> dict[int, dict[str, Any]]:
    """What each of ``processes`` published: {process: {host, devices: [{id, ordinal, uuid}]}}.

    Blocks until each has published (it lowers the same program), at most ``timeout_ms``.
    """
    mine = _publish_self(flavor)
    me = jax.process_index()
    out = {me: mine}
    known = _processes.setdefault(flavor, {})
    for p in sorted(set(processes) - {me}):
        if p not in known:
            try:
                raw = _kv_client().blocking_key_value_get(flavor.kv_prefix + _KV_PROCESS.format(p),
                                                          int(timeout_ms))
            except Exception as e:  # the coordination service reports a timeout as an error
                raise RuntimeError(
                    f"jaxcomm: process {me} waited {timeout_ms / 1000:g} s for process {p} to "
                    f"publish its GPUs (does it run the same program?): {e}") from e
            _set_process_info(p, json.loads(raw), flavor)
        out[p] = known[p]
    return out


@functools.cache
def _one_gpu_per_process_on_one_host(flavor: Flavor = GPU) -> bool:
    """Whether every process of the job runs on this host with one GPU (where the MoE
    transport's own kernels reach every peer through CUDA IPC)."""
    infos = process_info(range(jax.process_count()), config.timeout_ms(), flavor)
    hosts = {info["host"] for info in infos.values()}
    return len(hosts) == 1 and all(len(info["devices"]) == 1 for info in infos.values())


# ------------------------------------------------------------------------ at lowering

def partition_devices(axis_context: Any, infos: dict[int, dict[str, Any]] | None = None) -> np.ndarray:
    """(process index, local device ordinal) per partition of the program, flattened.

    Devices of other processes have no local ordinal here; ``infos`` (process_info) fills
    it in, so that every process names a group's members alike (group_key). Unknown: -1.
    """
    ordinals = {d["id"]: d["ordinal"] for info in (infos or {}).values() for d in info["devices"]}
    out = []
    for d in np.asarray(axis_context.mesh.devices).reshape(-1):
        ordinal = d.local_hardware_id
        if ordinal is None:
            ordinal = ordinals.get(int(d.id), -1)
        out.append((d.process_index, ordinal))
    return np.asarray(out, dtype=np.int64).reshape(-1)


def route(op: str, group: Sequence[int], pd: np.ndarray, infos: dict[int, dict[str, Any]]) -> tuple[str, str]:
    """(route name, error or "") of ``group`` (partitions) for ``op``: ffi/cuda/routes.cc."""
    pd = np.asarray(pd, dtype=np.int64).reshape(-1, 2)
    members = []
    for p in group:
        process, ordinal = int(pd[p, 0]), int(pd[p, 1])
        info = infos.get(process, {})
        uuid = next((d["uuid"] for d in info.get("devices", ()) if d["ordinal"] == ordinal), "")
        members.append((process, ordinal, info.get("host", ""), uuid))
    # The decision is host logic (ffi/cuda/routes.cc), bound in _jaxcomm in every build;
    # both builds' handlers take the same (their own copy of it).
    return tuple(_jaxcomm.cuda_route(op, members, jax.process_index(), one_rank_nccl()))


def prepare_lowering(op: str, replica_groups: Sequence[Sequence[int]], axis_context: Any,
                     timeout_ms: int, flavor: Flavor = GPU) -> np.ndarray:
    """Readies this process's groups of a CUDA custom call; returns its partition_devices.

    Runs when a program is lowered, on every process in the same order. In one process,
    nothing is needed. Across processes: each group spanning processes gets, per its route,
    its NCCL unique id (made by the process holding rank 0, published in the key-value
    store) or this process's host links to the group's other processes (CUDA IPC).
    ``flavor`` names the build whose registry takes them (:data:`GPU`, :data:`EMULATED`).
    """
    if jax.process_count() == 1:
        return partition_devices(axis_context)
    from jaxcomm._src import bootstrap, groups as groups_mod
    peers = groups_mod.peer_processes(axis_context, tuple(tuple(g) for g in replica_groups))
    # Every process of the mesh, not only this one's peers: the program then names every
    # partition's device alike wherever it was lowered (an executable compiled by one
    # process and loaded by the others, as jax's compilation cache does, finds its device).
    mesh_processes = {int(d.process_index) for d in np.asarray(axis_context.mesh.devices).reshape(-1)}
    infos = process_info(set(peers) | mesh_processes, timeout_ms, flavor)
    pd = partition_devices(axis_context, infos)
    table = pd.reshape(-1, 2)
    me = jax.process_index()
    for group in replica_groups:
        procs = {int(table[p, 0]) for p in group}
        if len(group) < 2 or procs == {me} or me not in procs:
            continue
        name, error = route(op, group, pd, infos)
        if error:
            raise RuntimeError(f"jaxcomm.{op} on {'emulated ' if flavor is not GPU else ''}CUDA: {error}")
        if name == ROUTE_IPC:
            bootstrap.ensure_linked(procs)
        elif name == ROUTE_NCCL:
            _exchange_unique_id(group, pd, timeout_ms, flavor)
    return pd


#: Groups (their key, with the flavor's prefix) whose NCCL id this process has.
_exchanged: set[str] = set()


def _exchange_unique_id(group: Sequence[int], pd: np.ndarray, timeout_ms: int,
                        flavor: Flavor = GPU) -> None:
    """Gives the C++ registry the NCCL unique id of a group spanning processes: the
    process holding its rank 0 makes it and publishes it; the others wait for it."""
    key = group_key(group, pd)
    if flavor.kv_prefix + key in _exchanged:
        return
    table = np.asarray(pd, dtype=np.int64).reshape(-1, 2)
    client = _kv_client()
    kv_key = flavor.kv_prefix + _KV_UNIQUE_ID + key
    if int(table[group[0], 0]) == jax.process_index():
        uid = flavor.module.cuda_nccl_unique_id()
        client.key_value_set_bytes(kv_key, uid)
    else:
        uid = client.blocking_key_value_get_bytes(kv_key, int(timeout_ms))
    flavor.module.cuda_set_unique_id(key, bytes(uid))
    _exchanged.add(flavor.kv_prefix + key)


def communicators() -> list[dict[str, Any]]:
    """NCCL communicators created so far: group, rank, size, create_ms, memory_bytes,
    failure (why it was aborted, or "")."""
    return list(_jaxcomm.cuda_communicators()) if built_with_cuda() else []
