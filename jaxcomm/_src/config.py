"""jaxcomm's configuration: keyword arguments first, then ``JAXCOMM_*`` variables.

=========================  =========  ===========================================================
variable                   default    meaning
=========================  =========  ===========================================================
JAXCOMM_TIMEOUT_S          300        deadline of every wait inside a collective, in seconds
JAXCOMM_BACKEND            auto       ``auto``: jaxcomm's handlers where the platform has them,
                                      else jax.lax; ``jaxcomm``: always (error where none);
                                      ``xla``: always lower to the jax.lax equivalent
JAXCOMM_SPIN_US            200        how long an idle jaxcomm pool thread spins (yielding the
                                      core) before it sleeps, and how long a cross-process call
                                      spins for its peers before it hands the wait to the
                                      progress thread; read once at start (C++ runtime)
JAXCOMM_NONTEMPORAL_BYTES  4194304    results of at least this many bytes (per rank) are written
                                      with non-temporal stores, which bypass the caches: a
                                      large result is not read from memory before it is
                                      written; ``0``: never; read at start (C++ runtime)
JAXCOMM_INLINE             1          a cross-process call whose group has one rank per process,
                                      all on one host, runs on its device thread (no hand-off)
                                      from its second round; ``0``: never; read at start (C++
                                      runtime)
JAXCOMM_TRANSPORT          auto       between processes: ``auto``: shared memory on one host, TCP
                                      across hosts; ``tcp``: TCP everywhere
JAXCOMM_TCP_ADDRESS        unset      the IPv4 address of this host's interface that jaxcomm's TCP
                                      listener takes and peers connect to; unset: the one that
                                      routes to the coordinator (the job's network);
                                      ``0.0.0.0``: every interface (not advised)
JAXCOMM_TRACE_ENTRIES      2048       flight recorder: calls kept per rank (partition); ``0`` turns
                                      the recorder off (nothing recorded, no stats); read at start
JAXCOMM_TRACE_DIR          unset      where flight recorder dumps go: set, each process writes
                                      ``jaxcomm-trace-p<index>-<pid>.json`` there on a collective
                                      timeout or transport error, on SIGUSR1 and at exit; unset,
                                      only ``jaxcomm.trace.dump()`` and SIGUSR1 (current
                                      directory) write one; read at start
JAXCOMM_FAULT              unset      fault injection, e.g. ``rank=3,op=all_reduce,call=5,
                                      action=hang`` (hang | exit[:code] | delay:seconds); faults
                                      separated by ``;``; see ffi/core/fault_injection.h and
                                      README.md; read at start
=========================  =========  ===========================================================

Values are read when a program is traced, so they apply to programs traced afterwards
(those marked "read at start" once, when the runtime loads).
"""

from __future__ import annotations

import os

_BACKENDS = ("auto", "jaxcomm", "xla")
_TRANSPORTS = ("auto", "tcp")


def timeout_ms(timeout_s: float | None = None) -> int:
    """The collective deadline in milliseconds: the argument, else JAXCOMM_TIMEOUT_S."""
    if timeout_s is None:
        raw = os.environ.get("JAXCOMM_TIMEOUT_S", "300")
        try:
            timeout_s = float(raw)
        except ValueError:
            raise ValueError(f"JAXCOMM_TIMEOUT_S must be a number of seconds, got {raw!r}") from None
    if not timeout_s > 0:
        raise ValueError(f"the collective timeout must be positive, got {timeout_s} s")
    return max(1, int(round(timeout_s * 1000)))


def backend() -> str:
    """JAXCOMM_BACKEND, validated."""
    value = os.environ.get("JAXCOMM_BACKEND", "auto").strip().lower() or "auto"
    if value not in _BACKENDS:
        raise ValueError(f"JAXCOMM_BACKEND must be one of {_BACKENDS}, got {value!r}")
    return value


def transport() -> str:
    """JAXCOMM_TRANSPORT, validated."""
    value = os.environ.get("JAXCOMM_TRANSPORT", "auto").strip().lower() or "auto"
    if value not in _TRANSPORTS:
        raise ValueError(f"JAXCOMM_TRANSPORT must be one of {_TRANSPORTS}, got {value!r}")
    return value


def tcp_address() -> str:
    """JAXCOMM_TCP_ADDRESS, validated: an IPv4 address, or "" when unset."""
    import ipaddress

    raw = os.environ.get("JAXCOMM_TCP_ADDRESS", "").strip()
    if not raw:
        return ""
    try:
        return str(ipaddress.IPv4Address(raw))
    except ValueError:
        raise ValueError(f"JAXCOMM_TCP_ADDRESS must be an IPv4 address, got {raw!r}") from None


def _count(name: str, default: int, unit: str) -> int:
    """A whole number >= 0 from environment variable ``name`` (the C++ runtime reads the
    same variable, and would quietly take the default for a malformed one)."""
    raw = os.environ.get(name, str(default)).strip() or str(default)
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number of {unit}, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def trace_entries() -> int:
    """JAXCOMM_TRACE_ENTRIES, validated."""
    return _count("JAXCOMM_TRACE_ENTRIES", 2048, "calls")


def nontemporal_bytes() -> int:
    """JAXCOMM_NONTEMPORAL_BYTES, validated."""
    return _count("JAXCOMM_NONTEMPORAL_BYTES", 4 << 20, "bytes")


def single_copy() -> bool:
    """JAXCOMM_SINGLE_COPY (0 or 1), validated."""
    raw = os.environ.get("JAXCOMM_SINGLE_COPY", "1").strip() or "1"
    if raw not in ("0", "1"):
        raise ValueError(f"JAXCOMM_SINGLE_COPY must be 0 or 1, got {raw!r}")
    return raw == "1"
