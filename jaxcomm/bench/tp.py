"""``python -m jaxcomm.bench tp``: a tensor-parallel MLP block with jaxcomm.tp's collective
matmuls against the unfused and ring baselines, forward and forward+backward.

The block (per ``("dp", "tp")`` mesh rank; x rows split over tp, w_up columns, w_down rows)::

    y = matmul_reduce_scatter(gelu(all_gather_matmul(x, w_up, "tp")), w_down, "tp")

Sides, timed in alternating blocks in one run (median seconds per jitted step):
  tp       jaxcomm.tp (one-sided puts overlapping the chunk matmuls)
  lax      (a) jax.lax.all_gather then dot; dot then jax.lax.psum_scatter
  ring     (b) the shard_map docs' collective matmul: the same chunk ring over jax.lax.ppermute
           (bidirectional above 2 ranks)
  unfused  (c) jaxcomm.all_gather then dot; dot then jaxcomm.reduce_scatter
  compute  the tp side's chunk matmuls alone: the same ring with every block kept where it is
  comm     jaxcomm's all_gather and reduce_scatter alone (no matmul)
``hidden`` is the share of the communication the tp side hides: (compute + comm - tp) /
comm, clipped to [0, 1]. ``comm %`` is comm / (compute + comm): where it is below a third
the 1.3x target over (a) does not apply.

    python -m jaxcomm.bench tp                        # 8 devices in one process, tp = 2, 4, 8
    python -m jaxcomm.bench tp --processes 2          # 2 processes x 1 device, bound to cores
    python -m jaxcomm.bench tp --timeline tp.png      # also one step's timeline (profiler + recorder)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

SIDES = ("tp", "lax", "ring", "unfused", "compute", "comm")


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jaxcomm.bench tp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8, help="emulated CPU devices in one process (default 8)")
    ap.add_argument("--tp", default="2,4,8", help="tensor-parallel degrees (default 2,4,8; dp = devices / tp)")
    ap.add_argument("--tokens", type=int, default=2048, help="rows of x per tp group, training shape")
    ap.add_argument("--decode-tokens", type=int, default=8, help="rows of x per rank, decode shape (default 8)")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--d-ff", type=int, default=1024, help="MLP width over the whole tp group")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=4, help="alternating blocks per side (0: warm-up only)")
    ap.add_argument("--iters", type=int, default=5, help="timed steps per block")
    ap.add_argument("--processes", type=int, default=0, help="N processes x 1 device (jaxcomm.launch --bind cores)")
    ap.add_argument("--timeline", default="", help="write one tp step's timeline (PNG) here")
    ap.add_argument("--json", default="", help="write the rows as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.processes > 1 and not args.worker:
        cmd = [sys.executable, "-m", "jaxcomm.launch", "-n", str(args.processes), "-d", "1", "--bind", "cores",
               "-m", "jaxcomm.bench", "tp", *argv, "--worker"]
        return subprocess.run(cmd, check=False).returncode
    if args.worker:
        import jaxcomm
        jaxcomm.init()
    else:
        from jaxcomm.bench import common
        common.set_host_device_count(args.devices)
    import jax
    n = jax.device_count()
    tps = [n] if args.worker else [int(t) for t in args.tp.split(",") if n % int(t) == 0]
    rows = []
    for tp in tps:
        for shape, M in (("train", args.tokens), ("decode", args.decode_tokens * tp)):
            case = Case(tp, n // tp, M, args.d_model, args.d_ff, args.dtype)
            for mode in ("fwd", "fwd+bwd"):
                times = _alternate(case.sides(mode), args.rounds, args.iters)
                rows.append(dict(degree=tp, dp=n // tp, shape=shape, M=M, D=args.d_model, F=args.d_ff, mode=mode,
                                 dtype=args.dtype, processes=jax.process_count(), **times))
                if jax.process_index() == 0:
                    print(_format(rows[-1]), flush=True)
    if jax.process_index() == 0:
        print()
        print(table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    if args.timeline:
        case = Case(tps[len(tps) // 2], n // tps[len(tps) // 2], args.tokens, args.d_model, args.d_ff, args.dtype)
        timeline(case, args.timeline)
    return 0


class Case:
    """One shape on a (dp, tp) mesh: every side's jitted step and its operands."""

    def __init__(self, tp: int, dp: int, M: int, D: int, F: int, dtype: str):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P

        self.tp, self.M = tp, M
        self.mesh = jax.make_mesh((dp, tp), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
        rng = np.random.default_rng(0)
        dt = jnp.dtype(dtype)
        self.specs = (P(("dp", "tp")), P(None, "tp"), P("tp"))
        host = (rng.normal(size=(dp * M, D)), rng.normal(size=(D, F)) / np.sqrt(D), rng.normal(size=(F, D)) / np.sqrt(F))
        self.args = [jax.device_put(a.astype(dt), NamedSharding(self.mesh, s)) for a, s in zip(host, self.specs)]

    def blocks(self) -> dict[str, Callable[..., Any]]:
        """Each side's per-rank block, (x, w_up, w_down) -> y."""
        import jax
        import jax.numpy as jnp
        import jaxcomm
        from jaxcomm._src.tp import matmul
        tp = self.tp

        def ring(transport):
            def block(x, w1, w2):
                r = matmul.plan("bench", "tp", 0, x.shape[0], chunks=None, direction="bidirectional" if tp > 2
                                else "one_way", timeout_s=None, precision=None, transport=transport)
                return matmul.matmul_reduce_scatter_p(jax.nn.gelu(matmul.all_gather_matmul_p(x, w1, r)), w2, r)
            return block

        return {
            "tp": lambda x, w1, w2: jaxcomm.tp.matmul_reduce_scatter(
                jax.nn.gelu(jaxcomm.tp.all_gather_matmul(x, w1, "tp")), w2, "tp"),
            "lax": lambda x, w1, w2: jax.lax.psum_scatter(
                jax.nn.gelu(jax.lax.all_gather(x, "tp", tiled=True) @ w1) @ w2, "tp", tiled=True),
            "ring": ring("lax"),
            "unfused": lambda x, w1, w2: jaxcomm.reduce_scatter(
                jax.nn.gelu(jaxcomm.all_gather(x, "tp", tiled=True) @ w1) @ w2, "tp", tiled=True),
            "compute": ring("local"),
            "comm": lambda x, w1, w2: jaxcomm.reduce_scatter(jaxcomm.all_gather(x, "tp", tiled=True), "tp",
                                                             tiled=True),
        }

    def step(self, block: Callable[..., Any], mode: str) -> Callable[[], Any]:
        import jax
        from jax.sharding import PartitionSpec as P

        if mode == "fwd":
            body = block
            out_specs = P(("dp", "tp"))
        else:
            def body(x, w1, w2):
                loss = lambda x, w1, w2: (block(x, w1, w2).astype("float32") ** 2).sum()  # noqa: E731
                return jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)
            out_specs = self.specs
        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=self.specs, out_specs=out_specs, check_vma=False))
        return lambda: f(*self.args)

    def sides(self, mode: str) -> dict[str, Callable[[], Any]]:
        return {name: self.step(b, mode) for name, b in self.blocks().items()}


