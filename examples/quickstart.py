"""jaxcomm quickstart: every collective inside one jitted shard_map program.

Runs on 8 emulated CPU devices, checks each result against its jax.lax counterpart,
and prints a small jaxcomm-vs-XLA timing table.

    pip install . && python examples/quickstart.py
"""

from __future__ import annotations

import os

# Emulate 8 devices on the CPU; must happen before JAX initialises its backend.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm.bench.collectives import run as bench_run  # noqa: E402

R = 8
RING = [(i, (i + 1) % R) for i in range(R)]


def jaxcomm_ops(x: jax.Array) -> dict[str, jax.Array]:
    return {
        "all_reduce(sum)": jaxcomm.all_reduce(x, "x"),
        "all_reduce(max)": jaxcomm.all_reduce(x, "x", op="max"),
        "all_gather": jaxcomm.all_gather(x, "x", axis=1, tiled=True),
        "reduce_scatter": jaxcomm.reduce_scatter(x, "x", scatter_dimension=1, tiled=True),
        "all_to_all": jaxcomm.all_to_all(x, "x", 1, 1, tiled=True),
        "ppermute": jaxcomm.ppermute(x, "x", RING),
        "broadcast": jaxcomm.broadcast(x, "x", root=3),
    }


def lax_ops(x: jax.Array) -> dict[str, jax.Array]:
    root = jax.lax.axis_index("x") == 3
    return {
        "all_reduce(sum)": jax.lax.psum(x, "x"),
        "all_reduce(max)": jax.lax.pmax(x, "x"),
        "all_gather": jax.lax.all_gather(x, "x", axis=1, tiled=True),
        "reduce_scatter": jax.lax.psum_scatter(x, "x", scatter_dimension=1, tiled=True),
        "all_to_all": jax.lax.all_to_all(x, "x", 1, 1, tiled=True),
        "ppermute": jax.lax.ppermute(x, "x", RING),
        "broadcast": jax.lax.psum(jnp.where(root, x, 0), "x"),
    }


def main() -> None:
    mesh = jax.make_mesh((R,), ("x",))
    x = jax.random.normal(jax.random.key(0), (R * 4, 64), jnp.float32)
    x = jax.device_put(x, NamedSharding(mesh, P("x")))

    def both(v: jax.Array):
        return jaxcomm_ops(v), lax_ops(v)

    # check_vma=False: every result is returned per device, whatever its type.
    program = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                    check_vma=False))
    ours, theirs = program(x)
    print(f"jaxcomm {jaxcomm.__version__} on {R} CPU devices: results against jax.lax")
    for name in ours:
        a, b = np.asarray(ours[name]), np.asarray(theirs[name])
        if name.startswith(("all_reduce(sum)", "reduce_scatter", "broadcast")):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(a, b)
        print(f"  {name:<16} ok  shape {a.shape}")

    # Loops of 1, 10 and 100 collectives per jitted call, fitted as a + b*n: b is the cost
    # of one collective, a the fixed cost of a call (jaxcomm.bench.method).
    print("\ntiming (us per collective; ratio = XLA time / jaxcomm time, above 1: jaxcomm faster)")
    records = bench_run(ops=["all_reduce", "all_gather", "all_to_all", "ppermute"],
                        sizes=[4, 1 << 20], devices=R, dtype="float32", rounds=3,
                        lengths=(1, 10, 100))
    print(f"  {'op':<16}{'bytes':>10}{'jaxcomm us':>12}{'XLA us':>10}{'ratio':>8}")
    for r in records:
        ours, xla = r["jaxcomm_per_collective_us"], r["xla_per_collective_us"]
        print(f"  {r['op']:<16}{r['bytes']:>10}{ours:>12.2f}{xla:>10.2f}{xla / ours:>8.2f}")


if __name__ == "__main__":
    main()
