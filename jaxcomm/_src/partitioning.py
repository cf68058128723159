"""Attributes that let XLA split a jaxcomm custom call over auto mesh axes.

In a shard_map that is manual over only some mesh axes, the custom call still sits in a
program that the partitioner shards over the other axes. Without help it replicates the
operand there (an all-gather over the auto axes). Marking the call batch-partitionable
(``num_batch_dims`` frontend attribute + a Shardy ``sharding_rule`` over those leading
dimensions, as jax's own linalg FFI calls do) lets each device run it on its own slice.
"""

from __future__ import annotations

import string
from typing import Any

from jax._src import config as _config
from jax._src.custom_partitioning_sharding_rule import sdy_sharding_rule_to_mlir, str_to_sdy_sharding_rule
from jax._src.interpreters import mlir


def _factors(letters: Any, batch_dims: int, ndim: int) -> str:
    own = " ".join(next(letters) for _ in range(ndim - batch_dims))
    return ("... " + own).strip() if batch_dims else own


def batch_partitioning_attributes(ctx: mlir.LoweringRuleContext, batch_dims: int) -> dict[str, Any]:
    """Extra custom-call attributes declaring the first ``batch_dims`` dims as batch."""
    attrs: dict[str, Any] = {
        "mhlo.frontend_attributes": mlir.ir_attribute({"num_batch_dims": str(batch_dims)})}
    if _config.use_shardy_partitioner.value:
        letters = iter(string.ascii_letters)
        lhs = ", ".join(_factors(letters, batch_dims, len(a.shape)) for a in ctx.avals_in)
        rhs = ", ".join(_factors(letters, batch_dims, len(a.shape)) for a in ctx.avals_out)
        rule = str_to_sdy_sharding_rule(f"{lhs} -> {rhs}")
        in_types = [mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_in]
        out_types = [mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out]
        attrs["sdy.sharding_rule"] = sdy_sharding_rule_to_mlir(rule, in_types, out_types)
    return attrs
