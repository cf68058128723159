"""A job's coordination service in a process of its own, so that any worker may die.

JAX runs the coordination service of a multi-process job (its key-value store,
heartbeats and barriers) inside process 0, and when process 0 ends every other process
loses it and is aborted ("Terminating process because the JAX distributed service
detected fatal errors"). ``python -m jaxcomm.launch`` runs the service here instead and
tells the workers (``JAXCOMM_COORDINATION_SERVICE=external``) to connect to it without
starting one: then a dead process 0 is one dead worker like any other, the survivors
get jaxcomm's error naming it, and ``jaxcomm.ft.all_reduce`` goes on without it.

Run as a script (it imports only jaxlib, about half a second)::

    python coordinator.py --address 127.0.0.1:PORT --processes N [--heartbeat-s 10]
                          [--shutdown-s 60] [--recoverable]

It prints ``ready <address>`` once the service listens (or an error, exit status 2),
and stops the service and exits on SIGTERM or SIGINT, when its standard input closes
(the launcher went away), or when its parent dies. Under SLURM or mpirun the same
script can run as a job step of its own; see docs/multiprocess.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any, Sequence


def _load_jaxlib() -> Any:
    try:
        from jaxlib import _jax  # jaxlib >= 0.7: the service lives in jaxlib._jax
    except ImportError:  # pragma: no cover - older layouts
        from jax._src.lib import _jax
    return _jax


def _die_with_parent() -> None:
    """SIGTERM when the launcher dies (Linux; best effort)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(address: str, processes: int, *, heartbeat_s: int, shutdown_s: int,
          recoverable: bool, stop: threading.Event) -> int:
    """Runs the service on ``address`` until ``stop`` is set; returns an exit status."""
    _jax = _load_jaxlib()
    try:
        service = _jax.get_distributed_runtime_service(
            address, processes, heartbeat_timeout=heartbeat_s, shutdown_timeout=shutdown_s,
            recoverable=recoverable)
    except Exception as e:  # noqa: BLE001 - a port in use, a bad address: say so, exit 2
        print(f"error {e}", flush=True)
        return 2
    print(f"ready {address}", flush=True)
    while not stop.wait(1.0):  # wakes for signal handlers too
        pass
    service.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="host:port to listen on")
    p.add_argument("--processes", type=int, required=True)
    p.add_argument("--heartbeat-s", type=int, default=10)
    p.add_argument("--shutdown-s", type=int, default=60)
    p.add_argument("--recoverable", action="store_true",
                   help="a dead worker does not abort the others (jaxcomm.ft jobs)")
    args = p.parse_args(argv)
    _die_with_parent()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())

    def watch_stdin() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        stop.set()

    if not os.isatty(0):
        threading.Thread(target=watch_stdin, daemon=True).start()
    return serve(args.address, args.processes, heartbeat_s=args.heartbeat_s,
                 shutdown_s=args.shutdown_s, recoverable=args.recoverable, stop=stop)


if __name__ == "__main__":
    sys.exit(main())
