"""The MPI transport's part of the bootstrap: when to use MPI between hosts, and what the
C++ side needs to reach the user's MPI library (ffi/cpu/transport/mpi_library.h).

jaxcomm links no MPI. Under an MPI launcher, the user's mpi4py has loaded and
initialized an MPI library; everything jaxcomm needs of it comes from mpi4py, as numbers:
the library's path (the mapped ``libmpi*`` that exports ``MPI_Isend``), the handles of
jaxcomm's own communicator and of ``MPI_BYTE``, ``sizeof(MPI_Request)`` and
``sizeof(MPI_Status)``, ``MPI_TAG_UB``, and ``MPI_ERR_PROC_FAILED`` where the library has
it. So Open MPI, MPICH and the MPI 5 standard ABI all work through one path, with no
table of implementation constants and no compiler (docs/multiprocess.md, "MPI").

jaxcomm's communicator is a duplicate of ``MPI_COMM_WORLD`` (made with
``MPI_Comm_idup``, polled against a deadline) with ``MPI_ERRORS_RETURN``: jaxcomm's
messages never meet the user's, and an MPI error is a return code, not an abort. The
duplicate is collective over the MPI world, so :func:`prepare` runs in ``jaxcomm.init()``,
where every process is; a job joined without ``jaxcomm.init()`` makes it when its first
program spanning processes is lowered, and every process of the MPI world must then
reach one.

Threads: jaxcomm needs ``MPI_THREAD_SERIALIZED`` at least. With ``MPI_THREAD_MULTIPLE``
(mpi4py's default request) any of its threads may call MPI; with ``SERIALIZED`` all its
calls go through one thread of its own, and the program must not call MPI itself while
a jaxcomm collective runs.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import importlib.util
import logging
import os
import time
from typing import Any, Mapping

from jaxcomm._src import config

log = logging.getLogger("jaxcomm")

#: Variables an MPI launcher sets in every process it starts (Open MPI's mpirun and
#: prterun, MPICH's Hydra, Slurm's srun with PMI-2 or PMIx): their presence, with more
#: than one process, says the job was started by one.
LAUNCHER_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")
LAUNCHER_MARKS = ("PMIX_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")

_state: dict[str, Any] = {}


def launched_by_mpi(env: dict[str, str] | None = None) -> bool:
    """Whether an MPI launcher started this process as one of several.

    Example::

        launched_by_mpi({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"})  # True
    """
    env = os.environ if env is None else env
    return any(more_than_one(env, v) for v in LAUNCHER_SIZES) or (
        any(v in env for v in LAUNCHER_MARKS) and more_than_one(env, "SLURM_NTASKS"))


def more_than_one(env: Mapping[str, str], name: str) -> bool:
    """Whether launcher variable ``name`` counts more than one process (SLURM writes
    ``4(x2)`` for repeated counts)."""
    try:
        return int(env.get(name, "1").split("(")[0]) > 1
    except ValueError:
        return False


def wanted(env: dict[str, str] | None = None) -> bool:
    """Whether this process links other hosts through MPI: ``JAXCOMM_TRANSPORT=mpi``, or
    ``auto`` under an MPI launcher with mpi4py importable. The same answer in every
    process of a job (they share the launcher's environment and the Python environment)."""
    choice = config.transport(env)
    if choice == "mpi":
        return True
    return (choice == "auto" and launched_by_mpi(env)
            and importlib.util.find_spec("mpi4py") is not None)


def _library_path() -> str:
    """The MPI library mpi4py loaded: a mapped ``libmpi*`` exporting ``MPI_Isend``."""
    candidates: list[str] = []
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split(maxsplit=5)[-1].strip() if line.count(" ") >= 5 else ""
            if path.startswith("/") and path not in candidates:
                candidates.append(path)
    named = [p for p in candidates if os.path.basename(p).startswith("libmpi")]
    for path in named + [p for p in candidates if p not in named and ".so" in p]:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        if hasattr(lib, "MPI_Isend") and hasattr(lib, "MPI_Test"):
            return path
    raise RuntimeError("jaxcomm: mpi4py is imported but no loaded library exports MPI_Isend")


def _wait(request: Any, what: str, deadline: float) -> None:
    """Polls an mpi4py request until it completes, at most until ``deadline``."""
    while not request.Test():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"jaxcomm: {what} did not complete within the timeout: every process of the MPI "
                "job must call jaxcomm.init() (or reach its first program spanning processes)")
        time.sleep(0.0005)


def prepare(timeout_s: float, process: int, processes: int) -> None:
    """Duplicates the MPI world for jaxcomm (collective: every process of the MPI job calls
    it) and checks that the MPI job is this jax job. Once; raises with the reason when
    MPI cannot serve (too low a thread level, another job's world)."""
    if "comm" in _state:
        return
    from mpi4py import MPI

    import numpy as np

    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        raise RuntimeError(
            "jaxcomm: the MPI transport needs MPI_THREAD_SERIALIZED at least (its own thread "
            f"calls MPI), but MPI was initialized with thread level {level}; let mpi4py "
            "request 'multiple' (its default: mpi4py.rc.thread_level)")
    world = MPI.COMM_WORLD
    if world.Get_size() != processes:
        raise RuntimeError(
            f"jaxcomm: JAXCOMM_TRANSPORT=mpi needs the job's {processes} processes to be one MPI "
            f"job, but this process's MPI world has {world.Get_size()} (started by an MPI "
            "launcher: mpirun, srun --mpi=pmix?)")
    deadline = time.monotonic() + timeout_s
    comm, request = world.Idup()
    _wait(request, "duplicating MPI_COMM_WORLD for jaxcomm", deadline)
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    comm.Set_name("jaxcomm")
    mine = np.array([process, os.getpid()], np.int64)
    everyone = np.zeros((comm.Get_size(), 2), np.int64)
    _wait(comm.Iallgather(mine, everyone), "gathering the MPI job's processes", deadline)
    if sorted(everyone[:, 0].tolist()) != list(range(processes)):
        raise RuntimeError(f"jaxcomm: the MPI job's processes are not this jax job's: "
                           f"{everyone[:, 0].tolist()}")
    tag_ub = comm.Get_attr(MPI.TAG_UB)
    _state.update(comm=comm, level=level, tag_ub=int(tag_ub) if tag_ub else 32767,
                  world=hashlib.sha256(everyone.tobytes()).hexdigest()[:16],
                  library=_library_path())
    atexit.register(close)  # after mpi4py's own finalization was registered: runs first


def settings(machine: str, timeout_s: float, process: int, processes: int) -> dict[str, str]:
    """The MPI transport's settings (ffi/cpu/transport/mpi_transport.h); ``machine``: this
    machine's identity (a peer on the same machine is also watched by its pid)."""
    prepare(timeout_s, process, processes)
    from mpi4py import MPI

    comm = _state["comm"]
    status = MPI.Status()
    return dict(
        library=_state["library"], comm=str(comm.handle), byte=str(MPI.BYTE.handle),
        handle_bytes=str(MPI._sizeof(MPI.Request)), status_bytes=str(MPI._sizeof(status)),
        proc_failed=str(getattr(MPI, "ERR_PROC_FAILED", -1)), rank=str(comm.Get_rank()),
        size=str(comm.Get_size()), tag_ub=str(_state["tag_ub"]),
        thread_multiple=str(int(_state["level"] >= MPI.THREAD_MULTIPLE)), world=_state["world"],
        machine=machine)


def close() -> None:
    """Stops jaxcomm's MPI work and frees its communicator, before MPI is finalized."""
    comm = _state.pop("comm", None)
    if comm is None:
        return
    from jaxcomm import _jaxcomm
    from mpi4py import MPI

    _jaxcomm.transport_close()
    if not MPI.Is_finalized():
        try:
            comm.Free()
        except MPI.Exception:  # a request of a failed peer may still hold it
            pass
