"""jaxcomm's configuration: every ``JAXCOMM_*`` environment variable, in one registry.

Each :class:`Variable` says its type, default, how a value is checked, when it is read and
which part of jaxcomm reads it. Every reader goes through :func:`get` (or the named
helpers below); the C++ runtime reads the variables marked ``native`` itself, with the
same defaults (tests/test_config.py checks both), and reports a malformed value, which
:func:`raise_native_errors` turns into the same error as here. ``docs/configuration.md``
is generated from the registry (jaxcomm/_src/config_doc.py)::

    python -m jaxcomm._src.config_doc > docs/configuration.md

A malformed value is a ValueError naming the variable, e.g.
``JAXCOMM_SPIN_US must be a whole number of microseconds, got 'abc'``. Keyword arguments
(``timeout_s=``, ``jaxcomm.init(...)``) take precedence over the variables they name.

This module imports nothing from jax: the launcher uses it too.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
from typing import Any, Callable, Mapping

Env = Mapping[str, str]

# When a variable is read (the "read" column of docs/configuration.md).
EACH_TRACE = "each trace"          # when a program using jaxcomm is traced (applies to later traces)
AT_START = "at start"              # once, when the extension loads (C++ runtime)
AT_REGISTRATION = "at registration"  # when the backend's handlers are registered (first trace)
AT_LINK = "at link"                # when this process first links its host transports
AT_INIT = "at init"                # by jaxcomm.init() / python -m jaxcomm.launch
EACH_INSTANTIATE = "each instantiate"  # when XLA instantiates a CUDA custom call (C++)


@dataclasses.dataclass(frozen=True)
class Variable:
    """One ``JAXCOMM_*`` variable.

    Attributes:
      name: the variable.
      type: what a value is, in words (``seconds``, ``count``, ``choice``, ...).
      default: the value when unset or empty, as text ("" where unset means absent).
      meaning: what it controls (one paragraph, for the docs).
      read: when it is read (EACH_TRACE, AT_START, ...).
      backends: which parts read it: ``cpu`` (the host backend), ``cuda``, ``all`` (both),
        ``launcher`` (multi-process start-up).
      parse: text -> value, raising ValueError(why) for a malformed one; ``why`` is
        prefixed with the name.
      native: the C++ runtime reads it too (ffi/core/env.h).
      launcher_sets: set by ``python -m jaxcomm.launch`` for its processes (the launch
        contract), not by users.
    """

    name: str
    type: str
    default: str
    meaning: str
    read: str
    backends: str
    parse: Callable[[str], Any]
    native: bool = False
    launcher_sets: bool = False


# ------------------------------------------------------------------------------ parsers

def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"must be positive, got {raw!r}")
    return value


def _count(unit: str) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"must be a whole number of {unit}, got {raw!r}") from None
        if value < 0:
            raise ValueError(f"must be >= 0, got {value}")
        return value
    return parse


def _grace_seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"must be a number of seconds, got {raw!r}") from None
    if not 0 <= value < float("inf"):
        raise ValueError(f"must be a finite number >= 0, got {raw!r}")
    return value


def _integer(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"must be an integer, got {raw!r}") from None


def _flag(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError(f"must be 0 or 1, got {raw!r}")
    return raw == "1"


def _choice(*choices: str, lower: bool = True) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.lower() if lower else raw
        if value not in choices:
            raise ValueError(f"must be one of {choices}, got {value!r}")
        return value
    return parse


def _ipv4(raw: str) -> str:
    try:
        return str(ipaddress.IPv4Address(raw))
    except ValueError:
        raise ValueError(f"must be an IPv4 address, got {raw!r}") from None


def _text(raw: str) -> str:
    return raw


# ----------------------------------------------------------------------------- registry

_VARIABLES = (
    # --- collectives (both backends)
    Variable("JAXCOMM_TIMEOUT_S", "seconds", "300",
             "Deadline of every wait inside a collective, in seconds (``timeout_s=`` per call "
             "takes precedence).", EACH_TRACE, "all", _seconds),
    Variable("JAXCOMM_BACKEND", "choice", "auto",
             "``auto``: jaxcomm's handlers where the platform has them, else jax.lax; "
             "``jaxcomm``: always (an error where there are none); ``xla``: always lower to "
             "the jax.lax equivalent.", EACH_TRACE, "all", _choice("auto", "jaxcomm", "xla")),
    # --- host backend, C++ runtime
    Variable("JAXCOMM_SPIN_US", "count", "200",
             "How long an idle jaxcomm pool thread spins (yielding the core) before it sleeps, "
             "and how long a cross-process call spins for its peers before it hands the wait to "
             "the progress thread, in microseconds.", AT_START, "cpu", _count("microseconds"),
             native=True),
    Variable("JAXCOMM_NONTEMPORAL_BYTES", "count", "4194304",
             "Results of at least this many bytes (per rank) are written with non-temporal "
             "stores, which bypass the caches: a large result is not read from memory before it "
             "is written. ``0``: never.", AT_START, "cpu", _count("bytes"), native=True),
    Variable("JAXCOMM_SINGLE_COPY", "flag", "1",
             "``1``: streamed cross-process rounds on one host read the peers' operands straight "
             "from their memory (process_vm_readv) where the kernel allows it; ``0``: never "
             "(this process offers no single-copy rounds).", AT_START, "cpu", _flag, native=True),
    Variable("JAXCOMM_INLINE", "flag", "1",
             "``1``: a cross-process call whose group has one rank per process, all on one host, "
             "runs on its device thread (no hand-off) from its second round; ``0``: never.",
             AT_START, "cpu", _flag, native=True),
    Variable("JAXCOMM_CPU_F16C", "flag", "1",
             "``1``: the host MoE combine converts float16 rows and results with the CPU's F16C "
             "instructions where it has them (x86-64 with AVX2); ``0``: always the portable "
             "kernels, which give the same bits.", AT_START, "cpu", _flag, native=True),
    Variable("JAXCOMM_MISMATCH_GRACE_S", "seconds", "3",
             "Ranks of a group that wait in different collectives (another op or call site, "
             "programs dispatched in different orders), each waiting for the other, fail after "
             "this many seconds (at most a tenth of the call's timeout) with a MISMATCH error "
             "naming both sides; ``0``: only at the deadline.", AT_REGISTRATION, "cpu",
             _grace_seconds),
    Variable("JAXCOMM_MATCH_PROGRAMS", "flag", "1",
             "Calls pair across processes only within one program: each call's site names its "
             "jitted program (module name and a digest of its structure), so processes that run "
             "different programs at a collective fail with MISMATCH instead of pairing; ``0``: "
             "calls pair by call site, axis and order alone, as MPI pairs them (for jobs whose "
             "processes deliberately trace different programs).", EACH_TRACE, "all", _flag),
    Variable("JAXCOMM_TRANSPORT", "choice", "auto",
             "Between processes: ``auto``: shared memory on one host; across hosts MPI when an "
             "MPI launcher (mpirun, srun with PMI/PMIx) started the job and mpi4py imports, "
             "else TCP; ``tcp``: TCP everywhere; ``mpi``: shared memory on one host, MPI across "
             "hosts (the job must be started by an MPI launcher); ``shm+tcp``: shared memory on "
             "one host, TCP across hosts, even under an MPI launcher.", AT_LINK, "cpu",
             _choice("auto", "tcp", "mpi", "shm+tcp")),
    Variable("JAXCOMM_TCP_ADDRESS", "IPv4 address", "",
             "The address of this host's interface that jaxcomm's TCP listener takes and peers "
             "connect to; unset: the one that routes to the coordinator (the job's network); "
             "``0.0.0.0``: every interface (not advised).", AT_LINK, "cpu", _ipv4),
    Variable("JAXCOMM_COMM_MEMORY_MB", "count", "1024",
             "The most memory, in MiB, one process holds for cross-process collectives in "
             "shared-memory segments (its control block and the data segments that hold its "
             "calls' buffers and stream rings); also the most each TCP link holds of frames of "
             "calls this process has not reached yet, and of spare buffers. A call that would "
             "need more shared memory fails with an error naming this setting. "
             "``jaxcomm.memory()`` reports what is held (docs/multiprocess.md).",
             AT_START, "cpu", _count("MiB"), native=True),
    Variable("JAXCOMM_HOST_ID", "text", "",
             "Names this host for sharing memory (processes with the same id link through shared "
             "memory); unset: hostname, boot id and pid namespace. Processes of one machine "
             "given different ids link through TCP as if on different hosts (tests).",
             AT_LINK, "all", _text),
    # --- flight recorder and fault injection (C++ runtime)
    Variable("JAXCOMM_TRACE_ENTRIES", "count", "2048",
             "Flight recorder: calls kept per rank (partition); ``0`` turns the recorder off "
             "(nothing recorded, no stats).", AT_START, "all", _count("calls"), native=True),
    Variable("JAXCOMM_TRACE_DIR", "directory", "",
             "Where flight recorder dumps go: set, each process writes "
             "``jaxcomm-trace-p<index>-<pid>.json`` there on a collective timeout or transport "
             "error, on SIGUSR1 and at exit, and keeps its rings in a file there; unset, only "
             "``jaxcomm.trace.dump()`` and SIGUSR1 (current directory) write one.",
             AT_START, "all", _text, native=True),
    Variable("JAXCOMM_FAULT", "fault list", "",
             "Fault injection, e.g. ``rank=3,op=all_reduce,call=5,action=hang`` (hang | "
             "exit[:code] | delay:seconds); faults separated by ``;``; see "
             "ffi/core/fault_injection.h. The C++ runtime parses it; a malformed one is an "
             "error naming it.", AT_START, "cpu", _text, native=True),
    # --- CUDA backend
    Variable("JAXCOMM_CUDA_ONE_RANK", "choice", "",
             "``nccl``: one-rank groups go through NCCL too (to test NCCL on one GPU); unset: "
             "they are a copy.", EACH_INSTANTIATE, "cuda", _choice("nccl", lower=False),
             native=True),
    Variable("JAXCOMM_NCCL_MOCK_TIMEOUT_S", "count", "300",
             "The CUDA emulation's mock NCCL (ffi/cuda_emu/nccl): how long any of its waits "
             "(for the ranks to join, for a peer's part of an operation) lasts before the "
             "communicator fails, in whole seconds, where a real NCCL waits until aborted. Read "
             "when a communicator is created.", EACH_INSTANTIATE, "cuda", _count("seconds"),
             native=True),
    Variable("JAXCOMM_NCCL_LIBRARY", "path", "",
             "The NCCL library to load instead of libnccl.so.2 (the one jax's CUDA extra, ``jax[cuda12]`` or ``jax[cuda13]``, installs).",
             AT_REGISTRATION, "cuda", _text),
    # --- CUDA emulation (ffi/cuda_emu/)
    Variable("JAXCOMM_EMULATE_CUDA", "flag", "",
             "``1``: every jaxcomm op of the process runs the CUDA backend's own code (its "
             "handlers, routes, streams, events and kernels) on a CPU emulation of the CUDA "
             "runtime, under XLA:CPU; ``jaxcomm.stats()`` then names it in each row's "
             "algorithm (``cuda (emulated): ...``). For tests; see docs/cuda.md, \"The "
             "emulation\".", AT_REGISTRATION, "cuda", _flag),
    # --- multi-process start-up (jaxcomm.init)
    Variable("JAXCOMM_INIT_TIMEOUT_S", "seconds", "60",
             "How long jaxcomm.init() waits for all processes to join.", AT_INIT, "launcher",
             _seconds),
    Variable("JAXCOMM_HEARTBEAT_TIMEOUT_S", "seconds", "10",
             "After this long without a heartbeat, JAX's coordination service declares a "
             "process dead and aborts all the others (SIGABRT).", AT_INIT, "launcher", _seconds),
    Variable("JAXCOMM_SHUTDOWN_TIMEOUT_S", "seconds", "60",
             "How long an exiting process waits in JAX's shutdown barrier for the others to exit "
             "too; when it expires JAX aborts every process of the job.", AT_INIT, "launcher",
             _seconds),
    # --- the launch contract: set by python -m jaxcomm.launch for each process
    Variable("JAXCOMM_COORDINATOR", "host:port", "",
             "The jax.distributed coordination service.", AT_INIT, "launcher", _text,
             launcher_sets=True),
    Variable("JAXCOMM_COORDINATION_SERVICE", "choice", "",
             "``external``: the service runs outside the workers (the launcher's own process), "
             "so process 0 does not start one and may die like any other; unset: process 0 "
             "starts it, as JAX does.", AT_INIT, "launcher", _choice("external"),
             launcher_sets=True),
    Variable("JAXCOMM_NUM_PROCESSES", "integer", "", "Processes in the job.", AT_INIT,
             "launcher", _integer, launcher_sets=True),
    Variable("JAXCOMM_PROCESS_ID", "integer", "",
             "This process's index, 0 .. JAXCOMM_NUM_PROCESSES-1 (= ``jax.process_index()`` "
             "after jaxcomm.init()).", AT_INIT, "launcher", _integer, launcher_sets=True),
    Variable("JAXCOMM_LOCAL_DEVICES", "integer", "",
             "CPU devices per process (the launcher also puts it into ``XLA_FLAGS`` as "
             "``--xla_force_host_platform_device_count``).", AT_INIT, "launcher", _integer,
             launcher_sets=True),
    Variable("JAXCOMM_JOB_ID", "text", "",
             "Identifies the job (1-64 letters and digits); shared-memory segments are named "
             "``jaxcomm-<job id>-...``, and the launcher removes any left over.", AT_INIT,
             "launcher", _text, launcher_sets=True),
    Variable("JAXCOMM_LAUNCHER_PID", "integer", "",
             "The launcher's pid: jaxcomm.init() asks Linux to terminate the process when the "
             "launcher dies.", AT_INIT, "launcher", _integer, launcher_sets=True),
    Variable("JAXCOMM_JOB_SECRET", "64 hex digits", "",
             "Drawn by the launcher: a TCP connection to a jaxcomm process proves it belongs to "
             "the job with it (without the launcher, agreed through the key-value store).",
             AT_INIT, "launcher", _text, launcher_sets=True),
    Variable("JAXCOMM_KEEP_GOING", "flag", "",
             "``1`` (``python -m jaxcomm.launch --keep-going``): the job outlives a failed "
             "process, so jaxcomm.init() turns on JAX's recoverability.", AT_INIT, "launcher",
             _flag, launcher_sets=True),
)

#: Every variable, by name.
VARIABLES: dict[str, Variable] = {v.name: v for v in _VARIABLES}


def variable(name: str) -> Variable:
    """The registry's entry for ``name`` (a KeyError for a name it does not have)."""
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not in jaxcomm's configuration registry "
                       f"(jaxcomm/_src/config.py)") from None


