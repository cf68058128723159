"""Starts a multi-process JAX job on this machine: ``python -m jaxcomm.launch``.

    python -m jaxcomm.launch -n 4 [--devices-per-process 2] script.py [args ...]
    python -m jaxcomm.launch -n 2 -m jaxcomm.bench.multiprocess [args ...]

Each of the ``n`` processes gets its place in the job through environment variables
(``JAXCOMM_COORDINATOR=127.0.0.1:<free port>``, ``JAXCOMM_NUM_PROCESSES``,
``JAXCOMM_PROCESS_ID``, ``JAXCOMM_LOCAL_DEVICES``, ``JAXCOMM_JOB_ID``,
``JAXCOMM_LAUNCHER_PID``, ``JAXCOMM_COORDINATION_SERVICE``, ``JAXCOMM_JOB_SECRET``; see
:mod:`jaxcomm._src.distributed`), which ``jaxcomm.init()`` in the script turns into
``jax.distributed.initialize(...)``. ``XLA_FLAGS`` gets
``--xla_force_host_platform_device_count=<devices per process>``.

JAX's coordination service (key-value store, heartbeats) runs in a process of the
launcher's (:mod:`jaxcomm.launch.coordinator`), not in process 0: any process, process 0
included, may die without JAX aborting the others, which then get jaxcomm's error naming
it (and with ``keep_going``, ``jaxcomm.ft.all_reduce`` goes on without it).

Every line a process prints is prefixed with its process index (``[1] ...``), on the
stream it was printed to. (jaxcomm's words: a *process* is one of the job's Python
processes, numbered by ``jax.process_index()``; a *rank* is a device's place in a
collective's group, as in jaxcomm's errors: ``ranks [4 5 6 7]``.) When a process fails
(non-zero exit or a signal), the others get a grace period to report their own errors,
then are terminated (SIGTERM, then SIGKILL); with ``JAXCOMM_TRACE_DIR`` set, each is first
asked for its flight recorder dump (SIGUSR1) and given a moment to write it. The launcher
exits with the status of the failing process the others' errors lead back to, else of
the first to fail (128 + N for signal N), and ends with a summary: each failed process's
jaxcomm error (without what JAX's dispatch wraps around it), the process those errors
lead back to first, and under ``JAXCOMM_TRACE_DIR`` the flight recorder's verdict. Ctrl-C is
forwarded to the processes (twice: they are killed). Afterwards, shared-memory segments
``/dev/shm/jaxcomm-<job id>-*`` left by the job are removed and reported.

From Python (the launcher itself never imports jax)::

    from jaxcomm import launch
    code = launch.run(["train.py", "--steps", "10"], 2, devices_per_process=4)
    res = launch.launch(["check.py"], 4, capture=True, timeout_s=60)
    res.returncode, res.output(1)     # exit status, process 1's lines
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Iterator, Sequence

import jaxcomm
from jaxcomm._src import config as _config, distributed as _dist
from jaxcomm.launch.placement import LOCAL, Placement
from jaxcomm.trace import causes as _causes

__all__ = ["LaunchResult", "Placement", "free_port", "launch", "main", "run"]

#: Seconds the other processes get to report their own errors after one failed.
DEFAULT_GRACE_S = 10.0
#: Seconds between SIGTERM and SIGKILL when terminating processes.
TERM_TIMEOUT_S = 5.0
#: Seconds to wait for output to drain and killed processes to be reaped.
_DRAIN_TIMEOUT_S = 5.0
#: Seconds a process asked for its flight recorder dump (SIGUSR1) gets to write it
#: before it is terminated.
DUMP_WAIT_S = 2.0
#: Seconds the coordination service's process gets to start listening (it imports jaxlib).
_SERVICE_START_S = 60.0
_POLL_S = 0.05
#: Exit status when the job ran past ``timeout_s`` (as coreutils ``timeout``).
TIMEOUT_EXIT = 124

_SHM_DIR = "/dev/shm"


@dataclasses.dataclass
class LaunchResult:
    """What happened to a launched job.

    Attributes:
      returncode: the launcher's exit status: 0 if every process exited 0; else the status
        of the failing process the others' jaxcomm errors lead back to (``cause``), or
        of the first to fail (128 + N if it died of signal N), 124 if the job ran past
        its timeout, 128 + N if the launcher was interrupted by signal N.
      returncodes: each process's ``Popen.returncode`` (negative: killed by that signal).
      failed_process: the failing process the others' errors lead back to, else the first
        seen to fail, or None (``failed_rank`` is the same, its former name).
      terminated: the processes the launcher had to terminate.
      timed_out: the job ran past ``timeout_s``.
      removed_shm: leftover shared-memory files the launcher removed.
      job_id: the job's ``JAXCOMM_JOB_ID``.
      lines: with ``capture=True``, every output line as (process, "stdout"/"stderr",
        text), in the order received; process -1 holds the launcher's own notes.
      errors: each failed process's last jaxcomm error, cleaned (:func:`causes.clean`).
      cause: the processes those errors lead back to (:func:`causes.consequences`):
        those that failed first, not those that gave up on them.
      verdict: the flight recorder analyzer's verdict line over this job's records
        (``JAXCOMM_TRACE_DIR`` set and the job failed), else "".
      exit_times: when each process was seen to end (``time.monotonic()``).
    """

    returncode: int
    returncodes: list[int | None]
    failed_process: int | None = None
    terminated: list[int] = dataclasses.field(default_factory=list)
    timed_out: bool = False
    removed_shm: list[str] = dataclasses.field(default_factory=list)
    job_id: str = ""
    lines: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)
    errors: dict[int, str] = dataclasses.field(default_factory=dict)
    cause: list[int] = dataclasses.field(default_factory=list)
    verdict: str = ""
    exit_times: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def failed_rank(self) -> int | None:
        """:attr:`failed_process`, by its former name (a process index, not a rank)."""
        return self.failed_process

    def output(self, process: int, stream: str | None = None) -> str:
        """Process ``process``'s captured lines (both streams, or ``"stdout"``/``"stderr"``)."""
        return "".join(text + "\n" for r, s, text in self.lines
                       if r == process and (stream is None or s == stream))

    def format(self) -> str:
        """All captured output as the terminal would have shown it, for error messages."""
        return "".join((f"[{r}] " if r >= 0 else "jaxcomm.launch: ") + f"{text}\n"
                       for r, _, text in self.lines)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it).

    Another program may take it before the coordinator binds it; the job then fails at
    startup with JAX's bind error, and a rerun picks another port.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _with_device_count(xla_flags: str, count: int) -> str:
    """``xla_flags`` with its host device count replaced by ``count`` (other flags kept)."""
    flags = [f for f in xla_flags.split()
             if not f.startswith("--xla_force_host_platform_device_count=")]
    return " ".join(flags + [f"--xla_force_host_platform_device_count={int(count)}"])


