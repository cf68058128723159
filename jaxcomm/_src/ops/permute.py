"""ppermute: point-to-point send/recv pairs. Handler: ffi/cpu/handlers.cc (Permute)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax._src.interpreters import ad

from jaxcomm._src import groups, primitive
from jaxcomm._src.ops import common


def _sources(perm: tuple, size: int) -> list[int]:
    src = [-1] * size
    for s, d in perm:
        src[d] = s
    return src


ppermute_p = primitive.define(primitive.CollectiveSpec(
    name="ppermute",
    out_shape=lambda shape, size, **_: shape,
    invariant_result=False,
    ffi_attrs=lambda perm, group_size, **_: {
        "sources": np.asarray(_sources(perm, group_size), dtype=np.int64)},
))


def _ppermute_transpose(ct: Any, x: Any, *, perm: tuple, **params: Any):
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    return [ppermute_p.bind(ct, perm=tuple((d, s) for s, d in perm), **params)]


ad.deflinear2(ppermute_p, _ppermute_transpose)


def validate_perm(op: str, perm: Sequence[Sequence[int]], size: int) -> tuple[tuple[int, int], ...]:
    """``perm`` as a tuple of (source, destination) pairs, checked against the group size."""
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise TypeError(f"jaxcomm.{op}: perm must be a sequence of (source, destination) pairs, "
                        f"got {perm!r}") from None
    for s, d in pairs:
        if not (0 <= s < size and 0 <= d < size):
            raise ValueError(f"jaxcomm.{op}: perm pair ({s}, {d}) is out of range for a group of "
                             f"{size} ranks")
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"jaxcomm.{op}: perm {pairs} is not a permutation: a rank appears twice as "
                         f"a source or twice as a destination")
    return pairs


def ppermute(x: jax.Array, axis_name: Any, perm: Sequence[Sequence[int]], *,
             timeout_s: float | None = None) -> jax.Array:
    """Sends ``x`` from rank ``s`` to rank ``d`` for each pair in ``perm``: ``jax.lax.ppermute``.

    Ranks that no pair sends to receive zeros.

    Example::

        # a ring shift over 8 ranks
        jaxcomm.ppermute(x, "x", [(i, (i + 1) % 8) for i in range(8)])
    """
    x = jnp.asarray(x)
    axes = groups.normalize_axes("ppermute", axis_name)
    pairs = validate_perm("ppermute", perm, groups.group_size(axes))
    if common.use_xla("ppermute", x.dtype):
        return jax.lax.ppermute(x, axis_name, pairs)
    x, params = common.prepare("ppermute", x, axis_name, timeout_s)
    return ppermute_p.bind(x, perm=pairs, **params)
