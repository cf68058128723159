"""Data-parallel training step written against jax.lax, with and without ``jaxcomm.use_for_lax()``.

    python -m jaxcomm.bench.dropin [--devices 8] [--width 512] [--layers 4] [--reps 7]
    python -m jaxcomm.launch -n 2 [-d 1] -m jaxcomm.bench.dropin [options]

The step is the usual data-parallel one: an MLP's loss and gradients on this device's part of
the batch, ``jax.lax.pmean(grads, "dp")`` on the gradient pytree (2 leaves per layer), an SGD
update (``shard_map`` with ``check_vma=False``, as code ported from ``pmap`` has it). The same
function is traced twice: once as is (XLA's all-reduce) and once inside
``with jaxcomm.use_for_lax():`` (jaxcomm's). Both programs start from the same parameters;
their results are checked to agree (bit for bit within one process), and then they are timed
in alternating blocks of ``--steps`` steps (each block after an untimed step), ``--reps``
blocks per side; the table gives each side's median per step and the ratio XLA / jaxcomm
(above 1: jaxcomm faster), for the whole step and for the gradient ``pmean`` alone. Across
processes every process times the same blocks (the collectives keep them in step);
process 0 prints. The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Sequence

from jaxcomm._src import config
from jaxcomm.bench import common


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxcomm.bench.dropin", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8,
                   help="CPU devices in a single process (ignored under jaxcomm.launch)")
    p.add_argument("--width", type=int, default=512, help="MLP width (weights are width x width)")
    p.add_argument("--layers", type=int, default=4, help="MLP layers (2 gradient leaves each)")
    p.add_argument("--batch", type=int, default=16, help="examples per device")
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--reps", type=int, default=7, help="timed blocks per side")
    return p


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import numpy as np

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxcomm

    mesh = jax.make_mesh((jax.device_count(),), ("dp",))
    rng = np.random.default_rng(0)
    params = {f"layer{i}": {"w": (rng.standard_normal((args.width, args.width)) / np.sqrt(args.width)
                                  ).astype(np.float32),
                            "b": np.zeros((args.width,), np.float32)} for i in range(args.layers)}
    n = jax.device_count() * args.batch
    x = rng.standard_normal((n, args.width)).astype(np.float32)
    y = rng.standard_normal((n, args.width)).astype(np.float32)

    def put(a: np.ndarray, spec: P) -> jax.Array:
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

    params = jax.tree.map(lambda a: put(a, P()), params)
    x, y = put(x, P("dp")), put(y, P("dp"))

    def local_step(params: Any, x: jax.Array, y: jax.Array) -> tuple[Any, jax.Array]:
        def loss(p: Any) -> jax.Array:
            h = x
            for layer in p.values():
                h = jnp.tanh(h @ layer["w"] + layer["b"])
            return jnp.mean((h - y) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        grads = jax.lax.pmean(grads, "dp")  # looked up in jax.lax when traced
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), jax.lax.pmean(value, "dp")

    def local_pmean(grads: Any) -> Any:
        return jax.lax.pmean(grads, "dp")

    def compile_(fn: Callable, in_specs: Any, out_specs: Any, *example: Any) -> Callable:
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                     check_vma=False)).lower(*example).compile()

    programs: dict[str, dict[str, Callable]] = {}
    for side in ("xla", "jaxcomm"):
        switch = jaxcomm.use_for_lax() if side == "jaxcomm" else None
        try:
            programs[side] = {
                "train step": compile_(local_step, (P(), P("dp"), P("dp")), (P(), P()), params, x, y),
                "pmean(grads)": compile_(local_pmean, P(), P(), params),
            }
        finally:
            if switch is not None:
                switch.undo()

    # Same answer from both (one process: the same additions in the same order).
    a, b = (programs[s]["train step"](params, x, y) for s in ("xla", "jaxcomm"))
    local = lambda t: [np.asarray(s.data) for leaf in jax.tree.leaves(t) for s in leaf.addressable_shards]
    exact = jax.process_count() == 1
    for u, v in zip(local(a), local(b)):
        if not (np.array_equal(u, v) if exact else np.allclose(u, v, rtol=1e-5, atol=1e-6)):
            raise AssertionError("jax.lax and jaxcomm.use_for_lax() train steps disagree")

    inputs = {"train step": lambda: (params, x, y), "pmean(grads)": lambda: (params,)}
    records = []
    for case in ("train step", "pmean(grads)"):
        times: dict[str, list[float]] = {"xla": [], "jaxcomm": []}
        for rep in range(args.reps):
            for side in (("xla", "jaxcomm") if rep % 2 == 0 else ("jaxcomm", "xla")):
                fn, args_ = programs[side][case], inputs[case]()
                jax.block_until_ready(fn(*args_))  # untimed: each block starts warm
                t0 = time.perf_counter()
                out = None
                for _ in range(args.steps):
                    out = fn(*args_)
                jax.block_until_ready(out)
                times[side].append((time.perf_counter() - t0) / args.steps)
        xla, ours = statistics.median(times["xla"]), statistics.median(times["jaxcomm"])
        records.append({"case": case, "xla_ms": xla * 1e3, "jaxcomm_ms": ours * 1e3, "ratio": xla / ours,
                        "xla_spread": (min(times["xla"]) * 1e3, max(times["xla"]) * 1e3),
                        "jaxcomm_spread": (min(times["jaxcomm"]) * 1e3, max(times["jaxcomm"]) * 1e3)})
    return records


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    launched = config.is_set("JAXCOMM_NUM_PROCESSES")  # by python -m jaxcomm.launch
    if not launched:
        common.set_host_device_count(args.devices)
    import jax
    import jaxcomm
    jaxcomm.init()
    before = _loadavg()
    records = run(args)
    if jax.process_index() == 0:
        grad_mib = args.layers * (args.width + 1) * args.width * 4 / (1 << 20)
        print(f"data-parallel step, jax.lax.pmean over {jax.device_count()} devices in "
              f"{jax.process_count()} process(es); MLP {args.layers}x{args.width}, "
              f"{2 * args.layers} gradient leaves, {grad_mib:.2f} MiB; batch {args.batch}/device; "
              f"median of {args.reps} blocks of {args.steps} steps")
        print(f"load average: {before} (start), {_loadavg()} (end)")
        print(f"| {'case':14s} | {'XLA ms':>8s} | {'jaxcomm ms':>10s} | {'XLA/jaxcomm':>11s} | "
              f"{'XLA min..max':>14s} | {'jaxcomm min..max':>16s} |")
        print(f"|{'-' * 16}|{'-' * 9}:|{'-' * 11}:|{'-' * 12}:|{'-' * 15}:|{'-' * 17}:|")
        for r in records:
            print(f"| {r['case']:14s} | {r['xla_ms']:8.3f} | {r['jaxcomm_ms']:10.3f} | {r['ratio']:10.2f}x | "
                  f"{r['xla_spread'][0]:6.2f}..{r['xla_spread'][1]:6.2f} | "
                  f"{r['jaxcomm_spread'][0]:7.2f}..{r['jaxcomm_spread'][1]:7.2f} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
