"""jax.lax's collectives, computed by jaxcomm: a drop-in for ``jax.lax``.

Same names, signatures, pytrees and results as jax.lax (``psum``, ``pmean``, ``pmax``,
``pmin``, ``all_gather``, ``psum_scatter``, ``all_to_all``, ``pswapaxes``, ``ppermute``,
``pshuffle``, ``pbroadcast``, ``ragged_all_to_all``); every other name is jax.lax's own
(``axis_index``, ``axis_size``, ``dot``, ...), so a module switches with one import::

    from jaxcomm import lax      # instead of: from jax import lax

    def step(grads):
        return lax.pmean(grads, "dp")        # jaxcomm's all_reduce, jax.lax's result

Cases jaxcomm has no fast path for are computed by jax.lax (logged once each); mistakes
raise jax.lax's exception type with jaxcomm's message. docs/lax.md has the details, and
:func:`jaxcomm.use_for_lax` switches code that calls ``jax.lax.<name>`` itself.
"""

from typing import Any

import jax

from jaxcomm._src.dropin.collectives import (  # noqa: F401
    COLLECTIVES, all_gather, all_to_all, axis_index, axis_size, pbroadcast, pmax, pmean, pmin,
    ppermute, pshuffle, psum, psum_scatter, pswapaxes, ragged_all_to_all)

__all__ = [*COLLECTIVES, "axis_index", "axis_size"]


def __getattr__(name: str) -> Any:
    # Everything else is jax.lax's, so that ``from jaxcomm import lax`` replaces ``jax.lax``.
    try:
        return getattr(jax.lax, name)
    except AttributeError:
        raise AttributeError(f"module 'jaxcomm.lax' has no attribute {name!r} (nor has jax.lax)") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(jax.lax)))
