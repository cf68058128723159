"""Joining a multi-process job: ``jaxcomm.init()`` and what the transports may rely on.

A process started by ``python -m jaxcomm.launch`` finds its place in the job in the
variables of the launch contract (``JAXCOMM_COORDINATOR``, ``JAXCOMM_NUM_PROCESSES``,
``JAXCOMM_PROCESS_ID``, ...; the names are the contract between the launcher, :func:`init`
and the multi-process transports), and :func:`init` reads ``JAXCOMM_INIT_TIMEOUT_S``,
``JAXCOMM_HEARTBEAT_TIMEOUT_S`` and ``JAXCOMM_SHUTDOWN_TIMEOUT_S`` (keyword arguments take
precedence). All are in jaxcomm's configuration registry (jaxcomm/_src/config.py;
docs/configuration.md lists them).

How processes of a jax.distributed job end (jax 0.10.2, checked): at exit each process
waits in a shutdown barrier until all have reached it. A process that dies (crash,
SIGKILL, ``os._exit``) stops sending heartbeats; once the coordination service notices
(the heartbeat timeout), it aborts all the others with SIGABRT, wherever they are
(unless the service is recoverable: ``--keep-going``). Where process 0 hosts the
service (SLURM, mpirun: JAX's default), the others abort at once when it dies; under
``jaxcomm.launch`` the service runs in a process of its own, so process 0's death is
like any other's: its peers get jaxcomm's error naming it well before the heartbeat
timeout. (A Python ``missed_heartbeat_callback`` for the client, which would let a
process outlive the service, throws ``std::bad_cast`` in jaxlib 0.10.2.) So after
:func:`init`, a process ending with an uncaught exception skips the barrier and exits at
once (status 1; 130 for KeyboardInterrupt): the launcher sees the failure where it
happened, instead of all processes aborting together a barrier timeout later. A
non-zero ``sys.exit(n)`` cannot be told from a normal exit at that point and still waits
in the barrier.

This module is the one place in jaxcomm that reaches into ``jax.distributed``'s private
state (the coordination service's client, whose key-value store the transports bootstrap
through); it imports jax only when called, so the launcher can use its names without it.
"""

from __future__ import annotations

import atexit
import contextlib
import time
import inspect
import logging
import os
import re
import secrets
import signal
import sys
from typing import Any, Iterator

from jaxcomm._src import config

log = logging.getLogger("jaxcomm")

ENV_COORDINATOR = "JAXCOMM_COORDINATOR"
ENV_NUM_PROCESSES = "JAXCOMM_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXCOMM_PROCESS_ID"
ENV_LOCAL_DEVICES = "JAXCOMM_LOCAL_DEVICES"
ENV_JOB_ID = "JAXCOMM_JOB_ID"
ENV_LAUNCHER_PID = "JAXCOMM_LAUNCHER_PID"
#: Set to 1 by ``jaxcomm.launch --keep-going``: the job outlives a failed process, so
#: :func:`init` turns on JAX's recoverability (survivors are not aborted).
ENV_KEEP_GOING = "JAXCOMM_KEEP_GOING"

#: ``external``: the coordination service runs outside the workers (the launcher's own
#: process): process 0 connects to it like the others instead of starting one.
ENV_SERVICE = "JAXCOMM_COORDINATION_SERVICE"
#: The per-job secret (64 hex digits) a TCP connection between processes starts with.
ENV_SECRET = "JAXCOMM_JOB_SECRET"

#: Every variable the launcher sets for its processes.
LAUNCH_ENV = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_LOCAL_DEVICES,
              ENV_JOB_ID, ENV_LAUNCHER_PID, ENV_SERVICE, ENV_SECRET)

#: Shared-memory segment names start with ``SHM_PREFIX + job id + "-"``.
SHM_PREFIX = "jaxcomm-"

_JOB_ID_RE = re.compile(r"^[A-Za-z0-9]{1,64}$")
_SECRET_RE = re.compile(r"^[0-9a-f]{64}$")
#: Key in the coordination service's store under which the job id is agreed.
_JOB_ID_KEY = "jaxcomm/job_id"
_SECRET_KEY = "jaxcomm/job_secret"