def raw(name: str, env: Env | None = None) -> str:
    """The variable's text, stripped; "" when unset (the registry must know ``name``)."""
    variable(name)
    return (os.environ if env is None else env).get(name, "").strip()


def is_set(name: str, env: Env | None = None) -> bool:
    """Whether ``name`` is set to something other than blanks."""
    return bool(raw(name, env))


def get(name: str, env: Env | None = None) -> Any:
    """The value of ``name``: parsed from the environment (``env``, default os.environ),
    else its default; None where the default is "unset". A malformed value raises
    ValueError("<name> must be ..., got ...")."""
    v = variable(name)
    text = raw(name, env) or v.default
    if not text:
        return None
    try:
        return v.parse(text)
    except ValueError as e:
        raise ValueError(f"{name} {e}") from None


def validate(read: str | None = None, env: Env | None = None) -> None:
    """Parses every variable (read at ``read``, if given): the first malformed one raises."""
    for v in _VARIABLES:
        if read is None or v.read == read:
            get(v.name, env)


def raise_native_errors(errors: list[str]) -> None:
    """Raises the first malformed variable the C++ runtime reported (config_errors())."""
    if errors:
        raise ValueError(errors[0])


# ------------------------------------------------------------------------ named helpers

def timeout_ms(timeout_s: float | None = None, op: str = "") -> int:
    """The collective deadline in milliseconds: the argument, else JAXCOMM_TIMEOUT_S
    (validated when read). A bad ``timeout_s`` raises an error naming ``jaxcomm.<op>``:
    a TypeError for what is not a number, a ValueError for what is not positive and finite
    (every wait has a deadline)."""
    if timeout_s is None:
        timeout_s = get("JAXCOMM_TIMEOUT_S")
    else:
        who = f"jaxcomm.{op}: " if op else ""
        # Strings have no __float__; numpy and concrete jax scalars do.
        if isinstance(timeout_s, (bool, complex)) or not hasattr(timeout_s, "__float__"):
            raise TypeError(f"{who}timeout_s must be a number of seconds, got {timeout_s!r}")
        if not 0 < float(timeout_s) < math.inf:
            raise ValueError(f"{who}timeout_s must be a positive, finite number of seconds, "
                             f"got {timeout_s!r}")
    return max(1, int(round(float(timeout_s) * 1000)))


