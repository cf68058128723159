"""An expert-parallel mixture-of-experts layer built on jaxcomm.moe, trained for a few steps.

The layer runs inside one ``jax.jit(jax.shard_map(...))`` program over a ("dp", "ep") mesh
of emulated CPU devices (2 x 4 by default): tokens are sharded over both axes, expert
weights over "ep", and the router is replicated. Each step routes tokens with a softmax
top-k router, sends them to the ranks that own their experts with
``jaxcomm.moe.dispatch_padded``, applies a GELU FFN per local expert, and brings the
results back with ``jaxcomm.moe.combine_padded``.

Before training, the forward output and the gradients (router and expert weights) are
checked against a dense single-device reference in plain ``jax.numpy``, and the same layer
written in the global view (``jax.jit`` on sharded arrays, no shard_map) against the
shard_map one. Then a few SGD
steps regress the layer onto a fixed random target, printing loss and step time.

    pip install . && python examples/moe_layer.py
    python examples/moe_layer.py --tokens 128 --experts 16 --top-k 4 --steps 10
"""

from __future__ import annotations

import os

# Emulate 8 devices on the CPU; must happen before JAX initialises its backend. An existing
# device count in XLA_FLAGS wins, so larger meshes can be requested from the shell.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402

Params = dict[str, jax.Array]

TOKENS = P(("dp", "ep"))        # every device holds its own T tokens
EXPERTS = P("ep", None, None)   # each "ep" rank holds E_local experts, copied over "dp"
REPLICATED = P()
PARAM_SPECS = {"router": REPLICATED, "w_in": EXPERTS, "w_out": EXPERTS}