def _package_root() -> str:
    """The directory holding the ``jaxcomm`` package the launcher itself runs from."""
    return os.path.dirname(os.path.dirname(os.path.abspath(jaxcomm.__file__)))


def _command(argv: Sequence[str], module: bool) -> list[str]:
    """The command line of each process: scripts and modules run by this Python."""
    argv = list(argv)
    if not argv:
        raise ValueError("nothing to launch: give a script (or -m module) and its arguments")
    if module:
        return [sys.executable, "-m", *argv]
    if argv[0].endswith(".py"):
        return [sys.executable, *argv]
    return argv


def _rank_env(base: dict[str, str], n: int, rank: int, devices: int, coordinator: str,
              job_id: str, keep_going: bool = False, secret: str = "") -> dict[str, str]:
    secret = secret or _dist.new_job_secret()
    env = dict(base)
    if keep_going:
        env[_dist.ENV_KEEP_GOING] = "1"
    env["XLA_FLAGS"] = _with_device_count(env.get("XLA_FLAGS", ""), devices)
    # Lines must reach the launcher as they are printed, not when a buffer fills.
    env["PYTHONUNBUFFERED"] = "1"
    # The processes must import the same jaxcomm as the launcher, wherever the script is.
    root = _package_root()
    path = env.get("PYTHONPATH", "")
    if root not in path.split(os.pathsep):
        env["PYTHONPATH"] = root + (os.pathsep + path if path else "")
    env.update({
        _dist.ENV_COORDINATOR: coordinator,
        _dist.ENV_NUM_PROCESSES: str(n),
        _dist.ENV_PROCESS_ID: str(rank),
        _dist.ENV_LOCAL_DEVICES: str(devices),
        _dist.ENV_JOB_ID: job_id,
        _dist.ENV_LAUNCHER_PID: str(os.getpid()),
        _dist.ENV_SERVICE: "external",
        _dist.ENV_SECRET: secret,
    })
    return env


