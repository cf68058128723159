"""The backends that serve jaxcomm's ops, behind one small interface.

A backend says which lowering platform it serves, whether it can in this process, which
calls it serves (ops, dtypes, group sizes: the rest lower to jax.lax), how its handlers
are registered with XLA, and what a program needs from it at lowering (host transports
linked, NCCL ids exchanged, each partition's device as its handlers number them). The
generic code (primitive.py, ops/common.py) asks the backend of the platform at hand and
names none.

Backends: :mod:`.cpu` (the host backend: ffi/cpu) and :mod:`.cuda` (ffi/cuda). Which ops
each has a handler for is the op table's (ffi/core/op_table.h).
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

import numpy as np


class Backend(abc.ABC):
    """One backend of jaxcomm's ops.

    Attributes:
      platform: the lowering platform it registers handlers for (``"cpu"``, ``"cuda"``),
        also its name in the op table's ``backends``.
      jax_backend: ``jax.default_backend()`` on a process it serves (``"cpu"``, ``"gpu"``).
    """

    platform: str
    jax_backend: str

    @abc.abstractmethod
    def available(self) -> bool:
        """Whether its handlers can serve programs in this process."""

    def fallback_reason(self, op: str, dtype: Any, group_size: int | None) -> str:
        """Why a call of ``op`` on ``dtype`` over groups of ``group_size`` lowers to jax.lax
        on this backend ("" when the backend serves it)."""
        return ""

    @abc.abstractmethod
    def register(self) -> None:
        """Registers its handlers (every op of the table it serves) with XLA, once."""

    @abc.abstractmethod
    def prepare_lowering(self, op: str, replica_groups: Sequence[Sequence[int]], axis_context: Any,
                         timeout_ms: int) -> np.ndarray:
        """Readies the groups of a custom call being lowered (links, ids), and returns its
        ``partition_devices`` attribute: (process, device ordinal) per partition, as this
        backend's handlers number devices."""


def _all() -> tuple[Backend, ...]:
    from jaxcomm._src import config
    from jaxcomm._src.backends import cpu, cuda
    if config.emulate_cuda():  # JAXCOMM_EMULATE_CUDA=1: platform cpu runs the CUDA backend
        from jaxcomm._src.backends import cuda_emulated
        return (cuda_emulated.BACKEND, cuda.BACKEND)
    return (cpu.BACKEND, cuda.BACKEND)


def lowering_platforms(served_by: Sequence[str] | None = None) -> tuple[str, ...]:
    """The platforms of the backends named in ``served_by`` (an op table entry's
    ``backends``: ``"cpu"``, ``"cuda"``), default every backend's. A backend answers to
    its ``table_names`` (the emulated CUDA backend: both), else to its platform."""
    return tuple(b.platform for b in _all()
                 if served_by is None or set(getattr(b, "table_names", (b.platform,))) & set(served_by))


def for_platform(platform: str) -> Backend:
    """The backend of lowering platform ``platform``."""
    for b in _all():
        if b.platform == platform:
            return b
    raise ValueError(f"jaxcomm has no backend for platform {platform!r}")


def for_jax_backend(name: str) -> Backend | None:
    """The backend of ``jax.default_backend()`` ``name``, if one is available here."""
    for b in _all():
        if b.jax_backend == name and b.available():
            return b
    return None


def served_platforms() -> tuple[str, ...]:
    """``jax.default_backend()`` names that jaxcomm's own handlers serve in this process."""
    return tuple(b.jax_backend for b in _all() if b.available())
