"""The flight recorder's cost: 4-byte all_reduce latency and 16 MiB all_reduce time with
recording on and off, interleaved in one process (``python -m jaxcomm.trace overhead``).

Import only after XLA_FLAGS holds the device count (``__main__`` sets it).
"""

from __future__ import annotations

import statistics
import time
from typing import Any


def measure(*, rounds: int = 15, loop: int = 100, big_bytes: int = 16 << 20,
            big_iters: int = 5) -> dict[str, Any]:
    """Medians over ``rounds`` alternating on/off measurements.

    Latency: one program runs ``loop`` 4-byte all_reduces in a ``fori_loop``; the time per
    program call divided by ``loop``. Throughput: one ``big_bytes`` all_reduce per
    program call. Returns microseconds per call for each, and the on/off ratios.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxcomm
    from jaxcomm import trace

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",))

    def smap(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                     check_vma=False))

    small = smap(lambda v: lax.fori_loop(0, loop, lambda i, c: jaxcomm.all_reduce(c, "x") * 0.5, v))
    big = smap(lambda v: jaxcomm.all_reduce(v, "x"))
    xs = jax.device_put(jnp.ones((n, 1), jnp.float32), NamedSharding(mesh, P("x")))
    xb = jax.device_put(jnp.ones((n, big_bytes // 4), jnp.float32), NamedSharding(mesh, P("x")))
    jax.block_until_ready(small(xs))
    jax.block_until_ready(big(xb))

    def time_small() -> float:
        t = time.perf_counter()
        jax.block_until_ready(small(xs))
        return (time.perf_counter() - t) / loop * 1e6

    def time_big() -> float:
        best = []
        for _ in range(big_iters):
            t = time.perf_counter()
            jax.block_until_ready(big(xb))
            best.append((time.perf_counter() - t) * 1e6)
        return statistics.median(best)

    was = trace.enabled()
    res: dict[str, list[float]] = {"small_on": [], "small_off": [], "big_on": [], "big_off": []}
    try:
        for i in range(rounds):
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                trace.set_enabled(on)
                tag = "on" if on else "off"
                res[f"small_{tag}"].append(time_small())
                res[f"big_{tag}"].append(time_big())
    finally:
        trace.set_enabled(was)
    med = {k: statistics.median(v) for k, v in res.items()}
    # Each round measures on and off back to back: the median of those paired ratios
    # cancels most of a shared machine's drifting load.
    paired = {size: statistics.median(a / b for a, b in zip(res[f"{size}_on"], res[f"{size}_off"]))
              for size in ("small", "big")}
    from jaxcomm import _jaxcomm

    cost_ns = min(_jaxcomm.trace_round_cost_ns(n, 20000) for _ in range(5))
    return dict(devices=n, rounds=rounds, round_cost_ns=cost_ns,
                **{f"{k}_us": v for k, v in med.items()},
                small_ratio=paired["small"], big_ratio=paired["big"])


def report(r: dict[str, Any]) -> str:
    return "\n".join([
        f"flight recorder overhead, all_reduce over {r['devices']} devices, on vs off interleaved, "
        f"{r['rounds']} rounds (medians; ratio: median of the paired on/off ratios):",
        f"  4 B latency:    on {r['small_on_us']:.1f} us, off {r['small_off_us']:.1f} us, "
        f"ratio {r['small_ratio']:.3f}",
        f"  16 MiB time:    on {r['big_on_us'] / 1e3:.2f} ms, off {r['big_off_us'] / 1e3:.2f} ms, "
        f"ratio {r['big_ratio']:.3f}",
        f"  recorder CPU per {r['devices']}-rank round (all hooks, one thread): "
        f"{r['round_cost_ns'] / 1e3:.2f} us = {r['round_cost_ns'] / 1e3 / r['small_off_us'] * 100:.1f}% "
        f"of the 4 B all_reduce time off",
    ])
