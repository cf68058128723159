"""``jaxcomm.use_for_lax()``: jax.lax's collectives, by name, computed by jaxcomm.lax."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any

import jax

from jaxcomm._src.dropin import collectives

_lock = threading.Lock()


class LaxSwitch:
    """An active :func:`use_for_lax`: ``undo()`` (or leaving its ``with`` block) restores
    the functions ``jax.lax`` had before."""

    def __init__(self, names: tuple[str, ...]) -> None:
        with _lock:
            self._saved = {name: getattr(jax.lax, name) for name in names}
            for name in names:
                setattr(jax.lax, name, getattr(collectives, name))
        self.active = True

    def undo(self) -> None:
        """Puts back jax.lax's functions (those it had when the switch was made); idempotent."""
        with _lock:
            if not self.active:
                return
            for name, fn in self._saved.items():
                setattr(jax.lax, name, fn)
            self.active = False

    def __enter__(self) -> LaxSwitch:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"<jaxcomm.use_for_lax: {'active' if self.active else 'undone'}>"


def use_for_lax(*names: str) -> LaxSwitch:
    """Makes ``jax.lax.psum`` & co. jaxcomm's: programs traced afterwards that call jax.lax's
    collectives by name (``jax.lax.pmean(grads, "dp")``, ``lax.all_gather`` after
    ``from jax import lax``) run jaxcomm's collectives, with jax.lax's results.

    Args:
      names: the jax.lax functions to switch (default: every collective jaxcomm.lax has:
        psum, pmean, pmax, pmin, all_gather, psum_scatter, all_to_all, pswapaxes,
        ppermute, pshuffle, pbroadcast, ragged_all_to_all).

    Returns:
      A :class:`LaxSwitch`: call ``.undo()`` to switch back, or use it as a context manager
      (``with jaxcomm.use_for_lax(): ...``) to switch for one block.

    Limits (docs/lax.md): it rebinds names in the ``jax.lax`` module, for the whole process
    and every thread. Code that took a function from jax.lax before the switch
    (``from jax.lax import psum`` at import time, a default argument) keeps jax.lax's; so do
    jax's own internals (which call ``jax._src.lax.parallel`` directly). A jitted function
    traced before the switch keeps its compiled program until it is traced again (new
    shapes, or ``jax.clear_caches()``). Switches undo in reverse order of making.

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh,
        ...                           in_specs=P(), out_specs=P(), check_vma=False))
        >>> with jaxcomm.use_for_lax():           # programs traced in here run jaxcomm's
        ...     f(jnp.ones(2))
        Array([8., 8.], dtype=float32)
        >>> jax.lax.psum is jaxcomm.lax.psum      # switched back after the block
        False
        >>> switch = jaxcomm.use_for_lax("psum")  # or until undone
        >>> switch.undo()
    """
    unknown = [n for n in names if n not in collectives.COLLECTIVES]
    if unknown:
        raise ValueError(f"jaxcomm.use_for_lax: {unknown} are not collectives jaxcomm.lax defines; "
                         f"choose from {collectives.COLLECTIVES}")
    return LaxSwitch(tuple(names) or collectives.COLLECTIVES)


def is_active(name: str = "psum") -> bool:
    """Whether ``jax.lax.<name>`` is jaxcomm's now."""
    fn: Any = getattr(jax.lax, name, None)
    return fn is getattr(collectives, name, object())
