"""Which path a jax.lax-compatible collective takes, and how its errors read.

Every ``jaxcomm.lax`` function handles each array (pytree leaf) through :func:`run`: jaxcomm's
own path when jaxcomm serves the case, else jax.lax's function as the installed jax defines
it (``compat.jax_lax``), logged once per op and reason. A case jaxcomm refuses while tracing
is handed to jax.lax too: when jax.lax computes it, that result is used (logged); when jax.lax
refuses it as well, the error raised is an instance of jax.lax's exception type carrying
jaxcomm's message (which names the op, the axes and the value at fault), chained to jax.lax's
own error. So a program never fails with jaxcomm.lax where it runs with jax.lax, and an
``except`` written for jax.lax's errors still catches them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import jax

from jaxcomm._src import compat

log = logging.getLogger("jaxcomm")


@dataclasses.dataclass(frozen=True)
class Served:
    """What jaxcomm's path of a reduction returns from :func:`run`: the checked operand,
    reduced afterwards together with the pytree's other served leaves."""

    operand: jax.Array


class Fallback(Exception):
    """Raised inside jaxcomm's path: compute this case with jax.lax (``reason`` is logged)."""


def definite(err: Exception) -> Exception:
    """Marks ``err`` as final: jax.lax raises the same type for this mistake, but only later
    (when lowering), so asking jax.lax while tracing would not show it."""
    err.jaxcomm_definite = True  # type: ignore[attr-defined]
    return err


@functools.cache
def log_fallback(op: str, reason: str) -> None:
    log.warning("jaxcomm.lax.%s computed by jax.lax: %s", op, reason)


def run(op: str, ours: Callable[[], Any], theirs: Callable[[], Any]) -> Any:
    """``ours()``, or ``theirs()`` (jax.lax) where jaxcomm does not serve the case."""
    try:
        return ours()
    except Fallback as why:
        log_fallback(op, str(why))
        return theirs()
    except Exception as err:  # noqa: BLE001 - jax.lax decides whether this is a mistake
        if getattr(err, "jaxcomm_definite", False):
            raise
        try:
            result = theirs()
        except Exception as lax_err:  # noqa: BLE001
            raise as_type(err, type(lax_err)) from lax_err
        log_fallback(op, f"{type(err).__name__}: {err}")
        return result


@functools.cache
def _combined_type(ours: type, theirs: type) -> type:
    # An exception of jax.lax's type that is still one of jaxcomm's (TypeError, ...).
    return type(theirs.__name__, (theirs, ours), {"__module__": "jaxcomm.lax"})


def as_type(err: Exception, cls: type) -> Exception:
    """``err``'s message as an instance of ``cls`` (and of ``type(err)`` where possible)."""
    if isinstance(err, cls):
        return err
    for make in (lambda: _combined_type(type(err), cls)(*err.args), lambda: cls(*err.args)):
        try:
            return make()
        except TypeError:  # incompatible layouts, or a constructor with other arguments
            continue
    return err


def axes_of(axis_name: Any) -> tuple:
    """``axis_name`` as jax.lax reads it: a tuple or list names several axes."""
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def check_served(leaf: Any, axes: tuple, index_groups: Any = None, *, reduction: bool = False,
                 sums: bool = False) -> None:
    """Raises :class:`Fallback` for the cases jaxcomm leaves to jax.lax.

    * positional (integer) axes, and axes bound by ``vmap`` or ``pmap`` rather than by a
      ``shard_map`` mesh: jax.lax computes them over the batch dimension, with no
      communication to speed up (a tuple mixing them with mesh axes goes there too);
    * operands typed ``reduced`` over the axes, or ``unreduced`` except for a sum
      (``sums``): explicit sharding's types, which jax.lax refuses or treats apart;
    * for a ``reduction``, an operand varying over some of the axes and not others: jax.lax
      reads one state for all the axes (an error in jax 0.10's psum, jax 0.11's pmax);
    * ``axis_index_groups`` of different sizes (jaxcomm's handlers serve equal groups).
    """
    for a in axes:
        if isinstance(a, int):
            raise Fallback("positional (integer) axis names")
        if compat.axis_exists(a) and a not in compat.mesh_axis_names():
            raise Fallback(f"axis {a!r} is bound by vmap or pmap, not by a shard_map mesh")
    if compat.check_vma_enabled():
        state = compat.axes_state(jax.typeof(leaf), axes)
        if "reduced" in state or ("unreduced" in state and not (sums and state == {"unreduced"})):
            raise Fallback(f"an operand typed {'/'.join(sorted(state))} over {axes}")
        if reduction and len(state) > 1:
            raise Fallback(f"an operand varying over some of the axes {axes} and not others")
    if index_groups is not None:
        try:
            sizes = {len(g) for g in index_groups}
        except TypeError:
            return  # malformed: jaxcomm's check names the mistake
        if len(sizes) > 1:
            raise Fallback("axis_index_groups of different sizes")


def like_lax_weak_type(y: jax.Array, leaf: Any, keeps_weak: bool) -> jax.Array:
    """``y`` weakly typed where jax.lax's result would be: ops whose result type is their
    operand's (``keeps_weak``) keep a weak type (a Python scalar operand's)."""
    if keeps_weak and getattr(jax.typeof(leaf), "weak_type", False) and not jax.typeof(y).weak_type:
        return compat.with_weak_type(y)
    return y
