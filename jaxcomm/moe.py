"""Expert-parallel MoE dispatch/combine (DeepEP-style) with static shapes and autodiff.

For a group of R ranks along ``axis_name``, with ``E_local = num_experts // R``, rank r owns
global experts ``[r*E_local, (r+1)*E_local)``. Every (token, destination rank) pair is sent
once, however many of the token's experts live on that rank, and expanded locally; routing
counts are exchanged inside the program (all_gather), never through the host.

Two call forms:

* inside ``jax.shard_map`` with ``axis_name`` bound: per-rank shapes as documented below;
* under ``jax.jit`` on arrays with a ``NamedSharding`` over a mesh that has ``axis_name``
  (global view, no ``jax.set_mesh`` needed): the shard_map form over ``P(dim0)``, the mesh
  taken from the arguments' sharding. ``dim0`` is the mesh axes x's dim 0 is sharded over
  when x's type says so (Explicit mesh axes, e.g. ``P(("dp", "ep"))``: one ``axis_name``
  group per ``dp`` index), else ``axis_name``. x ``[n*T, H]`` (n blocks) gives expert_x
  ``[n*C, H]`` (padded: ``[n*E_local, S, H]``) and group_sizes ``[n*E_local]``, all
  sharded on dim 0; an x laid out as ``P(dim0)`` is never all-gathered.

Autodiff: forward (``jax.jvp``) and reverse mode, to any order, in both forms; ``jax.vmap``
inside shard_map. Gradients reach x (through dispatch), expert_y and weights (through combine).

Semantics of repeated experts in one row of ``expert_ids`` (top-k gives distinct ones): each
slot is its own assignment (its own row, its own weight in combine); the padded layout keeps
at most S rows per expert (its capacity, default R*T) and counts the rest in ``handle.dropped``.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxcomm._src.moe import api
from jaxcomm._src.moe.api import Handle

__all__ = ["Handle", "combine", "combine_padded", "dispatch", "dispatch_padded"]


def dispatch(x: jax.Array, expert_ids: jax.Array, *, num_experts: int, axis_name: Any,
             capacity: int | None = None) -> tuple[jax.Array, jax.Array, Handle]:
    """Sends each token to the ranks owning its experts and packs rows by local expert.

    Args:
      x: [T, H] this rank's tokens, any float dtype.
      expert_ids: [T, K] integers (int32 or int64), each in [0, num_experts) or -1 (no
        expert). Other values count in ``handle.invalid`` and are treated as -1.
      num_experts: total experts E; must be divisible by the group size R.
      axis_name: the expert-parallel mesh axis (or tuple of axes).
      capacity: rows C of expert_x (default R*T*min(K, E_local), which never drops).

    Returns:
      expert_x: [C, H] x.dtype. Rows grouped by local expert 0..E_local-1, ordered by
        (source rank, token, slot) inside a group, packed from row 0; rows past the total
        are zero. When more than C rows arrive, the first C in that order are kept.
      group_sizes: [E_local] int32 kept rows per local expert (for jax.lax.ragged_dot).
      handle: :class:`Handle` for :func:`combine`; ``handle.dropped`` counts this rank's
        assignments dropped for capacity.

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("ep",))
        >>> T, H, K, E = 4, 2, 2, 16             # per rank: 4 tokens, top-2 of 16 experts
        >>> put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
        >>> x = put(jnp.ones((8 * T, H)))                           # f32[T, H] per rank
        >>> ids = put(jnp.arange(8 * T * K).reshape(8 * T, K) % E)  # i32[T, K] per rank
        >>> w = put(jnp.full((8 * T, K), 0.5))                      # f32[T, K] per rank
        >>> def layer(x, ids, w):
        ...     ex, sizes, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep")
        ...     ey = 2 * ex                     # the experts; e.g. jax.lax.ragged_dot(ex, W, sizes)
        ...     return jaxcomm.moe.combine(ey, h, w), sizes
        >>> y, sizes = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=P("ep"),
        ...                                  out_specs=P("ep")))(x, ids, w)
        >>> np.asarray(y)[0], int(sizes.sum())  # 2 * (0.5 + 0.5) * x[0]; every assignment kept
        (array([2., 2.], dtype=float32), 64)
    """
    return api.run_dispatch("dispatch", x, expert_ids, num_experts, axis_name, capacity, False)


def combine(expert_y: jax.Array, handle: Handle, weights: jax.Array) -> jax.Array:
    """Returns expert outputs to their tokens' ranks and sums them with ``weights``.

    ``y[t] = sum_k weights[t, k] * expert_y[row(t, k)]`` over kept assignments (dropped and
    -1 slots contribute zero). Accumulation is float32: each destination rank sums its slots
    in k order, then the source sums those per-rank partials in rank order. Result in x's
    dtype.

    Args:
      expert_y: [C, H] rows aligned with dispatch's expert_x.
      handle: from :func:`dispatch`.
      weights: [T, K] floating point.

    Returns:
      y: [T, H] in the dtype of the x given to dispatch.
    """
    return api.run_combine("combine", expert_y, handle, weights)


def dispatch_padded(x: jax.Array, expert_ids: jax.Array, *, num_experts: int,
                    axis_name: Any, capacity: int | None = None
                    ) -> tuple[jax.Array, jax.Array, Handle]:
    """As :func:`dispatch`, in a per-expert padded layout for batched matmuls.

    Args:
      capacity: rows S per expert slab (default R*T, which never drops). When more than S
        rows arrive for an expert, the first S in (source rank, token, slot) order are kept
        and the rest count in ``handle.dropped``.

    Returns:
      expert_x: [E_local, S, H]; local expert e's rows are packed at the front of
        expert_x[e], ordered by (source rank, token); the rest are zero.
      counts: [E_local] int32 rows used per expert.
      handle: for :func:`combine_padded`.

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import jaxcomm
        >>> mesh = jax.make_mesh((8,), ("ep",))
        >>> T, H, K, E = 4, 2, 2, 16             # per rank: 4 tokens, top-2 of 16 experts
        >>> put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
        >>> x = put(jnp.ones((8 * T, H)))                           # f32[T, H] per rank
        >>> ids = put(jnp.arange(8 * T * K).reshape(8 * T, K) % E)  # i32[T, K] per rank
        >>> w = put(jnp.full((8 * T, K), 0.5))                      # f32[T, K] per rank
        >>> w_local = put(jnp.ones((E, H, H)))  # f32[E_local, H, H] per rank: its experts
        >>> def layer(x, ids, w, w_local):
        ...     ex, counts, h = jaxcomm.moe.dispatch_padded(x, ids, num_experts=E, axis_name="ep")
        ...     ey = jnp.einsum("esh,ehf->esf", ex, w_local)   # ex: [E_local, S, H]
        ...     return jaxcomm.moe.combine_padded(ey, h, w)
        >>> y = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
        ...     x, ids, w, w_local)
        >>> np.asarray(y)[0]                    # (0.5 + 0.5) * x[0] @ ones((H, H))
        array([2., 2.], dtype=float32)
    """
    return api.run_dispatch("dispatch_padded", x, expert_ids, num_experts, axis_name, capacity, True)


def combine_padded(expert_y: jax.Array, handle: Handle, weights: jax.Array) -> jax.Array:
    """:func:`combine` for the layout of :func:`dispatch_padded` (expert_y [E_local, S, H])."""
    return api.run_combine("combine_padded", expert_y, handle, weights)