class _Output:
    """Forwards the processes' output line by line, each prefixed with its process index.

    One reader thread per pipe; a line is written with a single write under a lock, so
    lines of different processes never interleave mid-line. A last line without a
    newline is completed with one.
    """

    def __init__(self, capture: bool, stdout: IO[str] | None, stderr: IO[str] | None) -> None:
        self.capture = capture
        self.sinks = {"stdout": stdout or sys.stdout, "stderr": stderr or sys.stderr}
        self.lines: list[tuple[int, str, str]] = []
        self.errors: dict[int, str] = {}  # process -> its last jaxcomm error line
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def start(self, rank: int, stream_name: str, pipe: IO[bytes]) -> None:
        t = threading.Thread(target=self._pump, args=(rank, stream_name, pipe),
                             name=f"jaxcomm-launch-{rank}-{stream_name}", daemon=True)
        t.start()
        self.threads.append(t)

    def _pump(self, rank: int, stream_name: str, pipe: IO[bytes]) -> None:
        try:
            for raw in iter(pipe.readline, b""):
                self.emit(rank, stream_name, raw.decode("utf-8", "replace").rstrip("\r\n"))
        except (OSError, ValueError):
            pass  # the pipe was closed under us while giving up on a stuck process
        finally:
            try:
                pipe.close()
            except OSError:
                pass

    def emit(self, rank: int, stream_name: str, text: str) -> None:
        with self.lock:
            if rank >= 0 and _causes.is_jaxcomm_error(text):
                self.errors[rank] = text
            if self.capture:
                self.lines.append((rank, stream_name, text))
                return
            prefix = f"[{rank}] " if rank >= 0 else "jaxcomm.launch: "
            sink = self.sinks[stream_name]
            try:
                sink.write(prefix + text + "\n")
                sink.flush()
            except (OSError, ValueError):
                pass  # our own stdout went away (a closed pipe): keep running the job

    def note(self, text: str) -> None:
        """A message of the launcher itself (stderr, or process -1 when capturing)."""
        self.emit(-1, "stderr", text)

    def join(self, deadline: float) -> bool:
        """Waits for every pipe to reach end of file until ``deadline``; True if all did."""
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _exit_status(code: int) -> int:
    """A process's ``Popen.returncode`` as a shell reports it (signal N -> 128 + N)."""
    return 128 - code if code < 0 else code


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Sends ``sig`` to the process and everything it started (its own session)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except (ProcessLookupError, OSError):
            pass


def _kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILLs every live process (and what it started) and reaps it, within a deadline."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal_group(p, signal.SIGKILL)
    deadline = time.monotonic() + _DRAIN_TIMEOUT_S
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # uninterruptible sleep: the kernel reaps it when it can