# The defaults of the start-up timeouts (config.py's registry holds them):
# JAXCOMM_HEARTBEAT_TIMEOUT_S (10 s): JAX aborts every surviving process once the
# coordination service has missed a dead process's heartbeats for this long; it must exceed
# the time jaxcomm's transports need to notice the dead peer and raise their own, more
# precise error (a few seconds).
# JAXCOMM_SHUTDOWN_TIMEOUT_S (60 s): a dead peer is caught by the heartbeat timeout, so this
# only bounds the wait for live peers that have not finished: ranks legitimately finish
# apart (process 0 writing a checkpoint), and expiry aborts the whole job, so it cannot be
# seconds; JAX's 300 s holds a process behind a hung peer for five minutes.


def is_valid_job_id(job_id: str) -> bool:
    """Whether ``job_id`` can name shared-memory segments (1-64 letters and digits).

    No ``-``: the prefix ``jaxcomm-<id>-`` of one job must never match another job's.
    """
    return bool(_JOB_ID_RE.match(job_id))


def new_job_id() -> str:
    """A fresh random job id (12 hex digits), e.g. ``"3f9a0c51d2e7"``."""
    return secrets.token_hex(6)


def new_job_secret() -> str:
    """A fresh per-job secret: 32 random bytes as 64 hex digits."""
    return secrets.token_hex(32)


def shm_prefix(job_id: str | None = None) -> str:
    """The prefix of every shared-memory segment name of this job: ``jaxcomm-<id>-``.

    Transports name their segments with it (``/dev/shm/`` + prefix + anything), so that
    ``python -m jaxcomm.launch`` can find and remove leftovers after the job.

    Example::

        name = distributed.shm_prefix() + f"p{rank}-ring"   # 'jaxcomm-3f9a0c51d2e7-p1-ring'
    """
    return f"{SHM_PREFIX}{job_id or get_job_id()}-"


def _env_int(name: str, env: dict[str, str] | None) -> int:
    raw = config.raw(name, env)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"jaxcomm.init(): {name}={raw!r} is not an integer (set by "
                         f"python -m jaxcomm.launch; was the environment edited?)") from None


def _env_seconds(name: str, env: dict[str, str] | None = None) -> int:
    """Timeout variable ``name`` in whole seconds (jax.distributed's unit), validated."""
    return config.seconds(name, env)


