"""Runs a Python script body as a multi-process JAX job under ``mpirun``, for tests.

    from mpi_util import run_mpi, mpi_missing

    code, out = run_mpi("print('RESULT', RANK)", n=2)   # out: {rank: its stdout+stderr}

Like :func:`mp_util.run_script`, the body runs after mp_util's prologue (``jaxcomm.init()``
joins the MPI job; ``RANK``, ``NPROC``, ``LOCAL``, np, jax, jnp, P, jaxcomm are ready).
Each process writes its output to a file of its own (named by the rank the launcher gave
it), so the test reads every rank's lines whole, whichever MPI's ``mpirun`` runs it.
Open MPI is told that root may run it (the CI machines run as root).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap

from mp_util import DEFAULT_ENV, PROLOGUE

# Before anything else: this process's output to a file of its own.
REDIRECT = """\
import os as _os
_rank = next(_os.environ[v] for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK") if v in _os.environ)
_fd = _os.open(_os.path.join(_os.environ["MPI_TEST_OUT"], "rank." + _rank), _os.O_WRONLY | _os.O_CREAT | _os.O_TRUNC, 0o644)
_os.dup2(_fd, 1)
_os.dup2(_fd, 2)
"""


def mpi_missing() -> str:
    """Why an MPI job cannot run here ("" when it can)."""
    if shutil.which("mpirun") is None:
        return "no mpirun on PATH (pip install '.[mpi]')"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install '.[mpi]')"
    return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mpi(body: str, n: int, *, env: dict[str, str] | None = None, timeout_s: float = 180.0,
            launcher_args: tuple[str, ...] = (), before_init: str = "",
            launcher: list[str] | None = None) -> tuple[int, dict[int, str]]:
    """Runs ``body`` as ``n`` processes under ``mpirun``; (exit status, {rank: output}).
    ``before_init``: code run before the prologue's ``jaxcomm.init()`` (mpi4py.rc).
    ``launcher``: the argv that starts the ``n`` processes in place of ``mpirun -n N``
    (``VirtualCluster.mpiexec``: across network namespaces)."""
    workdir = tempfile.mkdtemp(prefix="jaxcomm-mpi-test-")
    try:
        path = os.path.join(workdir, "script.py")
        with open(path, "w") as f:
            f.write(REDIRECT + textwrap.dedent(before_init) + PROLOGUE + textwrap.dedent(body))
        # One CPU device per process, whatever the tests' own processes were given.
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        job_env = {**os.environ, **DEFAULT_ENV, "MPI_TEST_OUT": workdir,
                   "XLA_FLAGS": " ".join(flags + ["--xla_force_host_platform_device_count=1"]),
                   # JAX's coordinator (in process 0) on a port of its own: jobs of tests
                   # that run at once must not meet.
                   "JAX_COORDINATOR_PORT": str(free_port()),
                   "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                   **(env or {})}
        cmd = list(launcher) if launcher is not None else ["mpirun", "-n", str(n)]
        if _is_open_mpi():
            cmd += ["--oversubscribe", "--bind-to", "none"]
        cmd += [*launcher_args, sys.executable, path]
        try:
            code = subprocess.run(cmd, env=job_env, cwd=workdir, timeout=timeout_s,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT).returncode
        except subprocess.TimeoutExpired:
            code = 124
        out = {}
        for r in range(n):
            try:
                with open(os.path.join(workdir, f"rank.{r}"), errors="replace") as f:
                    out[r] = f.read()
            except FileNotFoundError:
                out[r] = ""
        return code, out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def keep_going() -> tuple[str, ...] | None:
    """mpirun's options that keep the other processes running when one dies, so that they
    can report it; None where none does. Open MPI's launcher (prterun) ends them at once
    unless told ``--enable-recovery``. MPICH 5.0.2's Hydra ended them even with
    ``-disable-auto-cleanup`` (and with ``MPIR_CVAR_ENABLE_FT=1``): tried here."""
    return ("--enable-recovery",) if _is_open_mpi() else None


def _is_open_mpi() -> bool:
    try:
        text = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in text or "OpenRTE" in text or "prte" in text.lower()


def format_output(out: dict[int, str]) -> str:
    return "\n".join(f"[{r}] {line}" for r, text in sorted(out.items()) for line in text.splitlines())
