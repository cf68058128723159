"""jaxcomm's flight recorder: dumps, analysis and timelines of collective calls.

Every rank (partition) records its last ``JAXCOMM_TRACE_ENTRIES`` (2048) jaxcomm calls:
op, group, call site, execution count, dtype, sizes, peers, algorithm, enqueue / start /
end wall-clock times and state. One JSON file per process holds all its ranks (format:
docs/tracing.md, "Dumps"). Files are written

* by :func:`dump`;
* automatically, when ``JAXCOMM_TRACE_DIR`` is set: on a collective timeout or transport
  error (by a native thread, within about a second) and at interpreter exit (a process
  that recorded no call writes none);
* on ``SIGUSR1`` (to ``JAXCOMM_TRACE_DIR``, else the current directory), unless the
  program installed its own handler for that signal first.

Under ``JAXCOMM_TRACE_DIR`` the rings themselves live in a file mapping,
``jaxcomm-ring-p<process index>-<pid>.bin``, which the kernel keeps however the process
ends (SIGKILL, ``os._exit``, an abort by JAX): :mod:`jaxcomm.trace.ringfile` reads it.

``python -m jaxcomm.trace analyze DIR`` merges the files of all processes and says which
rank is stuck, missing, mismatched or late, cause first; ``python -m jaxcomm.trace export DIR
--perfetto out.json --plot out.png`` draws the timeline.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from typing import Any

from jaxcomm import _jaxcomm
from jaxcomm._src import config

__all__ = ["dump", "snapshot", "set_enabled", "enabled", "dump_path", "analyze"]

# Fail loudly on a malformed setting rather than run without the fault or recorder.
_error = _jaxcomm.fault_error()
if _error:
    raise ValueError(f"jaxcomm: {_error}")
config.trace_entries()


def snapshot(reason: str = "snapshot") -> dict[str, Any]:
    """This process's flight recorder as a dict (the dump's JSON document, parsed).

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
        >>> f = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, "x"), mesh=mesh,
        ...                           in_specs=P("x"), out_specs=P()))
        >>> _ = jax.block_until_ready(f(x))
        >>> last = jaxcomm.trace.snapshot()["entries"][-1]     # the latest call of some rank
        >>> last["op"], last["state"], last["group"]
        ('all_reduce', 'done', [0, 1, 2, 3, 4, 5, 6, 7])
    """
    return json.loads(_jaxcomm.trace_json(reason))


def dump_path(directory: str | os.PathLike[str] | None = None) -> str:
    """Where this process's dump goes in ``directory`` (default: JAXCOMM_TRACE_DIR, else
    the current directory): ``jaxcomm-trace-p<process index>-<pid>.json``."""
    directory = os.fspath(directory) if directory is not None else (_jaxcomm.trace_dir() or ".")
    return _jaxcomm.trace_file_in(directory)


def dump(path: str | os.PathLike[str] | None = None, reason: str = "manual") -> str:
    """Writes this process's flight recorder to a JSON file and returns its path.

    Args:
      path: a directory (the file is named ``jaxcomm-trace-p<index>-<pid>.json`` so that
        every process of a job can dump into one directory), or a file name ending in
        ``.json``. Default: JAXCOMM_TRACE_DIR, else the current directory. Into a
        directory, a process under the CUDA emulation (JAXCOMM_EMULATE_CUDA=1) also writes
        the emulated CUDA calls' recorder, ``jaxcomm-trace-p<index>-<pid>-cuda-emu.json``.
      reason: recorded in the file (``"manual"``, ``"exit"``, ...).

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> import tempfile
        >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
        >>> f = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, "x"), mesh=mesh,
        ...                           in_specs=P("x"), out_specs=P()))
        >>> _ = jax.block_until_ready(f(x))
        >>> traces = tempfile.mkdtemp()
        >>> path = jaxcomm.trace.dump(traces)   # every process of a job may dump there
        >>> jaxcomm.trace.analyze(traces).kind  # or: python -m jaxcomm.trace analyze DIR
        'clean'
    """
    target = os.fspath(path) if path is not None else None
    directory = None
    if target is None or not target.endswith(".json"):
        if target is not None:
            os.makedirs(target, exist_ok=True)
        directory = target if target is not None else (_jaxcomm.trace_dir() or ".")
        target = dump_path(target)
    _jaxcomm.trace_dump(target, reason)
    emulated = _emulated_recorder()
    if directory is not None and emulated is not None:
        emulated.trace_dump(emulated.trace_file_in(directory), reason)
    return target


def _emulated_recorder() -> Any:
    """The CUDA emulation's module (JAXCOMM_EMULATE_CUDA=1), when it is loaded and
    recorded calls: its own flight recorder holds the emulated CUDA calls, dumped beside
    _jaxcomm's as ``jaxcomm-trace-p<index>-<pid>-cuda-emu.json``; else None."""
    emu = sys.modules.get("jaxcomm._jaxcomm_emu")
    if emu is None or not emu.trace_stats():
        return None
    return emu


def enabled() -> bool:
    """Whether calls are being recorded."""
    return bool(_jaxcomm.trace_enabled())


def set_enabled(on: bool) -> None:
    """Turns recording on or off at run time (benchmarks compare both in one process).

    Has no effect when JAXCOMM_TRACE_ENTRIES=0 (the rings were never allocated).
    """
    _jaxcomm.trace_set_enabled(bool(on))


def analyze(directory: str | os.PathLike[str], **kwargs: Any) -> Any:
    """Merges the dumps in ``directory`` and returns a
    :class:`jaxcomm.trace.analyzer.Report` (see ``python -m jaxcomm.trace analyze``)."""
    from jaxcomm.trace import analyzer

    return analyzer.analyze(directory, **kwargs)


def _dump_at_exit() -> None:
    # A process that recorded no call (the launcher, a tool importing jaxcomm) leaves no
    # dump: an empty one would look like one more process of the job. Each recorder (the
    # host backend's, the CUDA emulation's) dumps if it recorded something.
    try:
        if _jaxcomm.trace_stats():  # a call site described: something was recorded
            _jaxcomm.trace_dump(dump_path(_jaxcomm.trace_dir()), "exit")
        emulated = _emulated_recorder()
        if emulated is not None:
            emulated.trace_dump(emulated.trace_file_in(_jaxcomm.trace_dir()), "exit")
    except Exception as e:  # noqa: BLE001 - never turn an exit into a traceback
        print(f"jaxcomm: flight recorder dump at exit failed: {e}")


if _jaxcomm.trace_dir():
    atexit.register(_dump_at_exit)
