"""A tensor-parallel transformer MLP block built on jaxcomm.tp, trained for a few steps.

The block runs inside one ``jax.jit(jax.shard_map(...))`` program over a ("dp", "tp") mesh
of emulated CPU devices (2 x 4 by default), Megatron-style with sequence parallelism:
activations enter split over "dp" (batch) and "tp" (sequence); the up-projection's
weight is split by columns and the down-projection's by rows over "tp". The block is

    h = gelu(all_gather_matmul(x, w_up, "tp", gather_axis=1))   # [B, S, F/tp]
    y = x + matmul_reduce_scatter(h, w_down, "tp", scatter_dimension=1)   # [B, S/tp, D]

so the all-gather before the first matmul and the reduce-scatter after the second travel
by one-sided puts while the chunk matmuls run. The weights' gradients come back summed
over "dp" (the weights are invariant there), as for any shard_map program.

Before training, the output and the gradients are checked against a single-device
reference in plain ``jax.numpy``; then a few SGD steps regress the block onto a fixed
random target, printing loss and step time.

    pip install . && python examples/tp_mlp.py
    python examples/tp_mlp.py --batch 4 --seq 64 --d-model 64 --d-ff 256 --steps 10 --direction bidirectional
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402

Params = dict[str, jax.Array]

ACTIVATIONS = P("dp", "tp", None)                    # [B, S, D]: batch over dp, sequence over tp
PARAM_SPECS = {"w_up": P(None, "tp"), "w_down": P("tp", None)}


# The ring's direction: None lets jaxcomm.tp choose from the shape (no ring for blocks under
# 256 KiB, where the ring's steps cost more than they hide); --direction overrides it.
DIRECTION: str | None = None


def mlp_local(x: jax.Array, params: Params) -> jax.Array:
    """Per-device body: x [B/dp, S/tp, D]; w_up [D, F/tp]; w_down [F/tp, D]."""
    h = jax.nn.gelu(jaxcomm.tp.all_gather_matmul(x, params["w_up"], "tp", gather_axis=1, direction=DIRECTION))
    return x + jaxcomm.tp.matmul_reduce_scatter(h, params["w_down"], "tp", scatter_dimension=1,
                                                direction=DIRECTION)


def mlp_reference(x: jax.Array, params: Params) -> jax.Array:
    """The same block on one device."""
    return x + jax.nn.gelu(x @ params["w_up"]) @ params["w_down"]


def loss_local(params: Params, x: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error over the whole batch (summed over both axes)."""
    err = ((mlp_local(x, params) - target) ** 2).sum()
    return jaxcomm.all_reduce(err, ("dp", "tp")) / (x.size * jax.lax.axis_size(("dp", "tp")))


def grads_local(params: Params, x: jax.Array, target: jax.Array) -> tuple[jax.Array, Params]:
    # The weights are the same on every dp replica (invariant over "dp"): their gradients
    # come back summed over the replicas' batches, as jax.lax's typing rules transpose it.
    return jax.value_and_grad(loss_local)(params, x, target)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--d-ff", type=int, default=128)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--direction", choices=("one_way", "bidirectional", "none"), default=None)
    args = ap.parse_args()
    global DIRECTION
    DIRECTION = args.direction

    dp = jax.device_count() // args.tp
    mesh = jax.make_mesh((dp, args.tp), ("dp", "tp"))
    rng = np.random.default_rng(0)
    B, S, D, F = args.batch, args.seq, args.d_model, args.d_ff
    host = {
        "x": rng.normal(size=(B, S, D)).astype(np.float32),
        "target": rng.normal(size=(B, S, D)).astype(np.float32),
        "w_up": (rng.normal(size=(D, F)) / np.sqrt(D)).astype(np.float32),
        "w_down": (rng.normal(size=(F, D)) / np.sqrt(F)).astype(np.float32),
    }
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    params = {k: put(host[k], s) for k, s in PARAM_SPECS.items()}
    x, target = put(host["x"], ACTIVATIONS), put(host["target"], ACTIVATIONS)

    in_specs = (PARAM_SPECS, ACTIVATIONS, ACTIVATIONS)
    forward = jax.jit(jax.shard_map(lambda p, x: mlp_local(x, p), mesh=mesh,
                                    in_specs=(PARAM_SPECS, ACTIVATIONS), out_specs=ACTIVATIONS))
    value_and_grads = jax.jit(jax.shard_map(grads_local, mesh=mesh, in_specs=in_specs,
                                            out_specs=(P(), PARAM_SPECS)))

    # Check against the single-device reference.
    ref_params = {k: jnp.asarray(host[k]) for k in PARAM_SPECS}
    np.testing.assert_allclose(np.asarray(forward(params, x)), np.asarray(mlp_reference(jnp.asarray(host["x"]),
                                                                                        ref_params)),
                               rtol=1e-4, atol=1e-4)
    ref_loss = lambda p: ((mlp_reference(jnp.asarray(host["x"]), p) - host["target"]) ** 2).mean()  # noqa: E731
    want_loss, want_grads = jax.value_and_grad(ref_loss)(ref_params)
    loss, grads = value_and_grads(params, x, target)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-4)
    for k in PARAM_SPECS:
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(want_grads[k]), rtol=1e-3, atol=1e-5)
    print(f"forward, loss and gradients match the single-device reference "
          f"(mesh dp={dp} x tp={args.tp}, B={B} S={S} D={D} F={F}, direction {DIRECTION or 'from the shape'})")

    @jax.jit
    def sgd(params: Params, grads: Params) -> Params:
        return jax.tree.map(lambda p, g: p - args.lr * g, params, grads)

    for step in range(args.steps):
        t0 = time.perf_counter()
        loss, grads = value_and_grads(params, x, target)
        params = sgd(params, grads)
        jax.block_until_ready(params)
        print(f"step {step}  loss {float(loss):.5f}  {1e3 * (time.perf_counter() - t0):.1f} ms")


if __name__ == "__main__":
    main()
