"""Runs a Python script body as a multi-process JAX job under jaxcomm.launch, for tests.

    from mp_util import run_script, assert_ok

    res = run_script('''
        x = jnp.ones(3) * PROCESS
        print("RESULT", PROCESS, float(x.sum()))
    ''', n=2, devices=2)
    assert_ok(res)                            # else fails with every rank's output
    res.returncode, res.output[1]             # exit status, process 1's stdout+stderr

The body runs after :data:`PROLOGUE`, which imports numpy as np, jax, jax.numpy as jnp,
NamedSharding, PartitionSpec as P, Mesh and jaxcomm, calls ``jaxcomm.init()`` and defines
``PROCESS`` (``jax.process_index()``; also ``RANK``, its name in older tests), ``NPROC``
(``jax.process_count()``) and ``LOCAL`` (devices per process). Pass ``prologue=False`` for a script that must not import jax.

Defaults keep a broken test short: the job is terminated after ``timeout_s`` (60 s),
jaxcomm's collective deadline is ``JAXCOMM_TIMEOUT_S=20``, and the others get ``grace_s``
(5 s) after one process fails. Everything stays on 127.0.0.1 unless a ``placement`` puts
the ranks elsewhere (tests/netns_util.py's hosts).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import textwrap
from typing import Any, NamedTuple, Sequence

from jaxcomm import launch as _launch

PROLOGUE = """\
import os, sys
import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxcomm
jaxcomm.init()
PROCESS = RANK = jax.process_index()
NPROC = jax.process_count()
LOCAL = jax.local_device_count()
"""

#: Environment defaults for the job's processes (a given ``env`` overrides them).
DEFAULT_ENV = {"JAXCOMM_TIMEOUT_S": "20", "JAX_PLATFORMS": "cpu"}


class MPResult(NamedTuple):
    """``(returncode, output)``: the launcher's exit status and each process's output.

    ``output[p]`` is process p's stdout and stderr lines as received (one string);
    ``output[-1]`` the launcher's own notes (failures, terminations, removed segments).
    ``launch`` is the full :class:`jaxcomm.launch.LaunchResult`.
    """

    returncode: int
    output: dict[int, str]
    launch: _launch.LaunchResult

    def format(self) -> str:
        """Every line, prefixed as the terminal shows it."""
        return self.launch.format()


def launch_script(body: str, n: int, devices: int = 1, *, args: Sequence[str] = (),
                  env: dict[str, str] | None = None, timeout_s: float = 60.0,
                  grace_s: float = 5.0, prologue: bool = True,
                  job_id: str | None = None, keep_going: bool = False,
                  bind: str = "none",
                  placement: _launch.Placement | None = None) -> _launch.LaunchResult:
    """Writes ``body`` (dedented, after :data:`PROLOGUE`) to a file and launches it.

    Returns the full :class:`jaxcomm.launch.LaunchResult` (output captured).
    """
    source = (PROLOGUE if prologue else "") + textwrap.dedent(body)
    workdir = tempfile.mkdtemp(prefix="jaxcomm-mp-test-")
    try:
        path = os.path.join(workdir, "script.py")
        with open(path, "w") as f:
            f.write(source)
        job_env = {**os.environ, **DEFAULT_ENV, **(env or {})}
        return _launch.launch([path, *args], n, devices_per_process=devices, env=job_env,
                              capture=True, timeout_s=timeout_s, grace_s=grace_s,
                              job_id=job_id, cwd=workdir, keep_going=keep_going, bind=bind,
                              placement=placement)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_script(body: str, n: int, devices: int = 1, **kwargs: object) -> MPResult:
    """Runs ``body`` as ``n`` processes x ``devices`` CPU devices; ``(code, output)``.

    Keyword arguments as :func:`launch_script` (args, env, timeout_s, grace_s,
    prologue, job_id, keep_going, bind, placement: where the ranks run, e.g. in network
    namespaces, tests/netns_util.py).

    Example::

        code, out = run_script("print('hello from', PROCESS)", n=2)
        assert code == 0 and "hello from 1" in out[1]
    """
    res = launch_script(body, n, devices, **kwargs)  # type: ignore[arg-type]
    output = {r: res.output(r) for r in range(-1, n)}
    return MPResult(res.returncode, output, res)


def assert_ok(res: MPResult) -> None:
    """Fails with every rank's output unless the job exited 0."""
    assert res.returncode == 0, (
        f"multi-process job exited with status {res.returncode} (per process: "
        f"{res.launch.returncodes}); its output:\n{res.format()}")


def results(res: MPResult, tag: str = "RESULT") -> dict[int, Any]:
    """Each process's JSON value printed on a line ``<tag> <json>`` (the last one wins).

    Example: a process printing ``RESULT {"sum": [12.0]}`` gives ``{process: {"sum": [12.0]}}``;
    processes that printed none are missing.
    """
    found: dict[int, Any] = {}
    for rank, text in res.output.items():
        for line in text.splitlines():
            if line.startswith(tag + " "):
                found[rank] = json.loads(line[len(tag) + 1:])
    return found
