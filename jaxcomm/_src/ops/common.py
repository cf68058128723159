"""What every op's public function does before binding its primitive."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp

from jaxcomm._src import backends, callsite, compat, config, groups, runtime


def prepare(op: str, x: Any, axis_name: Any, timeout_s: float | None,
            axis_index_groups: Any = None, *, sums: bool = False) -> tuple[jax.Array, dict[str, Any]]:
    """Validates the axes and returns (operand, common primitive params).

    Under ``check_vma`` an operand that is invariant over the group's axes is cast to
    varying first, as jax.lax's collectives do. One typed ``unreduced`` there (explicit
    sharding: partial sums) is taken as it is by the ops that sum (``sums``); the others,
    like jax.lax's, refuse it, and refuse ``reduced`` operands.
    """
    axes = groups.normalize_axes(op, axis_name)
    index_groups = groups.normalize_index_groups(op, axis_index_groups, axes)
    x = jnp.asarray(x)
    vma_checked = compat.check_vma_enabled()
    if vma_checked:
        state = compat.axes_state(jax.typeof(x), axes)
        if "reduced" in state or ("unreduced" in state and not sums):
            kind = "reduced" if "reduced" in state else "unreduced"
            raise ValueError(f"jaxcomm.{op}: the operand ({jax.typeof(x).str_short(True)}) is {kind} "
                             f"over axis {groups.describe(axes)}; only a sum (all_reduce, "
                             f"reduce_scatter) takes an unreduced operand, and no collective a reduced one")
        unreduced = compat.unreduced(jax.typeof(x))
        missing = tuple(a for a in axes if a not in compat.vma(jax.typeof(x)) and a not in unreduced)
        x = compat.pvary(x, missing)
    params = dict(
        axes=axes,
        axis_index_groups=index_groups,
        call_site=callsite.user_call_site(),
        timeout_ms=config.timeout_ms(timeout_s, op),
        vma_checked=vma_checked,
    )
    return x, params


def bit_width(dtype: Any) -> int:
    """Bits per element of ``dtype`` (4 for int4: XLA:CPU packs two per byte)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return 8
    try:
        return int(jnp.iinfo(dtype).bits) if jnp.issubdtype(dtype, jnp.integer) else \
            int(jnp.finfo(dtype).bits) * (2 if jnp.issubdtype(dtype, jnp.complexfloating) else 1)
    except ValueError:
        return dtype.itemsize * 8


def use_xla(op: str, dtype: Any = None, group_size: int | None = None) -> bool:
    """Whether ``op`` lowers to its jax.lax equivalent in the program being traced.

    The rule for what jaxcomm has no kernel for: jax.lax computes it, and the jaxcomm
    logger says so once per op and reason (a WARNING); JAXCOMM_BACKEND=jaxcomm makes it a
    TypeError naming the op instead. Besides JAXCOMM_BACKEND and the platform, that is
    sub-byte dtypes (int4, float4, ...): XLA packs them two per byte, which no kernel of
    jaxcomm's addresses; and the calls the platform's backend does not serve
    (``Backend.fallback_reason``: dtypes its kernels cannot reduce, such as float8 on the
    host or int16 with NCCL, group sizes a handler does not take).
    """
    choice = config.backend()
    if choice == "xla":
        runtime.log_fallback_once(op, "JAXCOMM_BACKEND=xla")
        return True
    if dtype is not None and bit_width(dtype) < 8:
        if choice == "jaxcomm":
            raise TypeError(f"jaxcomm.{op}: no jaxcomm kernel takes the sub-byte dtype "
                            f"{np.dtype(dtype).name} (JAXCOMM_BACKEND=jaxcomm refuses to hand it "
                            f"to jax.lax)")
        runtime.log_fallback_once(op, f"sub-byte dtype {np.dtype(dtype).name}")
        return True
    if choice == "jaxcomm":
        return False
    platform = jax.default_backend()
    backend = backends.for_jax_backend(platform)
    if backend is None:
        runtime.log_fallback_once(op, f"jaxcomm has no handler for platform {platform!r} here")
        return True
    reason = backend.fallback_reason(op, dtype, group_size)
    if reason:
        runtime.log_fallback_once(op, reason)
        return True
    return False


def as_int(op: str, name: str, value: Any) -> int:
    """``value`` as a Python int (numpy integers included), else a TypeError naming it."""
    if isinstance(value, bool):
        raise TypeError(f"jaxcomm.{op}: {name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"jaxcomm.{op}: {name} must be an integer, got {value!r}") from None


def canonical_axis(op: str, name: str, axis: int, ndim: int, *, rank: int | None = None) -> int:
    """``axis`` in ``[-ndim, ndim)`` made non-negative, else a ValueError naming it.

    ``rank`` is the operand's rank for the message when it differs from ``ndim`` (an
    untiled all_gather may insert its new axis at ``ndim``).
    """
    axis = as_int(op, name, axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"jaxcomm.{op}: {name}={axis} is out of range [{-ndim}, {ndim - 1}] for an "
                         f"operand of rank {ndim if rank is None else rank}")
    return axis % ndim