def seconds(name: str, env: Env | None = None) -> int:
    """A timeout variable in whole seconds (jax.distributed's unit), rounded up so that
    0.5 does not become 0 (= no limit)."""
    return max(1, int(-(-get(name, env) // 1)))


def backend() -> str:
    """JAXCOMM_BACKEND, validated."""
    return get("JAXCOMM_BACKEND")


def transport(env: Env | None = None) -> str:
    """JAXCOMM_TRANSPORT, validated."""
    return get("JAXCOMM_TRANSPORT", env)


def tcp_address() -> str:
    """JAXCOMM_TCP_ADDRESS, validated: an IPv4 address, or "" when unset."""
    return get("JAXCOMM_TCP_ADDRESS") or ""


def trace_entries() -> int:
    """JAXCOMM_TRACE_ENTRIES, validated."""
    return get("JAXCOMM_TRACE_ENTRIES")


def nontemporal_bytes() -> int:
    """JAXCOMM_NONTEMPORAL_BYTES, validated."""
    return get("JAXCOMM_NONTEMPORAL_BYTES")


def single_copy() -> bool:
    """JAXCOMM_SINGLE_COPY (0 or 1), validated."""
    return get("JAXCOMM_SINGLE_COPY")


def mismatch_grace_s() -> float:
    """JAXCOMM_MISMATCH_GRACE_S: seconds >= 0 (0 turns the mismatch check off)."""
    return get("JAXCOMM_MISMATCH_GRACE_S")


def match_programs() -> bool:
    """JAXCOMM_MATCH_PROGRAMS (0 or 1), validated."""
    return get("JAXCOMM_MATCH_PROGRAMS")


def host_id() -> str:
    """JAXCOMM_HOST_ID, or "" when unset."""
    return get("JAXCOMM_HOST_ID") or ""


def cuda_one_rank_nccl() -> bool:
    """JAXCOMM_CUDA_ONE_RANK=nccl."""
    return get("JAXCOMM_CUDA_ONE_RANK") == "nccl"


def nccl_library() -> str:
    """JAXCOMM_NCCL_LIBRARY, or "" when unset."""
    return get("JAXCOMM_NCCL_LIBRARY") or ""


def emulate_cuda() -> bool:
    """JAXCOMM_EMULATE_CUDA=1: jaxcomm's ops run the CUDA backend on the emulated runtime."""
    return bool(get("JAXCOMM_EMULATE_CUDA"))