def launch_spec(env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """What ``python -m jaxcomm.launch`` told this process, or None if it did not start it.

    Returns ``{"coordinator": "127.0.0.1:PORT", "num_processes": N, "process_id": I,
    "local_devices": D or None, "job_id": "..." or None}``; raises ValueError naming the
    variable when they are present but inconsistent.

    Example::

        spec = launch_spec()
        if spec is not None:
            print(f"process {spec['process_id']} of {spec['num_processes']}")
    """
    if not config.is_set(ENV_COORDINATOR, env):
        return None
    missing = [v for v in (ENV_NUM_PROCESSES, ENV_PROCESS_ID) if not config.is_set(v, env)]
    if missing:
        raise ValueError(f"jaxcomm.init(): {ENV_COORDINATOR} is set but {', '.join(missing)} "
                         f"is not; start the script with python -m jaxcomm.launch or set all "
                         f"three")
    n = _env_int(ENV_NUM_PROCESSES, env)
    rank = _env_int(ENV_PROCESS_ID, env)
    if n < 1 or not 0 <= rank < n:
        raise ValueError(f"jaxcomm.init(): need {ENV_NUM_PROCESSES} >= 1 and 0 <= "
                         f"{ENV_PROCESS_ID} < {ENV_NUM_PROCESSES}, got {n} and {rank}")
    job_id = config.raw(ENV_JOB_ID, env) or None
    if job_id is not None and not is_valid_job_id(job_id):
        raise ValueError(f"jaxcomm.init(): {ENV_JOB_ID}={job_id!r} must be 1-64 letters or "
                         f"digits")
    devices = _env_int(ENV_LOCAL_DEVICES, env) if config.is_set(ENV_LOCAL_DEVICES, env) else None
    return dict(coordinator=config.raw(ENV_COORDINATOR, env), num_processes=n, process_id=rank,
                local_devices=devices, job_id=job_id)


def detected_cluster(env: dict[str, str] | None = None) -> str | None:
    """The multi-process launcher JAX can configure itself from, or None.

    ``"slurm"`` under ``srun`` with more than one task, ``"ompi"`` under Open MPI's
    ``mpirun`` (4.x, which JAX detects by ``OMPI_MCA_orte_hnp_uri``) with more than one
    process, ``"mpi4py"`` under another MPI launcher with more than one process when
    mpi4py is importable. A single-task SLURM allocation (``salloc``, a batch script
    running plain ``python``) is not a multi-process job and gives None.
    """
    from jaxcomm._src import mpi

    env = os.environ if env is None else env

    def more_than_one(name: str) -> bool:
        return mpi.more_than_one(env, name)

    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
             "SLURM_LOCALID")
    if all(v in env for v in slurm) and more_than_one("SLURM_NTASKS"):
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and more_than_one("OMPI_COMM_WORLD_SIZE"):
        return "ompi"
    if any(more_than_one(v) for v in mpi.LAUNCHER_SIZES):
        import importlib.util
        if importlib.util.find_spec("mpi4py") is not None:
            return "mpi4py"
        raise RuntimeError(
            "jaxcomm.init(): this looks like an MPI job with several processes, but JAX "
            "can only configure itself under it through mpi4py (not importable) or Open "
            f"MPI 4's mpirun; pip install mpi4py, or set {ENV_COORDINATOR}, "
            f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} yourself")
    return None


def _set_parent_death_signal(launcher_pid: str | None) -> None:
    """Asks Linux to send SIGTERM to this process when its parent dies.

    Without it, a launcher killed with SIGKILL leaves its processes running, often blocked
    forever in a collective. The parent is the launcher, or a wrapper the launcher started
    (``bash run.sh``), whose death is as good a reason to stop. If the launcher died
    before this call, the signal would never come: stop now. Best effort, Linux only.
    """
    if not sys.platform.startswith("linux") or not launcher_pid:
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        try:
            os.kill(int(launcher_pid), 0)
        except ProcessLookupError:
            os.kill(os.getpid(), signal.SIGTERM)
        except PermissionError:
            pass  # it exists (as another user's process: pid reuse, or a setuid launcher)
    except (OSError, AttributeError, ValueError):
        pass


def _initialize_kwargs(**kwargs: Any) -> dict[str, Any]:
    """``kwargs`` less those this jax's ``jax.distributed.initialize`` does not take."""
    import jax
    accepted = inspect.signature(jax.distributed.initialize).parameters
    dropped = sorted(k for k in kwargs if k not in accepted)
    if dropped:
        log.info("jax %s's jax.distributed.initialize does not take %s; not set",
                 jax.__version__, ", ".join(dropped))
    return {k: v for k, v in kwargs.items() if k in accepted}