def _remove_shm(job_id: str) -> list[str]:
    """Removes ``/dev/shm/jaxcomm-<job id>-*``; returns the paths it removed."""
    removed = []
    for path in sorted(glob.glob(os.path.join(_SHM_DIR, glob.escape(_dist.shm_prefix(job_id)))
                                 + "*")):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass  # unlinked by its owner meanwhile
        except OSError:
            pass  # not ours to remove (permissions): left, and not reported as removed
    return removed


class _Service:
    """JAX's coordination service for the job, in a process of its own (coordinator.py).

    Started before the processes, on the port given or a free one (retried if another
    program takes a free one first), and stopped after every process has ended: closing
    its standard input stops it.
    """

    def __init__(self, n: int, port: int | None, env: dict[str, str], keep_going: bool,
                 out: _Output, placement: Placement = LOCAL) -> None:
        from jaxcomm.launch import coordinator

        heartbeat = _dist._env_seconds("JAXCOMM_HEARTBEAT_TIMEOUT_S", env)
        shutdown = _dist._env_seconds("JAXCOMM_SHUTDOWN_TIMEOUT_S", env)
        why = ""
        for _ in range(1 if port else 3):
            # Free here; on another host (a placement) it may be taken: the service then
            # says so, and another is tried.
            port_here = port or free_port()
            address = f"{placement.service_address}:{port_here}"
            # Run as a script: it imports only jaxlib, not jaxcomm's package (nor jax).
            cmd = [*placement.service_prefix, sys.executable, coordinator.__file__,
                   "--address", address, "--processes", str(n), "--heartbeat-s", str(heartbeat),
                   "--shutdown-s", str(shutdown)] + (["--recoverable"] if keep_going else [])
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         start_new_session=True)
            line = self._first_line()
            if line.startswith("ready "):
                self.address = f"{placement.coordinator_host}:{port_here}"
                threading.Thread(target=self._forward, args=(out,), daemon=True,
                                 name="jaxcomm-launch-service").start()
                return
            why = line or ("it exited" if self.proc.poll() is not None
                           else f"it did not listen within {_SERVICE_START_S:g} s")
            self.stop()
        raise RuntimeError(f"could not start the job's coordination service on {address}: {why}")

    def _first_line(self) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], _SERVICE_START_S)
        if not ready:
            return ""
        return self.proc.stdout.readline().decode("utf-8", "replace").strip()

    def _forward(self, out: _Output) -> None:
        """The service's errors (glog lines "E..."/"F...": a process stopped sending
        heartbeats) become launcher notes; the rest of its log is dropped."""
        assert self.proc.stderr is not None
        try:
            for raw in iter(self.proc.stderr.readline, b""):
                text = raw.decode("utf-8", "replace").rstrip()
                if text[:1] in ("E", "F") and text[1:5].isdigit():
                    out.note("coordination service: " + text.split("] ", 1)[-1])
        except (OSError, ValueError):
            pass

    def stop(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # end of input: the service stops
            self.proc.wait(TERM_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            try:
                self.proc.wait(_DRAIN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass


def rank_cores(rank: int, n: int) -> set[int] | None:
    """The cores process ``rank`` of ``n`` is bound to, or None (more processes than cores).

    Each process gets ``cores // n`` of this process's usable cores, consecutive. Two
    processes that share memory wait for each other by spinning: left to the scheduler on
    2 cores, they often shared one, and a 4 B all_reduce across them took 12-20 us instead
    of 2 us (as mpirun's binding gives mpi4jax), until waiting threads learned to move
    off a core their peer spins on (ffi/cpu/transport/world_internal.h, PeerSpin).

    Example::

        rank_cores(1, 2)   # {1} on a 2-core machine
    """
    usable = sorted(os.sched_getaffinity(0))
    if n > len(usable):
        return None
    share = len(usable) // n
    return set(usable[rank * share:(rank + 1) * share])


@contextlib.contextmanager
def _affinity(cores: set[int] | None) -> Iterator[None]:
    """Runs the block with this thread bound to ``cores``: a process started in it
    inherits the binding from its first instruction, before it starts any thread."""
    if not cores:
        yield
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def launch(argv: Sequence[str], n: int, *, devices_per_process: int = 1,
           grace_s: float = DEFAULT_GRACE_S, timeout_s: float | None = None,
           module: bool = False, env: dict[str, str] | None = None,
           capture: bool = False, stdout: IO[str] | None = None,
           stderr: IO[str] | None = None, job_id: str | None = None,
           port: int | None = None, cwd: str | None = None,
           forward_signals: bool = False, keep_going: bool = False,
           bind: str = "none", placement: Placement | None = None) -> LaunchResult:
    """Runs ``argv`` as ``n`` processes of one JAX job on this machine and waits for them.

    Args:
      argv: a script and its arguments (``["train.py", "--lr", "3e-4"]``, run with this
        Python), a module and its arguments with ``module=True``, or any command.
      n: number of processes.
      devices_per_process: CPU devices each process gets (``XLA_FLAGS``).
      grace_s: after a process fails, how long the others may keep running to report
        their own errors before they are terminated.
      timeout_s: terminate the job after this many seconds (None: no limit; the job's
        own length is the caller's to bound). Status 124 then.
      module: ``argv[0]`` names a module (``python -m``).
      env: the processes' base environment (default: this process's).
      capture: collect the output in the result's ``lines`` instead of printing it.
      stdout, stderr: where to print the prefixed lines (default: sys.stdout/stderr).
      job_id: ``JAXCOMM_JOB_ID`` (default: a fresh random one).
      port: the coordinator's port on 127.0.0.1 (default: a free one).
      cwd: the processes' working directory.
      forward_signals: install SIGINT/SIGTERM/SIGHUP handlers for the duration that pass
        the signal on to the processes (the command line does; needs the main thread).
      keep_going: a failed process does not stop the others (for jobs that survive a
        failure, with jaxcomm.ft); :func:`jaxcomm.init` then enables JAX's
        recoverability. The exit status still reports the first failure.
      bind: ``"none"``: the scheduler places the processes; ``"cores"``: when there are
        no more processes than usable cores, each process (all its threads) runs on its
        own share of them, as mpirun binds by default (see :func:`rank_cores`). Small
        jaxcomm collectives between processes then never wait on a shared core (2.6-2.9
        us against 4.4-6.2 unbound, between gloo's calls), but XLA's own thread pools
        share those cores too: on 2 cores, a gloo psum across the 2 bound processes took
        4 ms instead of 0.1 ms.
      placement: where the ranks and the coordination service run (a command prefix per
        rank, the service's address; :class:`jaxcomm.launch.Placement`); default: all
        here, on 127.0.0.1. Binding to cores applies to the prefixes' processes.

    Returns:
      A :class:`LaunchResult`.

    Example::

        res = launch(["hello.py"], 2, capture=True, timeout_s=60)
        assert res.returncode == 0, res.format()
    """
    if n < 1:
        raise ValueError(f"need at least one process, got n={n}")
    if devices_per_process < 1:
        raise ValueError(f"need at least one device per process, got {devices_per_process}")
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    if bind not in ("cores", "none"):
        raise ValueError(f"bind must be 'cores' or 'none', got {bind!r}")
    job_id = job_id or _dist.new_job_id()
    if not _dist.is_valid_job_id(job_id):
        raise ValueError(f"job id {job_id!r} must be 1-64 letters or digits")
    cmd = _command(argv, module)
    base = dict(os.environ if env is None else env)
    out = _Output(capture, stdout, stderr)
    # A secret given in the environment is the job's (tests, or a scheduler that draws
    # it); else a fresh one.
    secret = base.get(_dist.ENV_SECRET) or _dist.new_job_secret()
    if not _dist._SECRET_RE.match(secret):
        raise ValueError(f"{_dist.ENV_SECRET} must be 64 lowercase hex digits")
    placement = placement or LOCAL
    service = _Service(n, port, {**base, _dist.ENV_JOB_ID: job_id}, keep_going, out, placement)
    coordinator = service.address
    trace_dir = _config.raw("JAXCOMM_TRACE_DIR", base) or None

    procs: list[subprocess.Popen] = []
    interrupts: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        interrupts.append(signum)
        # A second Ctrl-C means "now": no more grace for anyone.
        sig = signal.SIGKILL if len(interrupts) > 1 else signum
        for p in procs:
            if p.poll() is None:
                _signal_group(p, sig)

    previous: dict[int, object] = {}
    if forward_signals:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, forward)
    try:
        for rank in range(n):
            if interrupts:
                break  # interrupted while starting: the processes started have the signal
            cores = rank_cores(rank, n) if bind == "cores" else None
            try:
                # A session of its own: the launcher can signal everything a process started,
                # and a terminal's Ctrl-C reaches the launcher only, which forwards it.
                with _affinity(cores):
                    p = subprocess.Popen([*placement.rank_prefix(rank), *cmd],
                                         env=_rank_env(base, n, rank, devices_per_process,
                                                       coordinator, job_id, keep_going, secret),
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, cwd=cwd, start_new_session=True)
            except OSError as exc:
                _kill_all(procs)
                raise RuntimeError(f"could not start process {rank} of {n} "
                                   f"({' '.join(cmd)}): {exc}") from exc
            procs.append(p)
            out.start(rank, "stdout", p.stdout)
            out.start(rank, "stderr", p.stderr)
        result = _supervise(procs, out, grace_s, timeout_s, interrupts, keep_going, trace_dir)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        _kill_all(procs)  # only finds live processes if the launcher itself failed
        service.stop()

    drained = out.join(time.monotonic() + _DRAIN_TIMEOUT_S)
    if not drained:
        # Something a process started outlived it and holds its output pipe open.
        for p in procs:
            _signal_group(p, signal.SIGKILL)
        drained = out.join(time.monotonic() + _DRAIN_TIMEOUT_S)
        out.note("processes started by the job kept its output open after it ended; "
                 "killed them" + ("" if drained else " (some output may be lost)"))
    result.job_id = job_id
    if trace_dir:
        _remove_partial_dumps(trace_dir, [p.pid for p in procs])
    _summarize(result, out, procs, trace_dir, interrupted=bool(interrupts))
    result.removed_shm = _remove_shm(job_id)
    if result.removed_shm:
        out.note(f"removed {len(result.removed_shm)} shared-memory segment(s) the job left "
                 f"behind: {', '.join(result.removed_shm)}")
    result.lines = out.lines
    return result


def _remove_partial_dumps(trace_dir: str, pids: list[int]) -> None:
    """Removes the half-written dumps (``*.json.tmp<pid>``) of processes that ended while
    writing one; their records are in their ring files."""
    for pid in pids:
        for path in glob.glob(os.path.join(glob.escape(trace_dir),
                                           f"jaxcomm-trace-p*-{pid}.json.tmp{pid}")):
            try:
                os.unlink(path)
            except OSError:
                pass


def _summarize(result: LaunchResult, out: _Output, procs: list[subprocess.Popen],
               trace_dir: str | None, interrupted: bool = False) -> None:
    """Notes, after a failed job, each failed process's jaxcomm error (cleaned), the
    processes they lead back to first, and the flight recorder's verdict.

    The process the errors lead back to becomes the failed process whose status the
    launcher exits with: the first process seen to exit is often one that gave up on it.
    """
    failed = [r for r, c in enumerate(result.returncodes) if c not in (0, None)]
    if not failed:
        return
    result.errors = {r: _causes.clean(out.errors[r]) for r in failed if r in out.errors}
    failures = [_causes.Failure(r, result.exit_times.get(r, 0.0), _causes.blames(text))
                for r, text in result.errors.items()]
    secondary = _causes.consequences(failures)
    named = {b.process for f in failures for b in f.blamed}
    result.cause = sorted({q for p in named for q in _causes.root_of(p, secondary)})
    order = sorted(result.errors, key=lambda r: (r not in result.cause, r in secondary,
                                                 result.exit_times.get(r, 0.0)))
    culprit = next((p for p in result.cause if p < len(procs)
                    and result.returncodes[p] not in (0, None)), None)
    if culprit is not None and result.failed_process is not None and not interrupted:
        result.failed_process = culprit
        result.returncode = _exit_status(result.returncodes[culprit])  # type: ignore[arg-type]
    if result.cause:
        what = []
        for p in result.cause:
            code = result.returncodes[p] if p < len(result.returncodes) else None
            what.append(f"process {p}" + (f" ({_describe(code)})" if code is not None else ""))
        if any(_causes.is_mismatch(text) for text in result.errors.values()):
            out.note(f"the processes ran different collectives: {', '.join(what)} waited in "
                     f"one while their peers waited in another (MISMATCH)")
        else:
            out.note(f"the failure starts at {', '.join(what)}: the other processes' errors "
                     f"lead back to it")
    for r in order:
        out.note(f"process {r}: {result.errors[r]}")
    if trace_dir:
        try:
            from jaxcomm.trace import analyzer
            report = analyzer.analyze(trace_dir, pids={p.pid for p in procs})
        except Exception as e:  # noqa: BLE001 - a summary must not fail the launcher
            out.note(f"flight recorder analysis of {trace_dir} failed: {e}")
            return
        result.verdict = report.verdict
        out.note(f"flight recorder ({trace_dir}): {report.verdict}")


def _supervise(procs: list[subprocess.Popen], out: _Output, grace_s: float,
               timeout_s: float | None, interrupts: list[int],
               keep_going: bool = False, trace_dir: str | None = None) -> LaunchResult:
    """Waits for the processes; on a failure, grace, then terminates the rest (unless
    ``keep_going``: then it waits for the survivors)."""
    start = time.monotonic()
    # One waiter per process records when it ended: failures seen in one poll are told
    # apart by when they happened, not by process index.
    exit_times: dict[int, float] = {}

    def wait_for(rank: int, p: subprocess.Popen) -> None:
        p.wait()
        exit_times[rank] = time.monotonic()

    for rank, p in enumerate(procs):
        threading.Thread(target=wait_for, args=(rank, p), daemon=True,
                         name=f"jaxcomm-launch-wait-{rank}").start()
    job_deadline = start + timeout_s if timeout_s is not None else None
    failed_process: int | None = None
    grace_deadline: float | None = None
    timed_out = False
    seen_interrupts = 0
    while True:
        codes = [p.returncode if r in exit_times else None for r, p in enumerate(procs)]
        now = time.monotonic()
        if seen_interrupts < len(interrupts):
            seen_interrupts = len(interrupts)
            out.note(f"got {signal.Signals(interrupts[-1]).name}; passed it on to the "
                     f"processes" + (" as SIGKILL" if seen_interrupts > 1 else ""))
        for rank in sorted(exit_times, key=exit_times.get):
            code = codes[rank]
            if failed_process is None and code is not None and code != 0:
                failed_process = rank
                running = [r for r, c in enumerate(codes) if c is None]
                if keep_going:
                    out.note(f"process {rank} {_describe(code)}" + (
                        f"; processes {running} keep going" if running else ""))
                    continue
                grace_deadline = now + grace_s
                out.note(f"process {rank} {_describe(code)}" + (
                    f"; giving processes {running} {grace_s:g} s to finish" if running else ""))
        if all(c is not None for c in codes):
            break
        if grace_deadline is not None and now >= grace_deadline:
            break
        if job_deadline is not None and now >= job_deadline:
            timed_out = True
            out.note(f"the job ran past its timeout of {timeout_s:g} s")
            break
        time.sleep(_POLL_S)

    terminated = _terminate([p for p in procs if p.poll() is None], out, trace_dir)
    for rank, p in enumerate(procs):
        exit_times.setdefault(rank, time.monotonic())
    codes = [p.returncode for p in procs]
    terminated_processes = [procs.index(p) for p in terminated]
    if terminated_processes:
        out.note(f"terminated processes {terminated_processes}")
    if interrupts:
        status = 128 + interrupts[0]
    elif failed_process is not None:
        status = _exit_status(codes[failed_process])  # type: ignore[arg-type]
    elif timed_out:
        status = TIMEOUT_EXIT
    else:
        # All exited 0, or one failed only while being terminated at the deadline.
        bad = [r for r, c in enumerate(codes) if c not in (0, None)]
        status = _exit_status(codes[bad[0]]) if bad else 0  # type: ignore[arg-type]
    return LaunchResult(returncode=status, returncodes=codes, failed_process=failed_process,
                        terminated=terminated_processes, timed_out=timed_out,
                        exit_times=dict(exit_times))


def _request_dumps(live: list[subprocess.Popen], out: _Output, trace_dir: str) -> None:
    """Asks each process for its flight recorder dump (SIGUSR1, the process itself only)
    and waits up to DUMP_WAIT_S for the dumps to appear (or the processes to end)."""
    asked = time.time()
    for p in live:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except (ProcessLookupError, PermissionError):
            pass

    def dumped(p: subprocess.Popen) -> bool:
        if p.poll() is not None:
            return True
        for path in glob.glob(os.path.join(glob.escape(trace_dir), f"jaxcomm-trace-p*-{p.pid}.json")):
            try:
                if os.stat(path).st_mtime >= asked - 0.05:
                    return True
            except OSError:
                pass
        return False

    deadline = time.monotonic() + DUMP_WAIT_S
    while time.monotonic() < deadline and not all(dumped(p) for p in live):
        time.sleep(_POLL_S)
    out.note(f"asked pids {[p.pid for p in live]} for their flight recorder dumps (SIGUSR1) "
             f"before terminating them")


def _terminate(live: list[subprocess.Popen], out: _Output,
               trace_dir: str | None = None) -> list[subprocess.Popen]:
    """SIGTERM, then after TERM_TIMEOUT_S SIGKILL; returns the processes it signalled.
    With a trace directory, each process is first asked for its dump (SIGUSR1)."""
    if not live:
        return []
    if trace_dir:
        _request_dumps(live, out, trace_dir)
    for p in live:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + TERM_TIMEOUT_S
    while time.monotonic() < deadline and any(p.poll() is None for p in live):
        time.sleep(_POLL_S)
    stubborn = [p for p in live if p.poll() is None]
    for p in stubborn:
        _signal_group(p, signal.SIGKILL)
    for p in stubborn:
        try:
            p.wait(_DRAIN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            out.note(f"pid {p.pid} survived SIGKILL for {_DRAIN_TIMEOUT_S:g} s "
                     f"(uninterruptible sleep?); not waiting for it")
    return live


def run(argv: str | Sequence[str], n: int, **kwargs: object) -> int:
    """Runs a job like :func:`launch` and returns the launcher's exit status.

    ``argv`` may be a script path alone. Output is printed with process prefixes.

    Example::

        from jaxcomm import launch
        status = launch.run("train.py", 2, devices_per_process=4)   # 0: all exited 0
    """
    if isinstance(argv, str):
        argv = [argv]
    return launch(argv, n, **kwargs).returncode  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxcomm.launch``; returns the exit status."""
    from jaxcomm.launch.__main__ import main as cli_main
    return cli_main(argv)