def route(x: jax.Array, router: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Softmax top-k routing: (expert ids [T, K] int32, their probabilities [T, K])."""
    probs = jax.nn.softmax(x @ router, axis=-1)
    # Gradients reach the router through the selected probabilities; the choice itself is
    # piecewise constant. No renormalisation over the top k, to keep the reference simple.
    weights, ids = jax.lax.top_k(probs, top_k)
    return ids.astype(jnp.int32), weights


def moe_layer_local(x: jax.Array, params: Params, *, num_experts: int, top_k: int) -> jax.Array:
    """Per-device body: x [T, H] local tokens, w_in/w_out the local experts' weights."""
    ids, weights = route(x, params["router"], top_k)
    # The padded layout ([E_local, R*T, H], each expert's rows at the front of its slab)
    # turns the expert FFN into a batched einsum. The packed layout would need
    # jax.lax.ragged_dot, which on CPU computes a dense product for every group, so it
    # costs E_local times the padded einsum here rather than saving the padding.
    ex, _, handle = jaxcomm.moe.dispatch_padded(x, ids, num_experts=num_experts, axis_name="ep")
    h = jax.nn.gelu(jnp.einsum("erh,ehf->erf", ex, params["w_in"]))
    ey = jnp.einsum("erf,efh->erh", h, params["w_out"])
    # Padding rows are zero in and (gelu(0) = 0, no bias) zero out, and combine never
    # reads them anyway.
    return jaxcomm.moe.combine_padded(ey, handle, weights)


def moe_layer_global(x: jax.Array, params: Params, mesh: Mesh, *, num_experts: int,
                     top_k: int) -> jax.Array:
    """The same layer in the global view (pjit style: jit on sharded arrays, no shard_map).

    x [dp*ep*T, H] sharded P(("dp", "ep")); jaxcomm.moe takes the mesh and the token
    layout from x's sharding. expert_x comes back as [dp*ep*E_local, S, H], block (d, p)
    holding "ep" rank p's experts, so the weights [E, H, F] meet it as [ep, E_local, H, F].
    """
    dp, ep = mesh.shape["dp"], mesh.shape["ep"]
    el = num_experts // ep
    ids, weights = route(x, params["router"], top_k)
    ex, _, handle = jaxcomm.moe.dispatch_padded(x, ids, num_experts=num_experts, axis_name="ep")
    slab, hidden = ex.shape[1:]
    on = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    ex = ex.reshape(dp, ep, el, slab, hidden, out_sharding=on("dp", "ep"))
    w_in = params["w_in"].reshape(ep, el, *params["w_in"].shape[1:], out_sharding=on("ep"))
    w_out = params["w_out"].reshape(ep, el, *params["w_out"].shape[1:], out_sharding=on("ep"))
    h = jax.nn.gelu(jnp.einsum("dperh,pehf->dperf", ex, w_in))
    ey = jnp.einsum("dperf,pefh->dperh", h, w_out)
    ey = ey.reshape(dp * ep * el, slab, hidden, out_sharding=on(("dp", "ep")))
    return jaxcomm.moe.combine_padded(ey, handle, weights)


def make_programs(mesh: Mesh, num_experts: int, top_k: int, n_elems: int
                  ) -> tuple[Callable[..., jax.Array], Callable[..., jax.Array]]:
    """Returns (forward, loss): jittable global-view functions, each one shard_map."""
    body = lambda x, p: moe_layer_local(x, p, num_experts=num_experts, top_k=top_k)  # noqa: E731
    forward = jax.shard_map(body, mesh=mesh, in_specs=(TOKENS, PARAM_SPECS), out_specs=TOKENS)

    def local_loss(x: jax.Array, target: jax.Array, p: Params) -> jax.Array:
        err = body(x, p) - target
        # A global mean: every device's sum, reduced over the whole mesh, so the loss (and
        # with it every gradient) is the same number the dense reference computes.
        return jax.lax.psum(jnp.sum(err * err), ("dp", "ep")) / n_elems

    loss = jax.shard_map(local_loss, mesh=mesh, in_specs=(TOKENS, TOKENS, PARAM_SPECS),
                         out_specs=REPLICATED)
    return forward, loss


def dense_forward(x: jax.Array, params: Params, top_k: int) -> jax.Array:
    """Reference: each token through its own top-k experts directly, no communication."""
    ids, weights = route(x, params["router"], top_k)
    w_in = params["w_in"][ids]     # [N, K, H, F]: the chosen experts' weights per token
    w_out = params["w_out"][ids]   # [N, K, F, H]
    h = jax.nn.gelu(jnp.einsum("nh,nkhf->nkf", x, w_in))
    y = jnp.einsum("nkf,nkfh->nkh", h, w_out)
    return jnp.einsum("nk,nkh->nh", weights, y)


def dense_loss(x: jax.Array, target: jax.Array, params: Params, top_k: int) -> jax.Array:
    err = dense_forward(x, params, top_k) - target
    return jnp.sum(err * err) / err.size


def init(key: jax.Array, n_total: int, hidden: int, ffn: int, experts: int
         ) -> tuple[jax.Array, jax.Array, Params]:
    kx, kt, kr, ki, ko = jax.random.split(key, 5)
    x = jax.random.normal(kx, (n_total, hidden), jnp.float32)
    # A fixed nonlinear function of the input, so the target is learnable and loss falls.
    teacher = jax.random.normal(kt, (hidden, hidden), jnp.float32) / np.sqrt(hidden)
    target = jnp.tanh(x @ teacher)
    params = {
        "router": jax.random.normal(kr, (hidden, experts), jnp.float32) / np.sqrt(hidden),
        "w_in": jax.random.normal(ki, (experts, hidden, ffn), jnp.float32) / np.sqrt(hidden),
        "w_out": jax.random.normal(ko, (experts, ffn, hidden), jnp.float32) / np.sqrt(ffn),
    }
    return x, target, params


def to_host(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


def check_against_dense(forward: Callable, loss: Callable, x: jax.Array, target: jax.Array,
                        params: Params, top_k: int, global_forward: Callable) -> None:
    y = jax.jit(forward)(x, params)
    np.testing.assert_allclose(np.asarray(jax.jit(global_forward)(x, params)), np.asarray(y),
                               rtol=1e-5, atol=1e-6)
    g = jax.jit(jax.grad(loss, argnums=2))(x, target, params)

    # The reference sees plain single-device arrays: nothing sharded, nothing collective.
    dev = jax.devices()[0]
    x1, t1, p1 = jax.device_put(to_host((x, target, params)), dev)
    y_ref = jax.jit(dense_forward, static_argnums=2)(x1, p1, top_k)
    g_ref = jax.jit(jax.grad(dense_loss, argnums=2), static_argnums=3)(x1, t1, p1, top_k)

    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    for name in ("router", "w_in", "w_out"):
        np.testing.assert_allclose(np.asarray(g[name]), np.asarray(g_ref[name]),
                                   rtol=1e-4, atol=1e-6, err_msg=f"gradient of {name}")
    print("forward (shard_map and global view) and gradients match the dense reference")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=2, help="data-parallel mesh axis size")
    ap.add_argument("--ep", type=int, default=4, help="expert-parallel mesh axis size")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per device (T)")
    ap.add_argument("--hidden", type=int, default=32, help="model width (H)")
    ap.add_argument("--ffn", type=int, default=64, help="expert FFN width (F)")
    ap.add_argument("--experts", type=int, default=8, help="total experts (E), divisible by --ep")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token (K)")
    ap.add_argument("--steps", type=int, default=5, help="SGD steps")
    ap.add_argument("--lr", type=float, default=2.0, help="SGD learning rate")
    args = ap.parse_args()

    n_dev = args.dp * args.ep
    if n_dev > len(jax.devices()):
        raise SystemExit(f"a {args.dp}x{args.ep} mesh needs {n_dev} devices, found "
                         f"{len(jax.devices())}; set XLA_FLAGS=--xla_force_host_platform_device_count={n_dev}")
    if args.experts % args.ep or not 1 <= args.top_k <= args.experts:
        raise SystemExit("--experts must be divisible by --ep, and 1 <= --top-k <= --experts")

    mesh = jax.make_mesh((args.dp, args.ep), ("dp", "ep"), devices=jax.devices()[:n_dev])
    n_total = n_dev * args.tokens
    x, target, params = init(jax.random.key(0), n_total, args.hidden, args.ffn, args.experts)
    # Lay inputs out exactly as in_specs asks, so jit inserts no resharding.
    tok = NamedSharding(mesh, TOKENS)
    x, target = jax.device_put((x, target), tok)
    params = {k: jax.device_put(v, NamedSharding(mesh, PARAM_SPECS[k])) for k, v in params.items()}

    print(f"MoE layer: {args.dp}x{args.ep} (dp x ep) CPU mesh, {args.tokens} tokens/device, "
          f"H={args.hidden}, F={args.ffn}, {args.experts} experts "
          f"({args.experts // args.ep}/rank), top-{args.top_k}")
    forward, loss = make_programs(mesh, args.experts, args.top_k, n_total * args.hidden)
    global_forward = lambda x, p: moe_layer_global(x, p, mesh, num_experts=args.experts,  # noqa: E731
                                                   top_k=args.top_k)
    check_against_dense(forward, loss, x, target, params, args.top_k, global_forward)

    @jax.jit
    def train_step(params: Params, x: jax.Array, target: jax.Array) -> tuple[Params, jax.Array]:
        value, grads = jax.value_and_grad(loss, argnums=2)(x, target, params)
        return jax.tree.map(lambda p, g: p - args.lr * g, params, grads), value

    # Compile ahead of time so the per-step times below measure execution only.
    t0 = time.perf_counter()
    step = train_step.lower(params, x, target).compile()
    print(f"compiled train step in {time.perf_counter() - t0:.2f} s")
    for i in range(args.steps):
        t0 = time.perf_counter()
        params, value = step(params, x, target)
        value = float(value)  # blocks until the step is done
        print(f"step {i}: loss {value:.6f}  time {1e3 * (time.perf_counter() - t0):.2f} ms")


if __name__ == "__main__":
    main()