def _alternate(sides: dict[str, Callable[[], Any]], rounds: int, iters: int) -> dict[str, float]:
    """Median seconds per step of each side over ``rounds`` alternating blocks of ``iters``
    steps (each block after one untimed step), after two warm-up steps each."""
    import jax
    samples: dict[str, list[float]] = {k: [] for k in sides}
    for fn in sides.values():
        for _ in range(2):
            jax.block_until_ready(fn())
    for _ in range(rounds):
        for name, fn in sides.items():
            jax.block_until_ready(fn())
            for _ in range(iters):
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) if v else float("nan") for k, v in samples.items()}


def derived(r: dict[str, Any]) -> dict[str, float]:
    """Speedups of the tp side, the communication's share of the unfused step, and the
    share of it hidden."""
    parts = r["compute"] + r["comm"]
    return dict(vs_lax=r["lax"] / r["tp"], vs_ring=r["ring"] / r["tp"], vs_unfused=r["unfused"] / r["tp"],
                comm_share=r["comm"] / parts,
                hidden=min(max((parts - r["tp"]) / r["comm"], 0.0), 1.0) if r["comm"] else 0.0)


HEADER = (f"{'TP':>3} {'dp':>3} {'shape':<7}{'M':>6} {'mode':<8}" + "".join(f"{s:>9}" for s in SIDES)
          + f"{'vs lax':>8}{'vs ring':>8}{'vs unf':>8}{'comm %':>8}{'hidden':>8}")


