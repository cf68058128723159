"""What every op's public function does before binding its primitive."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm._src import callsite, compat, config, groups, runtime


def prepare(op: str, x: Any, axis_name: Any, timeout_s: float | None) -> tuple[jax.Array, dict[str, Any]]:
    """Validates the axes and returns (operand, common primitive params).

    Under ``check_vma`` an operand that is invariant over the group's axes is cast to
    varying first, as jax.lax's collectives do.
    """
    axes = groups.normalize_axes(op, axis_name)
    x = jnp.asarray(x)
    vma_checked = compat.check_vma_enabled()
    if vma_checked:
        missing = tuple(a for a in axes if a not in compat.vma(jax.typeof(x)))
        x = compat.pvary(x, missing)
    params = dict(
        axes=axes,
        call_site=callsite.user_call_site(),
        timeout_ms=config.timeout_ms(timeout_s),
        vma_checked=vma_checked,
    )
    return x, params


def use_xla(op: str) -> bool:
    """Whether ``op`` lowers to its jax.lax equivalent in the program being traced."""
    choice = config.backend()
    if choice == "xla":
        runtime.log_fallback_once(op, "JAXCOMM_BACKEND=xla")
        return True
    if choice == "jaxcomm":
        return False
    platform = jax.default_backend()
    if platform not in runtime.PLATFORMS:
        runtime.log_fallback_once(op, f"jaxcomm has no handler for platform {platform!r} yet")
        return True
    return False


def canonical_axis(op: str, name: str, axis: int, ndim: int) -> int:
    """``axis`` in ``[-ndim, ndim)`` made non-negative, else a ValueError naming it."""
    if not isinstance(axis, (int,)) or isinstance(axis, bool):
        raise TypeError(f"jaxcomm.{op}: {name} must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"jaxcomm.{op}: {name}={axis} is out of range for an operand of rank "
                         f"{ndim if ndim else 0}")
    return axis % ndim
