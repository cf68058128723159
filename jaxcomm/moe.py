"""Expert-parallel MoE dispatch/combine (DeepEP-style) with static shapes and autodiff.

For a group of R ranks along ``axis_name``, with ``E_local = num_experts // R``, rank r owns
global experts ``[r*E_local, (r+1)*E_local)``. Every kept (token, expert) assignment takes
one row of its receiver's ``expert_x``, copied once from its source; the routing is computed
inside the program, never through the host. docs/moe.md walks through the modes, their
layouts and a global-view layer on a ("dp", "ep") mesh.

Layouts (all static shapes):

* :func:`dispatch` / :func:`combine`: packed rows ``[C, H]`` for ``jax.lax.ragged_dot``;
* :func:`dispatch_padded` / :func:`combine_padded`: ``[E_local, S, H]`` slabs for batched
  matmuls;
* :func:`dispatch_low_latency` / :func:`combine_low_latency`: DeepEP's low-latency layout
  for decode, ``[E_local, R * max_tokens, H]``, which never drops; on the host backend the
  rows past each expert's count are left unwritten (unspecified), so the call costs only
  the rows it moves.

Options of every dispatch: ``fp8`` (tokens travel as float8_e4m3fn with one float32 scale
per 128 channels, delivered dequantized or as (values, scales)) and ``check_ids`` (raise on
an expert id outside ``[-1, num_experts)`` instead of counting it). Split-phase halves
(:func:`dispatch_send` / :func:`dispatch_recv`, :func:`combine_send` / :func:`combine_recv`)
let XLA run independent work while the tokens travel.

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
inside shard_map (not of the split halves). Gradients reach x (through dispatch), expert_y
and weights (through combine). FP8 rounding is differentiated as the identity: the gradient
of an FP8 dispatch is the combine of the cotangent in x's dtype (bfloat16 in DeepEP's
setting); ``fp8="raw"`` is not differentiable.

Semantics of repeated experts in one row of ``expert_ids`` (top-k gives distinct ones): each
slot is its own assignment (its own row, its own weight in combine); the padded layout keeps
at most S rows per expert (its capacity, default R*T) and counts the rest in ``handle.dropped``.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxcomm._src.moe import api, split
from jaxcomm._src.moe.api import Handle
from jaxcomm._src.moe.split import PendingCombine, PendingDispatch

__all__ = ["Handle", "PendingCombine", "PendingDispatch", "combine", "combine_low_latency",
           "combine_padded", "combine_recv", "combine_send", "dispatch", "dispatch_low_latency",
           "dispatch_padded", "dispatch_recv", "dispatch_send"]

Fp8 = Any  # None, "dequantize" or "raw"


def dispatch(x: jax.Array, expert_ids: jax.Array, *, num_experts: int, axis_name: Any,
             capacity: int | None = None, fp8: Fp8 = None,
             check_ids: bool = False) -> tuple[Any, jax.Array, Handle]:
    """Sends each token to the ranks owning its experts and packs rows by local expert.

    Args:
      x: [T, H] this rank's tokens, any floating-point dtype (integer tokens are a
        TypeError: combine sums them, weighted).
      expert_ids: [T, K] integers (int32 or int64), each in [0, num_experts) or -1 (no
        expert). Other values count in ``handle.invalid`` and are treated as -1, or raise
        with ``check_ids=True``.
      num_experts: total experts E; must be divisible by the group size R.
      axis_name: the expert-parallel mesh axis (or tuple of axes).
      capacity: rows C of expert_x (default R*T*min(K, E_local), which never drops).
      fp8: None; "dequantize": tokens travel as float8_e4m3fn with one float32 scale per
        128 channels (about half of bfloat16's bytes) and arrive dequantized in x's dtype;
        "raw": they arrive as (values float8_e4m3fn [C, H], scales float32 [C, ceil(H/128)])
        for an FP8 matmul. x must be float32, bfloat16 or float16.
      check_ids: raise (when the program runs) on an expert id outside [-1, num_experts).

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
    spec = api.DispatchSpec("dispatch", num_experts, "packed", capacity, None, fp8, check_ids)
    return api.run_dispatch(spec, x, expert_ids, axis_name)


def combine(expert_y: jax.Array, handle: Handle, weights: jax.Array) -> jax.Array:
    """Returns expert outputs to their tokens' ranks and sums them with ``weights``.

    ``y[t] = sum_k weights[t, k] * expert_y[row(t, k)]`` over kept assignments (dropped and
    -1 slots contribute zero). Accumulation is float32 (half precision rows are converted
    as they are read): each destination rank sums its slots in k order, then the source
    sums those per-rank partials in rank order. Result in x's dtype.

    Args:
      expert_y: [C, H] rows aligned with dispatch's expert_x, float32, bfloat16 or float16.
      handle: from :func:`dispatch`.
      weights: [T, K] floating point.

    Returns:
      y: [T, H] in the dtype of the x given to dispatch.
    """
    return api.run_combine("combine", expert_y, handle, weights)


def dispatch_padded(x: jax.Array, expert_ids: jax.Array, *, num_experts: int,
                    axis_name: Any, capacity: int | None = None, fp8: Fp8 = None,
                    check_ids: bool = False) -> tuple[Any, jax.Array, Handle]:
    """As :func:`dispatch`, in a per-expert padded layout for batched matmuls.

    Args:
      capacity: rows S per expert slab (default R*T, which never drops). When more than S
        rows arrive for an expert, the first S in (source rank, token, slot) order are kept
        and the rest count in ``handle.dropped``.
      fp8, check_ids: as for :func:`dispatch` (FP8 scales come as [E_local, S, ceil(H/128)]).

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
    spec = api.DispatchSpec("dispatch_padded", num_experts, "padded", capacity, None, fp8, check_ids)
    return api.run_dispatch(spec, x, expert_ids, axis_name)


def combine_padded(expert_y: jax.Array, handle: Handle, weights: jax.Array) -> jax.Array:
    """:func:`combine` for the layout of :func:`dispatch_padded` (expert_y [E_local, S, H])."""
    return api.run_combine("combine_padded", expert_y, handle, weights)


def dispatch_low_latency(x: jax.Array, expert_ids: jax.Array, *, num_experts: int, axis_name: Any,
                         max_tokens: int, fp8: Fp8 = None,
                         check_ids: bool = False) -> tuple[Any, jax.Array, Handle]:
    """Decode-sized dispatch into DeepEP's low-latency layout: static shapes, no drops.

    Every expert gets a slab of R * max_tokens rows (every token of every rank could pick
    it), so nothing about the shapes depends on the routing, no capacity is chosen and no
    count exchange precedes the data movement: on the host backend the routing is computed
    inside the one collective call. Meant for at most a few hundred tokens per rank.

    Args:
      x: [T, H] with T <= max_tokens (a trace-time error otherwise).
      max_tokens: the declared largest T of any call (fixes the layout).
      fp8, check_ids: as for :func:`dispatch`.

    Returns:
      expert_x: [E_local, R * max_tokens, H] x.dtype. Local expert e's rows are
        expert_x[e, :counts[e]], ordered by (source rank, token, slot); the rows past
        counts[e] hold unspecified values (the host backend leaves them unwritten, as
        DeepEP does): mask them, e.g. ``jnp.arange(S)[None, :, None] < counts[:, None, None]``,
        before computing on whole slabs whose results are differentiated or reduced.
      counts: [E_local] int32 rows received per local expert.
      handle: for :func:`combine_low_latency`.

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
        >>> def decode(x, ids, w, w_local):
        ...     ex, counts, h = jaxcomm.moe.dispatch_low_latency(x, ids, num_experts=E,
        ...                                                      axis_name="ep", max_tokens=T)
        ...     valid = jnp.arange(ex.shape[1])[None, :, None] < counts[:, None, None]
        ...     ey = jnp.einsum("erh,ehf->erf", jnp.where(valid, ex, 0), w_local)
        ...     return jaxcomm.moe.combine_low_latency(ey, h, w), counts
        >>> y, counts = jax.jit(jax.shard_map(decode, mesh=mesh, in_specs=P("ep"),
        ...                                   out_specs=P("ep")))(x, ids, w, w_local)
        >>> np.asarray(y)[0], int(counts.sum())  # (0.5 + 0.5) * x[0] @ ones((H, H)); nothing dropped
        (array([2., 2.], dtype=float32), 64)
    """
    spec = api.DispatchSpec("dispatch_low_latency", num_experts, "low_latency", None, max_tokens, fp8,
                            check_ids)
    return api.run_dispatch(spec, x, expert_ids, axis_name)


def combine_low_latency(expert_y: jax.Array, handle: Handle, weights: jax.Array) -> jax.Array:
    """:func:`combine` for :func:`dispatch_low_latency`'s layout (expert_y [E_local, R *
    max_tokens, H]); reads only each expert's first counts[e] rows."""
    return api.run_combine("combine_low_latency", expert_y, handle, weights)


