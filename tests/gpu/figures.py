"""The CUDA backend's figures on one GPU, each beside its baseline from the same run
(scripts/gpu_check.sh runs them; they are not tests).

    python tests/gpu/figures.py jit --json jit.json [--budget-s 120]
    python tests/gpu/figures.py mp --json mp.json [--processes 4] [--budget-s 120]

jit: through jax.jit on one GPU, all_reduce, all_gather, all_to_all and ppermute from 4 B
to 1 GiB, against jax.lax on the same data (values checked equal), and MoE
dispatch+combine (T=4096, H=7168, top-8, 256 experts, bf16, one rank) against the
composed transport with jax.lax.ragged_all_to_all (JAXCOMM_BACKEND=xla). Each program
runs its op n times in a loop whose trip count is an argument (one compile per program):
the per-call time is the n=1 time, the per-collective time the slope (t(n) - t(1)) /
(n - 1); sides alternate, medians of the rounds. On one rank, jax.lax's collectives are
copies or nothing (XLA removes them): the comparison is jaxcomm's custom-call cost.

mp: several processes sharing the GPU (multiprocess_check.py with JAXCOMM_MP_FIGURES=1):
dispatch+combine through jaxcomm's own kernels across processes (CUDA IPC), values
checked against NumPy, against a device-to-device copy in the same run.

Writes one JSON document (a list of rows), rewritten after every row, and prints a
table. Each row is measured in its own try: a row that fails becomes a row with its
"error" and the others go on. Stops starting new sizes when the budget is spent.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent

LATENCY = [4, 256, 4096, 65536]
BANDWIDTH = [1 << 20, 16 << 20, 256 << 20, 1 << 30]
OPS = ("all_reduce", "all_gather", "all_to_all", "ppermute")


def _loadavg() -> str:
    try:
        return open("/proc/loadavg").read().strip()
    except OSError:
        return "?"


def _programs(op: str, mesh: Any) -> tuple[Callable, Callable]:
    """(jaxcomm, jax.lax) programs f(x, n) applying `op` n times to x on axis "x"."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    pairs = {
        "all_reduce": (lambda v: jaxcomm.all_reduce(v, "x"), lambda v: jax.lax.psum(v, "x")),
        "all_gather": (lambda v: jaxcomm.all_gather(v, "x", tiled=True),
                       lambda v: jax.lax.all_gather(v, "x", tiled=True)),
        "all_to_all": (lambda v: jaxcomm.all_to_all(v, "x", 0, 0, tiled=True),
                       lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True)),
        "ppermute": (lambda v: jaxcomm.ppermute(v, "x", [(0, 0)]),
                     lambda v: jax.lax.ppermute(v, "x", [(0, 0)])),
    }

    def looped(f):
        def body(x, n):
            return jax.lax.fori_loop(0, n[0], lambda i, c: f(c), x)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"),
                                     check_vma=False))
    ours, theirs = pairs[op]
    return looped(ours), looped(theirs)


def _time(f: Callable, *args: Any, reps: int) -> float:
    import jax
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Rows:
    """The figure rows so far, written to `path` (a JSON list) after each one."""

    def __init__(self, path: str):
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._write()

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self._write()

    def measure(self, what: dict[str, Any], f: Callable[[], dict[str, Any]]) -> None:
        """Adds f()'s row, or `what` with the error f raised."""
        try:
            row = f()
        except Exception as e:  # noqa: BLE001 (a failing row must not lose the others)
            row = dict(what, error=f"{type(e).__name__}: {e}"[:2000], loadavg=_loadavg())
            print(f"{what}: FAILED {row['error'][:300]}", flush=True)
        self.add(row)

    def _write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.rows, f, indent=1)
        os.replace(tmp, self.path)