def _use_gloo() -> None:
    """Makes XLA:CPU's own collectives work across processes (gloo over TCP).

    An explicit other choice (``mpi``) is kept: it also works across processes.
    """
    import jax
    current = getattr(jax.config, "jax_cpu_collectives_implementation", None)
    if current in (None, "", "none", "gloo"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


_failed_with: int | None = None


def _install_fail_fast() -> None:
    """After an uncaught exception, exit at once instead of in JAX's shutdown barrier.

    Python calls ``sys.excepthook`` for an uncaught exception (not for ``SystemExit``),
    then runs the atexit handlers last registered first; this one is registered after
    jax's (which enters the barrier), so it runs before it.
    """
    previous = sys.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        global _failed_with
        _failed_with = 128 + int(signal.SIGINT) if issubclass(tp, KeyboardInterrupt) else 1
        previous(tp, value, tb)
        text = str(value)
        if "jaxcomm" in text and "Error dispatching computation" in text:
            # JAX wrapped the error once per computation the failed one fed: the first
            # failure, on a line of its own.
            from jaxcomm._src import error_text
            print(f"jaxcomm: the first failure: {error_text.clean(text)}", file=sys.stderr)

    def exit_now() -> None:
        if _failed_with is None:
            return
        try:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(_failed_with)

    sys.excepthook = hook
    atexit.register(exit_now)


def init(*, timeout_s: float | None = None, heartbeat_timeout_s: float | None = None,
         shutdown_timeout_s: float | None = None, cluster_detection: bool = True,
         fail_fast: bool = True) -> bool:
    """Joins the multi-process job this process was started in, if any.

    Call it at the top of a script, before anything creates a JAX backend (computations,
    ``jax.devices()``, ``device_put``). It calls ``jax.distributed.initialize`` with the
    coordinator, process count and process id that ``python -m jaxcomm.launch`` put into
    the environment (``JAXCOMM_COORDINATOR``, ``JAXCOMM_NUM_PROCESSES``,
    ``JAXCOMM_PROCESS_ID``), selects gloo for XLA:CPU's own collectives, and sets JAX's
    heartbeat and shutdown timeouts shorter than JAX's (10 s and 60 s, not 100 s and
    300 s), so a process whose peer died is not held for minutes in JAX's shutdown
    barrier; a process ending with an uncaught exception skips that barrier.

    Without the launcher's variables, and with ``cluster_detection`` (the default), a job
    started by ``srun`` (SLURM) or ``mpirun`` with more than one process is joined
    through JAX's own cluster detection. Otherwise, or when ``jax.distributed`` is already
    initialized, it does nothing. Where jaxcomm links hosts through MPI (an MPI launcher
    and mpi4py, or ``JAXCOMM_TRANSPORT=mpi``), it also duplicates MPI's world for jaxcomm
    (collective: every process of the MPI job calls ``init()``).

    Args:
      timeout_s: how long to wait for every process to join (default
        ``JAXCOMM_INIT_TIMEOUT_S`` or 60 s).
      heartbeat_timeout_s: JAX declares a process dead after this long without a
        heartbeat, and then aborts all the others (default ``JAXCOMM_HEARTBEAT_TIMEOUT_S``
        or 10 s).
      shutdown_timeout_s: how long an exiting process waits for the others in JAX's
        shutdown barrier; on expiry JAX aborts the whole job (default
        ``JAXCOMM_SHUTDOWN_TIMEOUT_S`` or 60 s).
      cluster_detection: join SLURM / MPI jobs detected from their environment.
      fail_fast: a process ending with an uncaught exception exits at once, skipping
        JAX's shutdown barrier (see the module docstring).

    Returns:
      True if this process is part of a multi-process job (joined now or before), False
      if it runs alone.

    Raises:
      RuntimeError: launched as part of a job, but a JAX backend already exists (the
        process could then only see its own devices); or an MPI job JAX cannot join.
      ValueError: the launcher's variables are inconsistent.

    Example (first thing in a script; under ``python -m jaxcomm.launch -n 2`` it returns True)::

        >>> import jax, jaxcomm
        >>> jaxcomm.init()                      # run alone: nothing to join
        False
        >>> mesh = jax.make_mesh((jax.device_count(),), ("x",))   # spans all processes
    """
    import jax

    if jax.distributed.is_initialized():
        _ensure_job_id()
        return True
    spec = launch_spec()
    cluster = None if spec is not None or not cluster_detection else detected_cluster()
    if spec is None and cluster is None:
        return False
    if _backends_initialized():
        raise RuntimeError(
            "jaxcomm.init() must run before anything creates a JAX backend (a computation, "
            "jax.devices(), jax.device_put, ...): this process belongs to a "
            + (f"{spec['num_processes']}-process job started by jaxcomm.launch"
               if spec is not None else f"{cluster} job")
            + " but its backend already exists, so it could only see its own devices")
    timeouts = dict(
        initialization_timeout=(int(-(-timeout_s // 1)) if timeout_s is not None else
                                _env_seconds("JAXCOMM_INIT_TIMEOUT_S")),
        heartbeat_timeout_seconds=(
            max(1, int(-(-heartbeat_timeout_s // 1))) if heartbeat_timeout_s is not None else
            _env_seconds("JAXCOMM_HEARTBEAT_TIMEOUT_S")),
        shutdown_timeout_seconds=(
            max(1, int(-(-shutdown_timeout_s // 1))) if shutdown_timeout_s is not None else
            _env_seconds("JAXCOMM_SHUTDOWN_TIMEOUT_S")),
    )
    _use_gloo()
    if spec is not None:
        _set_parent_death_signal(config.raw(ENV_LAUNCHER_PID) or None)
        # JAX's preemption service catches SIGTERM to let a job checkpoint before a
        # scheduler stops it; from the launcher, SIGTERM means "stop now" (it follows a
        # failure elsewhere), and caught, it only delays the SIGKILL that follows.
        jax.config.update("jax_enable_preemption_service", False)
        if config.get(ENV_KEEP_GOING):
            # Survivors of a dead process keep running (jaxcomm.ft); JAX's coordination
            # service would otherwise abort them at its heartbeat timeout. (This only
            # matters where process 0 hosts the service; the launcher's own service is
            # started recoverable for --keep-going.)
            jax.config.update("jax_enable_recoverability", True)
        # "deactivate": everything is given; do not let a surrounding SLURM/MPI
        # environment (say, pytest run inside an allocation) override the launcher's.
        kwargs = _initialize_kwargs(coordinator_address=spec["coordinator"],
                                    num_processes=spec["num_processes"],
                                    process_id=spec["process_id"],
                                    cluster_detection_method="deactivate", **timeouts)
    else:
        kwargs = _initialize_kwargs(
            cluster_detection_method=cluster if cluster == "mpi4py" else None, **timeouts)
    external = config.get(ENV_SERVICE) or ""
    try:
        with _no_service_in_this_process(external == "external"):
            jax.distributed.initialize(**kwargs)
    except Exception as exc:
        where = (f"process {spec['process_id']} of {spec['num_processes']}, coordinator "
                 f"{spec['coordinator']}" if spec is not None else f"{cluster} job")
        raise RuntimeError(f"jaxcomm.init(): jax.distributed.initialize failed ({where}): "
                           f"{exc}") from exc
    if fail_fast:
        _install_fail_fast()
    if jax.config.jax_enable_recoverability and _hosts_the_service():
        _outlive_the_others(timeouts["shutdown_timeout_seconds"])
    _ensure_job_id()
    from jaxcomm._src import mpi
    if mpi.wanted():
        # MPI between hosts: jaxcomm's communicator is duplicated now, while every process
        # of the MPI job is here (the duplicate is collective).
        mpi.prepare(timeouts["initialization_timeout"], jax.process_index(), jax.process_count())
    return True


@contextlib.contextmanager
def _no_service_in_this_process(external: bool) -> Iterator[None]:
    """While ``external``, ``jax.distributed.initialize`` in process 0 connects to the
    coordination service instead of starting it (it runs elsewhere: the launcher's).

    JAX's ``State.initialize`` starts the service in process 0 through
    ``_jax.get_distributed_runtime_service`` and keeps the result only to shut it down;
    the module's ``_jax`` is swapped for the call with a view whose service is a no-op.
    Everything else (client, timeouts, partition index, preemption) stays JAX's own.
    """
    if not external:
        yield
        return
    from jax._src import distributed as jax_distributed

    real = jax_distributed._jax

    class _ExternalService:
        def shutdown(self) -> None:
            pass

    class _View:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def get_distributed_runtime_service(*args: Any, **kwargs: Any) -> _ExternalService:
            return _ExternalService()

    jax_distributed._jax = _View()
    try:
        yield
    finally:
        jax_distributed._jax = real


def _hosts_the_service() -> bool:
    """Whether this process runs the job's coordination service (JAX's process 0)."""
    from jax._src import distributed as jax_distributed
    service = jax_distributed.global_state.service
    return service is not None and type(service).__name__ != "_ExternalService"


def _outlive_the_others(timeout_s: float) -> None:
    """Process 0 of a recoverable job waits at exit for the others to leave first.

    Recoverability drops JAX's shutdown barrier, and process 0 hosts the coordination
    service: were it to exit first, the others would abort in their own shutdown (their
    disconnect RPC fails). Registered after ``jax.distributed.initialize``, this runs
    before JAX's own exit handler. Bounded by the shutdown timeout.
    """
    import jax

    client = kv_client()
    everyone = list(range(jax.process_count()))

    def wait() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if not set(client.get_live_nodes(everyone)) - {0}:
                    return
            except Exception:  # the service is going away: nothing left to wait for
                return
            time.sleep(0.05)

    atexit.register(wait)


def _backends_initialized() -> bool:
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()


def kv_client() -> Any:
    """The jax.distributed coordination service's client (key-value store), or None.

    Its ``key_value_set(key, value)``, ``blocking_key_value_get(key, timeout_in_ms)``,
    ``key_value_try_get(key)`` and ``wait_at_barrier(id, timeout_in_ms)`` are what
    jaxcomm's multi-process bootstrap uses.

    Example::

        client = kv_client()
        client.key_value_set(f"myjob/port/{jax.process_index()}", "40123")
        peer_port = client.blocking_key_value_get("myjob/port/0", 10_000)
    """
    from jax._src import distributed as _jax_distributed
    return _jax_distributed.global_state.client


_job_id: str | None = None


def _agree(key: str, proposal: str, timeout_s: float) -> str:
    """One value for ``key`` in every process: each proposes one in the key-value store
    and the first write wins (no process has to go first). ``proposal`` when there is
    no store (a single process)."""
    client = kv_client()
    if client is None:
        return proposal
    try:
        client.key_value_set(key, proposal)
    except Exception:  # someone else's proposal was first: use theirs
        pass
    return client.blocking_key_value_get(key, int(timeout_s * 1000))


def _ensure_job_id(timeout_s: float = 60.0) -> str:
    """Agrees one job id among all processes and puts it into ``JAXCOMM_JOB_ID``.

    Under the launcher it is given. Otherwise (mpirun, srun) every process proposes a
    random one in the key-value store and the first write wins: no process has to go
    first, so it works whichever process calls this first or last.
    """
    global _job_id
    given = config.raw(ENV_JOB_ID)
    if given:
        _job_id = given
        return given
    if _job_id is not None:
        return _job_id
    job_id = _agree(_JOB_ID_KEY, new_job_id(), timeout_s)
    _job_id = job_id
    os.environ[ENV_JOB_ID] = job_id
    return job_id


def get_job_id() -> str:
    """This job's id: the same string in every process of the job.

    ``JAXCOMM_JOB_ID`` if set (by the launcher, or by :func:`init` after agreeing one in
    the key-value store); in a single process, a random id fixed for its lifetime.

    Example::

        get_job_id()   # '3f9a0c51d2e7'
    """
    return _ensure_job_id()


_job_secret: bytes | None = None


def job_secret(timeout_s: float = 60.0) -> bytes:
    """This job's secret: 32 bytes every process of the job shares, and nobody else.

    The launcher draws it (``JAXCOMM_JOB_SECRET``, 64 hex digits, in the workers'
    environment only). Without the launcher (mpirun, srun), every process proposes a
    random one in the coordination service's key-value store and the first write wins,
    as for the job id: then it is as private as that store, which JAX does not
    authenticate (anyone who can reach the coordinator's port can read it). A TCP
    connection between jaxcomm processes must start with it (ffi/cpu/transport/tcp_link.h).

    Example::

        len(job_secret())   # 32
    """
    global _job_secret
    if _job_secret is not None:
        return _job_secret
    given = config.raw(ENV_SECRET).lower()
    if given:
        if not _SECRET_RE.match(given):
            raise ValueError(f"{ENV_SECRET} must be 64 hex digits (set by python -m "
                             f"jaxcomm.launch; was the environment edited?)")
        secret = given
    else:
        secret = _agree(_SECRET_KEY, new_job_secret(), timeout_s)
    _job_secret = bytes.fromhex(secret)
    return _job_secret
