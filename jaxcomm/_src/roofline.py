"""jaxcomm's collectives in JAX's cost model (``jax.experimental.roofline``).

The roofline interpreter walks a program's jaxpr and asks each primitive's rule for its
FLOPs, memory bytes and communication (``ici_bytes``, ``ici_latency`` per mesh axis). Without
rules for jaxcomm's primitives, a program whose collectives jaxcomm serves (``jaxcomm.lax``,
``use_for_lax``) reports no communication at all. Each jaxcomm primitive is given the rule of
the jax.lax collective it computes, with the same parameters, so that a program reports
the same figures whichever library serves its collectives:

============================================  ============================================
jaxcomm primitive                             jax.lax rule it takes
============================================  ============================================
all_reduce (sum, mean, prod), ft.all_reduce   psum (a ring reduce-scatter + all-gather)
all_reduce (max, min)                         pmax / pmin (jax models them on one element)
all_gather (varying, invarying, reduced)      all_gather
reduce_scatter                                reduce_scatter
all_to_all                                    all_to_all
ppermute                                      ppermute (per source/destination pair)
broadcast                                     all_gather (the root's block reaches R - 1)
ragged_all_to_all                             all_to_all of the whole operand (an upper
                                              bound: jax has no rule for ragged sends)
MoE dispatch, combine (and their halves)      all_to_all of T x K rows of the tokens'
                                              width (an upper bound: each routed slot's
                                              row crosses at most once)
============================================  ============================================

``jax.experimental.roofline`` needs ``absl`` (not one of jax's dependencies): where it is
not installed nothing is registered, and nothing is imported.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
from typing import Any, Callable, Sequence

from jax._src import core
from jax._src.lax import parallel as lax_parallel


def _rules_module() -> Any:
    # The module, not the package's function of the same name that shadows it.
    return importlib.import_module("jax.experimental.roofline.roofline")


def _first_operand(avals: Sequence[Any]) -> list[Any]:
    """What a ragged all_to_all sends, at most: its operand (not the offsets, the sizes or
    the result buffer)."""
    return list(avals[:1])


def _routed_rows(avals: Sequence[Any]) -> list[Any]:
    """What an MoE dispatch or combine sends, at most: one row of its rows' width and dtype
    for each of the routing's T x K slots (operands: the rows, then the routing)."""
    rows, routing = avals[0], avals[1]
    return [core.ShapedArray((math.prod(routing.shape), rows.shape[-1]), rows.dtype)]


def _rule(jax_prim: Any, axes_keyword: str, *keep: str,
          sent: Callable[[Sequence[Any]], list[Any]] | None = None) -> Callable[..., Any]:
    """A rule that calls jax's rule for ``jax_prim`` with jaxcomm's group axes under the
    keyword jax's takes (``axes`` or ``axis_name``) and the params named in ``keep``.
    ``sent``: the avals that stand for what is sent, from the operands' (default: all)."""
    def rule(ctx: Any, *args: Any, axes: tuple, **params: Any) -> Any:
        own = {k: params[k] for k in keep}
        if sent is not None:
            avals = sent(ctx.avals_in)
            ctx, args = dataclasses.replace(ctx, avals_in=avals), args[:len(avals)]
        return _rules_module()._rooflines[jax_prim](ctx, *args, **{axes_keyword: tuple(axes)}, **own)
    return rule


def _all_reduce_rule() -> Callable[..., Any]:
    sums = _rule(lax_parallel.psum_invariant_p, "axes")
    extrema = {"max": _rule(lax_parallel.pmax_p, "axes"), "min": _rule(lax_parallel.pmin_p, "axes")}

    def rule(ctx: Any, *args: Any, op: str, **params: Any) -> Any:
        return extrema.get(op, sums)(ctx, *args, **params)
    return rule


def register() -> bool:
    """Gives each jaxcomm collective primitive its roofline rule; False where
    ``jax.experimental.roofline`` cannot be imported (no ``absl``)."""
    if importlib.util.find_spec("absl") is None:
        return False
    importlib.import_module("jax.experimental.roofline.rooflines")  # jax's own rules first

    from jaxcomm._src.moe import fused
    from jaxcomm._src.ops import alltoall, broadcast, ft, gather, permute, ragged, reduce

    all_to_all = _rule(lax_parallel.all_to_all_p, "axis_name")
    all_gather = _rule(lax_parallel.all_gather_p, "axis_name")
    ragged_sends = _rule(lax_parallel.all_to_all_p, "axis_name", sent=_first_operand)
    routed = _rule(lax_parallel.all_to_all_p, "axis_name", sent=_routed_rows)
    rules = {
        reduce.all_reduce_p: _all_reduce_rule(),
        ft.ft_all_reduce_p: _rule(lax_parallel.psum_invariant_p, "axes"),
        gather.all_gather_p: all_gather,
        gather.all_gather_invariant_p: all_gather,
        gather.all_gather_reduced_p: all_gather,
        broadcast.broadcast_p: all_gather,
        reduce.reduce_scatter_p: _rule(lax_parallel.reduce_scatter_p, "axis_name"),
        alltoall.all_to_all_p: all_to_all,
        permute.ppermute_p: _rule(lax_parallel.ppermute_p, "axis_name", "perm"),
        ragged.ragged_all_to_all_p: ragged_sends,
        fused.moe_dispatch_p: routed,
        fused.moe_transport_p: routed,
        fused.moe_transport_send_p: routed,
    }
    for prim, rule in rules.items():
        _rules_module().register_roofline(prim)(rule)
    return True