def jit_figures(rows: Rows, budget_s: float, platform: str = "gpu", sizes: list[int] = LATENCY + BANDWIDTH,
                moe: tuple[int, int, int, int] = (4096, 7168, 8, 256)) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    t_end = time.monotonic() + budget_s
    mesh = Mesh(np.array(jax.devices(platform)[:1]), ("x",))
    for nbytes in sizes:
        if time.monotonic() > t_end:
            break
        n = 50 if nbytes <= (1 << 20) else 5
        reps = 7 if nbytes <= (16 << 20) else 3
        x = jax.device_put(jnp.arange(max(1, nbytes // 4), dtype=jnp.float32), NamedSharding(mesh, P("x")))
        one = jnp.array([1], jnp.int32)
        many = jnp.array([n], jnp.int32)
        for op in OPS:
            rows.measure(dict(kind="jit one GPU", op=op, bytes=nbytes),
                         lambda op=op: _jit_row(op, mesh, x, one, many, n, reps, nbytes))
        del x
    if time.monotonic() < t_end:
        rows.measure(dict(kind="moe one rank"), lambda: moe_one_rank(*moe, platform=platform))


def _jit_row(op: str, mesh: Any, x: Any, one: Any, many: Any, n: int, reps: int, nbytes: int) -> dict[str, Any]:
    """One op at one size: jaxcomm's and jax.lax's programs, timed alternately."""
    ours, theirs = _programs(op, mesh)
    a, b = ours(x, one), theirs(x, one)  # compiles both; values checked here
    equal = bool(np.array_equal(np.asarray(a), np.asarray(b)))
    samples = {"ours": ([], []), "lax": ([], [])}
    for _ in range(3):  # alternate the sides
        for side, f in (("ours", ours), ("lax", theirs)):
            samples[side][0].append(_time(f, x, one, reps=reps))
            samples[side][1].append(_time(f, x, many, reps=reps))
    row: dict[str, Any] = dict(kind="jit one GPU", op=op, bytes=nbytes, loop=n, values_equal=equal)
    for side, (t1, tn) in samples.items():
        call, loop = statistics.median(t1), statistics.median(tn)
        per = max(loop - call, 0.0) / (n - 1)
        row[f"{side}_call_us"] = 1e6 * call
        row[f"{side}_per_collective_us"] = 1e6 * per
        row[f"{side}_GBps"] = nbytes / per / 1e9 if per > 0 else None
    row["loadavg"] = _loadavg()
    print(f"{op:11s} {nbytes:>11d} B  per call {row['ours_call_us']:9.1f} us (lax "
          f"{row['lax_call_us']:9.1f})  per collective {row['ours_per_collective_us']:9.2f} us "
          f"(lax {row['lax_per_collective_us']:9.2f})  equal={equal}", flush=True)
    return row


def moe_one_rank(T: int = 4096, H: int = 7168, K: int = 8, E: int = 256,
                 platform: str = "gpu") -> dict[str, Any]:
    """Dispatch+combine at one rank: the fused kernels against the composed transport with
    jax.lax.ragged_all_to_all, same data, values checked equal."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxcomm
    from jaxcomm._src import cuda_loopback

    mesh = Mesh(np.array(jax.devices(platform)[:1]), ("x",))
    ids = cuda_loopback.random_routing(1, T, K, E, seed=0)[0]
    rng = np.random.default_rng(1)
    x = rng.integers(-4, 4, size=(T, H)).astype(jnp.bfloat16)
    w = np.full((T, K), 1.0 / K, np.float32)

    def layer(x, ids, w):
        ex, _, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="x")
        return jaxcomm.moe.combine(ex, h, w)

    placed = [jax.device_put(a, NamedSharding(mesh, P("x"))) for a in (x, ids, w)]
    programs = {}
    for side, backend in (("ours", "auto"), ("lax_ragged", "xla")):
        os.environ["JAXCOMM_BACKEND"] = backend  # read when the program is traced
        f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x"), check_vma=False))
        programs[side] = f.lower(*placed).compile()  # traced now, under this backend
    os.environ.pop("JAXCOMM_BACKEND", None)
    outs = {side: np.asarray(f(*placed), np.float32) for side, f in programs.items()}
    times: dict[str, list[float]] = {side: [] for side in programs}
    for _ in range(3):
        for side, f in programs.items():
            times[side].append(_time(f, *placed, reps=5))
    # DeepEP's byte count: one token row per (token, destination rank) pair, each way.
    moved = 2 * T * H * 2
    row = dict(kind="moe one rank", T=T, H=H, K=K, E=E, dtype="bfloat16",
               values_close=bool(np.allclose(outs["ours"], outs["lax_ragged"], rtol=1e-2, atol=1e-2)),
               loadavg=_loadavg())
    for side, t in times.items():
        row[f"{side}_ms"] = 1e3 * statistics.median(t)
        row[f"{side}_GBps"] = moved / statistics.median(t) / 1e9
    print(f"moe one rank: ours {row['ours_ms']:.3f} ms ({row['ours_GBps']:.0f} GB/s), "
          f"composed with lax.ragged_all_to_all {row['lax_ragged_ms']:.3f} ms, close={row['values_close']}",
          flush=True)
    return row


def mp_figure(processes: int, budget_s: float, platform: str = "cuda",
              size: str = "4096,7168,8,256") -> dict[str, Any]:
    """The figure of multiprocess_check.py alone (JAXCOMM_MP_FIGURES=only): timed whether
    or not that job's checks pass (the tests stage runs those)."""
    sys.path.insert(0, str(HERE.parent))
    from mp_util import results, run_script
    env = {"JAX_PLATFORMS": f"{platform},cpu" if platform != "cpu" else "cpu",
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "XLA_PYTHON_CLIENT_MEM_FRACTION": str(round(0.8 / processes, 2)), "CUDA_VISIBLE_DEVICES": "0",
           "JAXCOMM_TESTS_DIR": str(HERE.parent), "JAXCOMM_MP_FIGURES": "only", "JAXCOMM_MP_FIGURE": size,
           "JAXCOMM_TIMEOUT_S": "60"}
    res = run_script((HERE / "multiprocess_check.py").read_text(), processes, env=env, timeout_s=budget_s)
    print(res.format()[-4000:], flush=True)
    found = results(res, tag="FIGURE")
    row = dict(kind=f"moe across {processes} processes on one GPU (CUDA IPC)", returncode=res.returncode,
               loadavg=_loadavg())
    row.update(found.get(0, {"missing": "rank 0 printed no FIGURE line"}))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("jit", "mp"))
    p.add_argument("--json", required=True)
    p.add_argument("--budget-s", type=float, default=120)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--platform", default="gpu", help="the device to run on (cpu: a dry run)")
    p.add_argument("--sizes", default=None, help="jit: comma-separated byte sizes (default: 4 B to 1 GiB)")
    p.add_argument("--moe", default="4096,7168,8,256", help="T,H,K,E of the MoE rows")
    a = p.parse_args(argv)
    print("loadavg", _loadavg(), flush=True)
    rows = Rows(a.json)
    if a.what == "jit":
        sizes = [int(v) for v in a.sizes.split(",")] if a.sizes else LATENCY + BANDWIDTH
        jit_figures(rows, a.budget_s, a.platform, sizes, tuple(int(v) for v in a.moe.split(",")))
    else:
        platform = "cuda" if a.platform == "gpu" else a.platform
        rows.measure(dict(kind="moe across processes", processes=a.processes),
                     lambda: mp_figure(a.processes, a.budget_s, platform, a.moe))
    # A row that failed, a job that failed, or a row without its figure fail the stage
    # (summary.json); the other rows are in the file all the same.
    bad = [r for r in rows.rows if "error" in r or r.get("returncode", 0) != 0 or "missing" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