def dispatch_send(x: jax.Array, expert_ids: jax.Array, *, num_experts: int, axis_name: Any,
                  layout: str = "packed", capacity: int | None = None, max_tokens: int | None = None,
                  fp8: Fp8 = None, check_ids: bool = False) -> PendingDispatch:
    """The first half of a split-phase dispatch: publishes this rank's tokens and returns.

    On the host backend the send half returns at once; the tokens move on jaxcomm's threads
    once every rank has sent, while XLA runs whatever does not depend on them (a shared
    expert, another micro-batch's attention); :func:`dispatch_recv` waits for them. Same
    values and gradients as the fused call. Both halves must be in one jitted program, and
    the pending value may only be passed to dispatch_recv (it is not a pytree).

    Args:
      layout: "packed" (:func:`dispatch`), "padded" (:func:`dispatch_padded`) or
        "low_latency" (:func:`dispatch_low_latency`, with max_tokens).
      capacity, max_tokens, fp8, check_ids: as for those functions.

    Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``), a
    step whose shared expert runs in two parts, one while the tokens travel to the experts
    and one while the rows travel back::

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
        >>> def step(x, ids, w, w_local):
        ...     pending = jaxcomm.moe.dispatch_send(x, ids, num_experts=E, axis_name="ep",
        ...                                         layout="padded")
        ...     h1 = jax.nn.relu(3 * x)            # shared expert, first part
        ...     ex, counts, h = jaxcomm.moe.dispatch_recv(pending)
        ...     pending = jaxcomm.moe.combine_send(jnp.einsum("esh,ehf->esf", ex, w_local), h, w)
        ...     shared = h1 + 1                    # shared expert, second part
        ...     return jaxcomm.moe.combine_recv(pending) + shared
        >>> y = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
        ...     x, ids, w, w_local)
        >>> np.asarray(y)[0]                    # experts 2, shared expert 3 + 1
        array([6., 6.], dtype=float32)
    """
    if layout not in ("packed", "padded", "low_latency"):
        raise ValueError(f"jaxcomm.moe.dispatch_send: layout must be 'packed', 'padded' or "
                         f"'low_latency', got {layout!r}")
    if layout == "low_latency" and max_tokens is None:
        raise ValueError("jaxcomm.moe.dispatch_send: the low_latency layout needs max_tokens")
    spec = api.DispatchSpec("dispatch_send", num_experts, layout, capacity, max_tokens, fp8, check_ids)
    return split.dispatch_send(spec, x, expert_ids, axis_name)


def dispatch_recv(pending: PendingDispatch) -> tuple[Any, jax.Array, Handle]:
    """The second half of :func:`dispatch_send`: (expert_x, counts, handle) as the fused
    dispatch of the same layout returns them."""
    return split.take("dispatch_recv", pending, PendingDispatch, "dispatch_send")


def combine_send(expert_y: jax.Array, handle: Handle, weights: jax.Array) -> PendingCombine:
    """The first half of a split-phase combine (any layout's handle): returns at once;
    :func:`combine_recv` gives y. :func:`dispatch_send`'s example uses both halves."""
    return split.combine_send("combine_send", expert_y, handle, weights)


def combine_recv(pending: PendingCombine) -> jax.Array:
    """The second half of :func:`combine_send`: y [T, H] in x's dtype."""
    return split.take("combine_recv", pending, PendingCombine, "combine_send")
