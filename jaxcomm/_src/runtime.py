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
    from jaxcomm._src import cuda_runtime
    return PLATFORMS + (("gpu",) if cuda_runtime.available() else ())


def target_name(op: str) -> str:
    return f"jaxcomm_{op}"


@functools.cache
def ensure_registered() -> None:
    """Registers every handler and the rendezvous state type with XLA:CPU."""
    config.nontemporal_bytes()  # a malformed value fails here, not silently in C++
    config.single_copy()
    jax.devices("cpu")  # the FFI type registry lives in the CPU client
    jax.ffi.register_ffi_type("jaxcomm_instruction_state", _jaxcomm.state_type(), platform="cpu")
    for op, stages in _jaxcomm.cpu_targets().items():
        jax.ffi.register_ffi_target(target_name(op), stages, platform="cpu")
        mark_batch_partitionable(target_name(op))
    _jaxcomm.set_process_index(jax.process_index())


@functools.cache
def mark_batch_partitionable(name: str) -> None:
    """Marks FFI target ``name`` batch-partitionable, once per name: the mark is not per
    platform, and a second one makes XLA log "Failed to register custom call partitioner"."""
    jax.ffi.register_ffi_target_as_batch_partitionable(name)


def ensure_registered_for(platforms: tuple[str, ...]) -> None:
    """Registers the handlers of every lowering platform (``"cpu"``, ``"cuda"``)."""
    for platform in platforms:
        if platform == "cpu":
            ensure_registered()
        elif platform == "cuda":
            from jaxcomm._src import cuda_runtime
            cuda_runtime.ensure_registered()


@functools.cache
def log_fallback_once(op: str, reason: str) -> None:
    log.warning("jaxcomm.%s lowers to its jax.lax equivalent: %s", op, reason)
