"""Loads the native extension and registers its FFI handlers with XLA, once, on demand.

Importing jaxcomm does not touch a JAX backend; registration happens the first time a
jaxcomm op is traced (the FFI state type must be registered after the CPU backend
exists, which tracing guarantees).
"""

from __future__ import annotations

import functools
import logging

import jax

from jaxcomm import _jaxcomm  # the extension built from ffi/
from jaxcomm._src import config

log = logging.getLogger("jaxcomm")

#: Platforms that always have jaxcomm handlers. "gpu" joins them when the CUDA backend
#: is built and a GPU backend exists (served_platforms()). Others lower to jax.lax.
PLATFORMS = ("cpu",)


def served_platforms() -> tuple[str, ...]:
    """``jax.default_backend()`` names that jaxcomm's own handlers serve in this process."""
    from jaxcomm._src import backends  # late: the backends register through this module
    return backends.served_platforms()


def target_name(op: str) -> str:
    """Op ``op``'s FFI target (the op table's)."""
    from jaxcomm._src.ops import table
    return table.op(op).target


@functools.cache
def ensure_registered() -> None:
    """Registers the host backend's handlers (every op of the table) and the rendezvous
    state type with XLA:CPU (backends/cpu.py's registration)."""
    check_configuration()
    _jaxcomm.set_mismatch_grace_ms(int(round(config.mismatch_grace_s() * 1000)))
    jax.devices("cpu")  # the FFI type registry lives in the CPU client
    jax.ffi.register_ffi_type("jaxcomm_instruction_state", _jaxcomm.state_type(), platform="cpu")
    for op, stages in _jaxcomm.cpu_targets().items():
        jax.ffi.register_ffi_target(target_name(op), stages, platform="cpu")
        mark_batch_partitionable(target_name(op))
    _jaxcomm.set_process_index(jax.process_index())


def check_configuration() -> None:
    """Raises the first malformed variable the C++ runtime read at start (its error names
    it), or one Python reads at start: before any handler runs with a default instead."""
    config.raise_native_errors(list(_jaxcomm.config_errors()))
    config.validate(config.AT_START)


@functools.cache
def mark_batch_partitionable(name: str) -> None:
    """Marks FFI target ``name`` batch-partitionable, once per name: the mark is not per
    platform, and a second one makes XLA log "Failed to register custom call partitioner"."""
    jax.ffi.register_ffi_target_as_batch_partitionable(name)


def ensure_registered_for(platforms: tuple[str, ...]) -> None:
    """Registers the handlers of every lowering platform's backend."""
    from jaxcomm._src import backends  # late: the backends register through this module
    for platform in platforms:
        backends.for_platform(platform).register()


@functools.cache
def log_fallback_once(op: str, reason: str) -> None:
    log.warning("jaxcomm.%s lowers to its jax.lax equivalent: %s", op, reason)