def _format(r: dict[str, Any]) -> str:
    d = derived(r)
    return (f"{r['degree']:>3} {r['dp']:>3} {r['shape']:<7}{r['M']:>6} {r['mode']:<8}"
            + "".join(f"{r[s] * 1e3:>9.2f}" for s in SIDES)
            + f"{d['vs_lax']:>7.2f}x{d['vs_ring']:>7.2f}x{d['vs_unfused']:>7.2f}x{d['comm_share'] * 100:>7.0f}%"
            f"{d['hidden'] * 100:>7.0f}%")


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a text table (times in ms)."""
    return "\n".join([HEADER] + [_format(r) for r in rows])


def timeline(case: Case, path: str) -> None:
    """Plots one forward step of the tp side: XLA's thunks per device (jax.profiler's
    Perfetto trace) and the flight recorder's put rounds (enqueue to end), the recorder's
    clock aligned with the profiler's at the first put_start."""
    import gzip
    import glob
    import re
    import tempfile

    import jax
    import jaxcomm
    fn = case.step(case.blocks()["tp"], "fwd")
    for _ in range(3):
        jax.block_until_ready(fn())
    d = tempfile.mkdtemp(prefix="jaxcomm-tp-profile-")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        jax.block_until_ready(fn())
    snap = jaxcomm.trace.snapshot()
    (trace_file,) = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
    events = json.load(gzip.open(trace_file))
    events = events["traceEvents"] if isinstance(events, dict) else events
    # XLA's thunks, each named after its HLO instruction (jaxcomm_put_start.12, ynn_fusion.3, ...).
    thunks = [e for e in events if e.get("ph") == "X" and e.get("args", {}).get("hlo_op") == e.get("name")
              and "device_ordinal" in e["args"]]
    if not thunks:
        print("timeline: the profiler recorded no XLA thunks", file=sys.stderr)
        return
    puts = [e for e in snap["entries"] if e["op"] == "put_start" and e["end_us"]]
    starts = [e for e in thunks if e["name"].startswith("jaxcomm_put_start")]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t0 = min(e["ts"] for e in thunks)
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.45 * 2 * len(jax.local_devices())))
    def color(name: str) -> str:
        if name.startswith("jaxcomm_put_start"):
            return "tab:green"
        if name.startswith("jaxcomm_put_done"):
            return "tab:red"
        return "tab:blue" if re.search(r"dot|ynn|gemm|matmul|convolution", name) else "silver"
    for e in sorted(thunks, key=lambda e: color(e["name"]) != "silver"):  # the other thunks underneath
        dev = int(e["args"]["device_ordinal"])
        ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"], 1) / 1e3)], (2 * dev, 0.8), color=color(e["name"]))
    if puts and starts:
        # The recorder's clock (system time, us) against the profiler's: align this run's
        # last puts with the profiler's put_start thunks.
        recent = sorted(puts, key=lambda e: e["enqueue_us"])[-len(starts):]
        offset = min(e["enqueue_us"] for e in recent) - (min(e["ts"] for e in starts) - t0)
        for e in recent:
            ax.broken_barh([((e["enqueue_us"] - offset) / 1e3, max(e["end_us"] - e["enqueue_us"], 1) / 1e3)],
                           (2 * e["partition"] + 0.9, 0.6), color="tab:orange")
    ax.set_yticks([2 * i + 0.8 for i in range(len(jax.local_devices()))])
    ax.set_yticklabels([f"device {i}" for i in range(len(jax.local_devices()))])
    ax.set_xlabel("ms")
    ax.set_title(f"one jaxcomm.tp MLP forward step, tp={case.tp}, M={case.M}: XLA's thunks (matmuls blue, "
                 f"put_start green, put_done red, other grey),\nputs in flight (orange, flight recorder)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"timeline written to {path}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
