"""JAX's cost model (jax.experimental.roofline) sees jaxcomm's communication: each
collective reports the same ``ici_bytes`` and ``ici_latency`` as the jax.lax collective it
computes (jaxcomm/_src/roofline.py), so tools built on cost analysis keep working after
``jaxcomm.use_for_lax()``."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxcomm

roofline = pytest.importorskip("jax.experimental.roofline", reason="needs absl (the test extra)")

OPS: dict[str, Callable[[Any, jax.Array], Any]] = {
    "psum": lambda lax, v: lax.psum(v, "x"),
    "psum_two_axes": lambda lax, v: lax.psum(v, ("x", "y")),
    "pmax": lambda lax, v: lax.pmax(v, "x"),
    "pmean": lambda lax, v: lax.pmean(v, "y"),
    "all_gather": lambda lax, v: lax.all_gather(v, "x", tiled=True),
    "psum_scatter": lambda lax, v: lax.psum_scatter(v, "x", tiled=True),
    "all_to_all": lambda lax, v: lax.all_to_all(v, "x", 0, 0, tiled=True),
    "ppermute": lambda lax, v: lax.ppermute(v, "x", [(0, 1), (1, 0)]),
    "ppermute_ring": lambda lax, v: lax.ppermute(v, "y", [(i, (i + 1) % 4) for i in range(4)]),
}


def _cost(mesh: Any, body: Callable[[jax.Array], Any], x: np.ndarray) -> Any:
    """The roofline of ``body`` run on each device's block of ``x`` (dim 0 split over
    every mesh axis), its result flattened."""
    spec = P(tuple(mesh.axis_names))
    f = jax.shard_map(lambda v: jnp.ravel(body(v)), mesh=mesh, in_specs=spec, out_specs=spec)
    arg = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))
    return roofline.roofline(f, mesh=mesh)(arg)[1]


@pytest.mark.parametrize("op", sorted(OPS))
def test_same_communication_as_jax_lax(op: str) -> None:
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    x = np.zeros((8 * 16, 24), np.float32)
    want = _cost(mesh, lambda v: OPS[op](jax.lax, v), x)
    got = _cost(mesh, lambda v: OPS[op](jaxcomm.lax, v), x)
    assert want.ici_bytes and any(want.ici_bytes.values()), want  # the case moves data
    assert got.ici_bytes == want.ici_bytes and got.ici_latency == want.ici_latency, (got, want)


def test_invariant_gather_moves_what_a_gather_moves() -> None:
    # jax has no rule for all_gather(to="invarying") (it reports no communication); jaxcomm
    # gives it the gather's.
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    x = np.zeros((8 * 16, 24), np.float32)
    assert not _cost(mesh, lambda v: jax.lax.all_gather(v, "y", to="invarying"), x).ici_bytes
    got = _cost(mesh, lambda v: jaxcomm.all_gather(v, "y", to="invarying"), x)
    want = _cost(mesh, lambda v: jax.lax.all_gather(v, "y"), x)
    assert got.ici_bytes == want.ici_bytes and want.ici_bytes["y"] > 0, (got, want)


def test_switched_lax_program_reports_its_communication() -> None:
    mesh = jax.make_mesh((8,), ("x",))
    x = np.zeros((8 * 4, 32), np.float32)
    f = lambda v: jax.lax.psum(v, "x")
    want = _cost(mesh, f, x)
    with jaxcomm.use_for_lax():
        got = _cost(mesh, f, x)
    # psum of 4 x 32 float32 a device: a ring reduce-scatter then all-gather, 7/8 each.
    assert got.ici_bytes == want.ici_bytes == {"x": 2 * (4 * 32 * 4 // 8) * 7}, (got, want)


def test_ragged_all_to_all_reports_an_upper_bound() -> None:
    # No jax.lax rule to match: the all_to_all of the whole operand, never nothing.
    mesh = jax.make_mesh((8,), ("x",))
    x = np.zeros((8 * 16, 8), np.float32)

    def ragged(v):
        sizes = jnp.full((8,), 2, jnp.int32)
        offsets = jnp.arange(8, dtype=jnp.int32) * 2
        return jaxcomm.ragged_all_to_all(v, jnp.zeros_like(v), offsets, sizes, offsets, sizes,
                                         axis_name="x")

    cost = _cost(mesh, ragged, x)
    bound = _cost(mesh, lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True), x)
    assert cost.ici_bytes == bound.ici_bytes and cost.ici_bytes["x"] > 0, (cost, bound)
    assert cost.ici_latency == bound.ici_latency, (cost, bound)


def test_moe_dispatch_and_combine_report_their_tokens() -> None:
    # Each of dispatch and combine: the all_to_all of T x K rows of H (each routed slot's
    # row crosses at most once), an upper bound.
    mesh = jax.make_mesh((8,), ("x",))
    tokens, hidden, experts = 16, 8, 16
    x = np.zeros((8 * tokens, hidden), np.float32)
    slots = np.zeros((8 * tokens * 2, hidden), np.float32)
    ids = jnp.asarray(np.arange(tokens * 2).reshape(tokens, 2) % experts, jnp.int32)
    weights = jnp.full((tokens, 2), 0.5, jnp.float32)

    def layer(v):
        ex, _, h = jaxcomm.moe.dispatch(v, ids, num_experts=experts, axis_name="x")
        return jaxcomm.moe.combine(ex, h, weights)

    cost = _cost(mesh, layer, x)
    one = _cost(mesh, lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True), slots)
    assert cost.ici_bytes["x"] == 2 * one.ici_bytes["x"] > 0, (cost, one)
