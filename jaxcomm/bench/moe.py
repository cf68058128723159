"""``python -m jaxcomm.bench moe``: MoE dispatch/combine, jaxcomm against a pure-JAX baseline.

The baseline is the capacity-padded lax.all_to_all design: every (token, slot) is copied into
a per-expert buffer of ``cap`` rows on the source (one copy per selected expert), exchanged
with all_to_all, and gathered back. jaxcomm (host backend) routes inside one collective call
and copies each kept assignment's token row once, straight from its source into the
receiver's expert rows; combine reads each expert row once from where it lies. Both use the
smallest capacity that drops nothing for the benchmark's routing. Bytes are counted as
DeepEP does: (token, destination rank) pairs x H x item size, for each direction (FP8: H
bytes plus 4 per 128 channels).

Rows, for each ``--dtype`` (each beside a baseline timed in the same run, alternating):

* dispatch, combine, dispatch+combine, and its forward+backward (``jax.grad``);
* low-latency dispatch+combine (``--modes low_latency``): DeepEP's static
  [E_local, R * T, H] layout, against the same baseline;
* FP8 dispatch+combine (``fp8``): tokens as float8_e4m3fn with float32 scales per 128
  channels, dequantized at the receiver, combine in the token dtype;
* overlap (``overlap``): a decode step, MoE with a shared expert (a dense GELU MLP of width
  ``--shared-ffn`` on every token, in float32) whose output is added to the MoE's, once
  with the fused calls and once with the shared expert's two matmuls computed between
  dispatch_send / dispatch_recv and between combine_send / combine_recv. The row gives the
  split step against the fused one (in the baseline column), the MoE's dispatch+combine
  and the shared expert each alone, and the time saved as a share of the shorter of the
  two (100%: the shorter one was hidden entirely).

With float32 and a half precision dtype in ``--dtype`` (and the normal mode), a last line
times the half precision combine against float32's, alternated in one run: 10 blocks of 4
calls a side whatever ``--iters`` says, with the quartiles of the blocks' ratios.

``faults/call`` is each side's minor page faults per call (jaxcomm/baseline): XLA:CPU
hands out its large results and temporaries as fresh memory, which the kernel zeroes as
they are first written, and at some sizes that is most of a side's time.

``local`` is a program with no communication that moves the same rows in every device at
once: a gather of the rank's own token rows into as many expert rows (dispatch) and their
weighted sum back (combine), in XLA. Every implementation moves at least these bytes; it
is a reference, not a bound.

The last row is one training step (loss, and gradients of router and expert weights) of an
MoE layer: softmax top-k router, the same per-expert GELU FFN (a batched einsum over
[E_local, rows, H] slabs) on both sides, built once on jaxcomm's dispatch/combine and once
on the baseline. jaxcomm's slabs are dispatch_padded's with the largest expert's row count as
capacity; the baseline's slabs are its all_to_all buffers, R*cap rows per expert. The FFN
width defaults to H/4.

The default (full-size) run peaks at about 10.5 GB of host memory; the low-latency rows at
T=128, H=7168, 256 experts hold R * 32 * 1024 * H rows (3.5 GiB in bfloat16).

Example::

    python -m jaxcomm.bench moe --tokens 4096 --hidden 1024 --topk 8 --experts 64 --devices 8
    python -m jaxcomm.bench moe --tokens 128 --hidden 7168 --topk 8 --experts 256 \\
        --dtype float32,bfloat16 --modes normal,low_latency,fp8,overlap --skip-layer
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from typing import Any, Callable, NamedTuple

from jaxcomm.bench import method
from jaxcomm.bench.common import set_host_device_count

MODES = ("normal", "low_latency", "fp8", "overlap")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxcomm.bench moe", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (T)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (H)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (K)")
    p.add_argument("--experts", type=int, default=64, help="experts in total (E)")
    p.add_argument("--devices", type=int, default=8, help="emulated CPU devices = EP ranks (R)")
    p.add_argument("--dtype", default="float32",
                   help="token dtypes, comma separated (float32, bfloat16, float16)")
    p.add_argument("--modes", default="normal",
                   help=f"rows to measure, comma separated: {', '.join(MODES)} (or all)")
    p.add_argument("--shared-ffn", type=int, default=128,
                   help="width of the overlap row's shared expert (sized so that, on a CPU, its matmuls take about as long as the MoE's communication)")
    p.add_argument("--ffn", type=int, default=None,
                   help="expert FFN width (F) of the layer step (default hidden // 4)")
    p.add_argument("--iters", type=int, default=5,
                   help="timed iterations of each side, in two alternating blocks (median reported)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed calls of each side before its timed ones (the first compiles; on the "
                        "development VM the first calls after start took up to 15x a later one)")
    p.add_argument("--skip-layer", action="store_true", help="leave out the MoE layer step")
    p.add_argument("--seed", type=int, default=0, help="seed of the routing and the data (default 0)")
    args = p.parse_args(argv)
    args.modes = MODES if args.modes == "all" else tuple(m.strip() for m in args.modes.split(","))
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    args.dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    return args


def _pair_blocks(jc: Callable[[], Any], base: Callable[[], Any], per_block: int,
                 rounds: int) -> list[tuple[list[float], list[float]]]:
    """Seconds of each call, per round: (jaxcomm's block, the baseline's block).

    Alternating blocks keep both sides under the same background load on a shared machine.
    Each block starts with an untimed call: the previous block's side leaves work behind
    (XLA frees gigabytes of buffers after a call returns, and the kernel's page state
    changes), which measured up to several times the next side's call when calls of the
    two sides were interleaved one by one.
    """
    import jax
    blocks = []
    for _ in range(rounds):
        block: tuple[list[float], list[float]] = ([], [])
        for fn, out in zip((jc, base), block):
            jax.block_until_ready(fn())  # compile / settle
            for _ in range(per_block):
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                out.append(time.perf_counter() - t0)
        blocks.append(block)
    return blocks


class _FaultCounter:
    """A call that counts the process's minor page faults while it runs to completion:
    results that come back from the allocator as fresh memory fault in every call, which
    can cost one side of a comparison more than the work it measures."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.calls, self.faults = fn, 0, 0

    def __call__(self) -> Any:
        import jax
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = jax.block_until_ready(self.fn())
        self.faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        self.calls += 1
        return out

    def per_call(self) -> float:
        return self.faults / max(self.calls, 1)


class _Pair(NamedTuple):
    """jaxcomm's and the baseline's median seconds a call, and each side's minor page
    faults per call (over its timed calls and each block's untimed first call; not over
    the warm-up calls)."""
    tj: float
    tb: float
    faults_j: float
    faults_b: float


def _warm(fn: Callable[[], Any], calls: int) -> None:
    """``calls`` untimed calls of ``fn`` (at least one, which compiles it)."""
    import jax
    for _ in range(max(1, calls)):
        jax.block_until_ready(fn())


def _time_pair(jc: Callable[[], Any], base: Callable[[], Any], iters: int, warmup: int,
               rounds: int = 2) -> _Pair:
    """Both sides over ``rounds`` alternating blocks of about ``iters / rounds`` calls each
    (_pair_blocks). The page faults are counted because XLA:CPU's large results come from
    glibc as fresh memory (docs/benchmarks.md, 2026-12-07 14:53): zeroing it is most of
    the baseline's time at decode size, and about half the dispatch's at the training
    size. ``warmup`` calls of each side come first, neither timed nor counted."""
    _warm(jc, warmup)
    _warm(base, warmup)
    fj, fb = _FaultCounter(jc), _FaultCounter(base)
    blocks = _pair_blocks(fj, fb, max(1, -(-iters // rounds)), rounds)
    return _Pair(statistics.median(t for b in blocks for t in b[0]),
                 statistics.median(t for b in blocks for t in b[1]), fj.per_call(), fb.per_call())


def _time_one(fn: Callable[[], Any], iters: int, warmup: int) -> float:
    import jax
    _warm(fn, warmup)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Row:
    """One table row: both sides' timing, the bytes moved, the local reference's seconds
    (or None) and a note."""

    def __init__(self, name: str, pair: _Pair, moved: float | None, local: float | None = None,
                 note: str = ""):
        self.name, self.pair, self.moved, self.local, self.note = name, pair, moved, local, note

    def format(self) -> str:
        tj, tb = self.pair.tj, self.pair.tb
        bw = lambda t: f"{self.moved / t / 1e9:>9.2f}" if self.moved and t else f"{'':>9}"  # noqa: E731
        local = f"{self.local * 1e3:>10.2f}" if self.local else f"{'':>10}"
        faults = f"{self.pair.faults_j:.0f}/{self.pair.faults_b:.0f}"
        return (f"{self.name:<34}{tj * 1e3:>12.2f}{bw(tj)}{tb * 1e3:>13.2f}{bw(tb)}{tb / tj:>8.2f}x"
                f"{local}{faults:>16}  {self.note}").rstrip()


HEADER = (f"{'op':<34}{'jaxcomm ms':>12}{'GB/s':>9}{'baseline ms':>13}{'GB/s':>9}{'speedup':>9}"
          f"{'local ms':>10}{'faults/call':>16}")


def main(argv: list[str]) -> None:
    """Runs the benchmark and prints one table per dtype (times in ms, GB/s, speedup =
    baseline / jaxcomm)."""
    args = _parse(list(argv))
    set_host_device_count(args.devices)
    import jax

    R, T, H, K, E = args.devices, args.tokens, args.hidden, args.topk, args.experts
    if E % R:
        raise SystemExit(f"--experts {E} must be divisible by --devices {R}")
    for dtype in args.dtypes:
        bench = _Bench(args, jax.numpy.dtype(dtype))
        rows = bench.run()
        print(f"MoE dispatch/combine: R={R} T={T} H={H} K={K} E={E} dtype={dtype}; "
              f"jaxcomm capacity C={bench.C}, baseline capacity {bench.cap} per (rank, expert); "
              f"{bench.pairs} (token, rank) pairs = {bench.nbytes / 2**20:.1f} MiB per direction "
              f"(DeepEP count; FP8: {bench.fp8_bytes / 2**20:.1f} MiB); load average "
              f"{method.load_average()}")
        print(HEADER)
        for row in rows:
            print(row.format())
        for note in bench.notes:
            print(note)
        del bench
    if "normal" in args.modes and "float32" in args.dtypes and len(args.dtypes) > 1:
        _print_combine_ratios(args)


#: Alternated blocks of the combine ratio line, and calls per side in each. The line is the
#: figure the half-precision combine's target is judged by, and on a shared 2-core machine
#: single blocks range over +-0.1 around the median: it takes 40 calls a side whatever
#: ``--iters`` says (at the training size, about 4 s).
RATIO_ROUNDS, RATIO_PER_BLOCK = 10, 4


def _print_combine_ratios(args: argparse.Namespace) -> None:
    """The half precision combine against float32's, alternated in one run, on the same
    routing and capacity (half the bytes: at best about 0.5x): the ratio of the medians,
    the lower and upper quartiles of the blocks' ratios, and each side's page faults per
    call (the page faults of results the allocator hands out fresh fall on the float32
    side at some sizes and not at others, and move the ratio by 0.05-0.1)."""
    import jax

    import jaxcomm
    combine = jax.jit(jaxcomm.moe.combine)
    calls = {}
    for d in args.dtypes:
        b = _Bench(args, jax.numpy.dtype(d))
        ex, _, handle = jax.jit(b.jc_disp)(b.xs, b.ids)
        calls[d] = (lambda e=ex, h=handle, w=b.ws: combine(e, h, w))
        _warm(calls[d], args.warmup)  # compiled and settled before anything is counted
    load = method.load_average()
    for d in args.dtypes:
        if d == "float32":
            continue
        half, f32 = _FaultCounter(calls[d]), _FaultCounter(calls["float32"])
        blocks = _pair_blocks(half, f32, RATIO_PER_BLOCK, RATIO_ROUNDS)
        th = statistics.median(t for b in blocks for t in b[0])
        tf = statistics.median(t for b in blocks for t in b[1])
        q1, _, q3 = statistics.quantiles([statistics.median(h) / statistics.median(f) for h, f in blocks], n=4)
        print(f"combine {d} vs float32, alternated in one run: {th * 1e3:.2f} ms vs {tf * 1e3:.2f} ms "
              f"= {th / tf:.2f}x (blocks {q1:.2f}-{q3:.2f}x, {RATIO_ROUNDS} of {RATIO_PER_BLOCK} calls a "
              f"side); page faults per call {half.per_call():.0f} vs {f32.per_call():.0f}; "
              f"load average {load}")


class _Bench:
    """The programs of one dtype's table and their timings."""

    def __init__(self, args: argparse.Namespace, dtype: Any):
        import jax
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P

        self.args, self.dtype = args, dtype
        R, T, H, K, E = args.devices, args.tokens, args.hidden, args.topk, args.experts
        self.R, self.T, self.H, self.K, self.E, self.El = R, T, H, K, E, E // R
        self.mesh = jax.make_mesh((R,), ("ep",), devices=jax.devices()[:R])
        self.spec = P("ep")
        sh = NamedSharding(self.mesh, self.spec)
        rng = np.random.default_rng(args.seed)
        ids = np.argsort(rng.random((R * T, E)), axis=1)[:, :K].astype(np.int32)  # distinct top-k
        w = rng.random((R * T, K)).astype(np.float32)
        x = rng.normal(size=(R * T, H)).astype(dtype)
        # Smallest no-drop capacities: jaxcomm's C (rows a rank receives), the baseline's rows
        # per (source rank, expert).
        self.C = int(np.bincount(ids.reshape(-1) // self.El, minlength=R).max())
        src = np.repeat(np.arange(R), T * K)
        self.cap = int(np.bincount(src * E + ids.reshape(-1), minlength=R * E).max())
        self.pairs = sum(len(set(row // self.El)) for row in ids)  # (token, destination rank) pairs
        self.nbytes = self.pairs * H * dtype.itemsize
        self.fp8_bytes = self.pairs * (H + 4 * -(-H // 128))
        self.xs, self.ids, self.ws = (jax.device_put(a, sh) for a in (x, ids, w))
        self.ct = jax.device_put(rng.normal(size=(R * T, H)).astype(dtype), sh)
        self.notes: list[str] = []

    def smap(self, f: Callable, n_in: int) -> Callable:
        import jax
        return jax.jit(jax.shard_map(f, mesh=self.mesh, in_specs=(self.spec,) * n_in, out_specs=self.spec))

    # -------------------------------------------------------------------- baseline
    def base_plan(self, ids, cap=None):
        import jax.numpy as jnp
        E, K, T = self.E, self.K, self.T
        cap = self.cap if cap is None else cap
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        counts = jnp.zeros((E,), jnp.int32).at[flat].add(1)
        first = jnp.cumsum(counts, dtype=jnp.int32) - counts
        ranked = jnp.arange(flat.shape[0], dtype=jnp.int32) - first[flat[order]]
        rank = jnp.zeros_like(flat).at[order].set(ranked)
        slot = jnp.where(rank < cap, flat * cap + rank, E * cap)  # [T*K]
        tok = jnp.arange(flat.shape[0], dtype=jnp.int32) // K
        inv = jnp.full((E * cap + 1,), T, jnp.int32).at[slot].set(tok)[:E * cap]
        return slot, inv

    def base_dispatch(self, x, ids):
        import jax
        import jax.numpy as jnp
        slot, inv = self.base_plan(ids)
        xp = jnp.concatenate([x, jnp.zeros((1, self.H), x.dtype)])
        buf = xp[inv].reshape(self.R, self.El * self.cap, self.H)  # one copy per (token, expert)
        return jax.lax.all_to_all(buf, "ep", 0, 0, tiled=True), slot

    def base_combine(self, ey, slot, w):
        import jax
        import jax.numpy as jnp
        back = jax.lax.all_to_all(ey, "ep", 0, 0, tiled=True).reshape(self.E * self.cap, self.H)
        back = jnp.concatenate([back, jnp.zeros((1, self.H), back.dtype)])
        rows = back[slot].reshape(self.T, self.K, self.H).astype(jnp.float32)
        return jnp.einsum("tk,tkh->th", w, rows).astype(ey.dtype)

    def base_layer(self, x, ids, w):
        buf, slot = self.base_dispatch(x, ids)
        return self.base_combine(buf, slot, w)

    # -------------------------------------------------------------------- local reference
    def local_rows(self, x, ids):
        """The rank's own token rows gathered into C expert rows, as if every expert were local."""
        import jax.numpy as jnp
        tok = jnp.argsort(ids.reshape(-1) // self.El, stable=True)[:self.C] // self.K
        return x[tok], tok

    def local_layer(self, x, ids, w):
        import jax
        import jax.numpy as jnp
        rows, tok = self.local_rows(x, ids)
        wr = w.reshape(-1)[:self.C, None]
        y = jax.ops.segment_sum(rows.astype(jnp.float32) * wr, tok, num_segments=self.T)
        return y.astype(x.dtype)

    # -------------------------------------------------------------------- jaxcomm
    def jc_layer(self, x, ids, w):
        import jaxcomm
        ex, _, h = jaxcomm.moe.dispatch(x, ids, num_experts=self.E, axis_name="ep", capacity=self.C)
        return jaxcomm.moe.combine(ex, h, w)

    def ll_layer(self, x, ids, w):
        import jaxcomm
        ex, _, h = jaxcomm.moe.dispatch_low_latency(x, ids, num_experts=self.E, axis_name="ep",
                                                    max_tokens=self.T)
        return jaxcomm.moe.combine_low_latency(ex, h, w)

    def fp8_layer(self, x, ids, w):
        import jaxcomm
        ex, _, h = jaxcomm.moe.dispatch(x, ids, num_experts=self.E, axis_name="ep", capacity=self.C,
                                        fp8="dequantize")
        return jaxcomm.moe.combine(ex, h, w)

    def grad_of(self, layer):
        import jax
        import jax.numpy as jnp

        def f(x, ids, w, ct):
            def loss(x, w):
                return jnp.sum(layer(x, ids, w).astype(jnp.float32) * ct.astype(jnp.float32))
            return jax.grad(loss, argnums=(0, 1))(x, w)
        return f

    # -------------------------------------------------------------------- rows
    def run(self) -> list[_Row]:
        import jax
        import numpy as np
        args, it, wu = self.args, self.args.iters, self.args.warmup
        xs, idss, ws, ct = self.xs, self.ids, self.ws, self.ct
        rows: list[_Row] = []
        bl = self.smap(self.base_layer, 3)
        loc = self.smap(self.local_layer, 3)
        t_local = _time_one(lambda: loc(xs, idss, ws), it, wu)
        if "normal" in args.modes:
            jd = self.smap(lambda x, ids: self.jc_disp(x, ids)[0], 2)
            bd = self.smap(lambda x, ids: self.base_dispatch(x, ids)[0], 2)
            pair = _time_pair(lambda: jd(xs, idss), lambda: bd(xs, idss), it, wu)
            t_ldisp = _time_one(self._local_dispatch(), it, wu)
            rows.append(_Row("dispatch", pair, self.nbytes, t_ldisp))
            # combine only: inputs prepared by a dispatch outside the timed region (global
            # view: the mesh comes from the arrays' sharding)
            ex, _, handle = jax.jit(self.jc_disp)(xs, idss)
            import jaxcomm
            jc_c = jax.jit(jaxcomm.moe.combine)
            buf, slot = self.smap(self.base_dispatch, 2)(xs, idss)
            bc = self.smap(self.base_combine, 3)
            pair = _time_pair(lambda: jc_c(ex, handle, ws), lambda: bc(buf, slot, ws), it, wu)
            rows.append(_Row("combine", pair, self.nbytes))
            del ex, handle, buf, slot
            jl = self.smap(self.jc_layer, 3)
            pair = _time_pair(lambda: jl(xs, idss, ws), lambda: bl(xs, idss, ws), it, wu)
            rows.append(_Row("dispatch+combine", pair, 2 * self.nbytes, t_local))
            jg, bg = self.smap(self.grad_of(self.jc_layer), 4), self.smap(self.grad_of(self.base_layer), 4)
            pair = _time_pair(lambda: jg(xs, idss, ws, ct), lambda: bg(xs, idss, ws, ct), it, wu)
            rows.append(_Row("dispatch+combine fwd+bwd", pair, 4 * self.nbytes))
            # correctness of the two sides against each other, once
            np.testing.assert_allclose(np.asarray(jl(xs, idss, ws), np.float32),
                                       np.asarray(bl(xs, idss, ws), np.float32), rtol=2e-2, atol=2e-2)
        if "low_latency" in args.modes:
            ll = self.smap(self.ll_layer, 3)
            np.testing.assert_allclose(np.asarray(ll(xs, idss, ws), np.float32),
                                       np.asarray(bl(xs, idss, ws), np.float32), rtol=2e-2, atol=2e-2)
            pair = _time_pair(lambda: ll(xs, idss, ws), lambda: bl(xs, idss, ws), it, wu)
            rows.append(_Row("low-latency dispatch+combine", pair, 2 * self.nbytes, t_local,
                             f"[E_local, R*T, H] = [{self.El}, {self.R * self.T}, {self.H}]"))
            del ll
        if "fp8" in args.modes and jax.numpy.issubdtype(self.dtype, jax.numpy.floating):
            f8 = self.smap(self.fp8_layer, 3)
            want = np.asarray(bl(xs, idss, ws), np.float32)
            err = np.abs(np.asarray(f8(xs, idss, ws), np.float32) - want).max() / max(np.abs(want).max(), 1e-30)
            pair = _time_pair(lambda: f8(xs, idss, ws), lambda: bl(xs, idss, ws), it, wu)
            rows.append(_Row("FP8 dispatch+combine", pair, self.nbytes + self.fp8_bytes, t_local,
                             f"max error {err:.3f} of max |y|"))
        if "overlap" in args.modes:
            rows.extend(self._overlap())
        if not args.skip_layer:
            rows.append(self._layer_step())
        return rows

    def jc_disp(self, x, ids):
        import jaxcomm
        return jaxcomm.moe.dispatch(x, ids, num_experts=self.E, axis_name="ep", capacity=self.C)

    def _local_dispatch(self) -> Callable[[], Any]:
        f = self.smap(lambda x, ids: self.local_rows(x, ids)[0], 2)
        return lambda: f(self.xs, self.ids)

    def _overlap(self) -> list[_Row]:
        """Decode step with a shared expert: fused calls against split ones."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P

        import jaxcomm
        H, F = self.H, self.args.shared_ffn
        k1, k2 = jax.random.split(jax.random.key(self.args.seed + 2))
        rep = NamedSharding(self.mesh, P())
        w1 = jax.device_put(jax.random.normal(k1, (H, F)) / np.sqrt(H), rep)
        w2 = jax.device_put(jax.random.normal(k2, (F, H)) / np.sqrt(F), rep)
        E, C = self.E, self.C
        f32 = jnp.float32

        # In float32: XLA:CPU's half precision matmuls are many times slower, and would make
        # the step all shared expert.
        def shared(x, w1, w2):
            return (jax.nn.gelu(x.astype(f32) @ w1) @ w2).astype(x.dtype)

        def fused_step(x, ids, w, w1, w2):
            ex, _, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name="ep", capacity=C)
            return jaxcomm.moe.combine(ex, h, w) + shared(x, w1, w2)

        def split_step(x, ids, w, w1, w2):
            pending = jaxcomm.moe.dispatch_send(x, ids, num_experts=E, axis_name="ep", capacity=C)
            h1 = jax.nn.gelu(x.astype(f32) @ w1)       # first half of the shared expert
            ex, _, h = jaxcomm.moe.dispatch_recv(pending)
            pending = jaxcomm.moe.combine_send(ex, h, w)
            s = (h1 @ w2).astype(x.dtype)              # second half
            return jaxcomm.moe.combine_recv(pending) + s

        spec = self.spec
        mk = lambda f: jax.jit(jax.shard_map(f, mesh=self.mesh, in_specs=(spec,) * 3 + (P(), P()),  # noqa: E731
                                             out_specs=spec))
        fs, ss = mk(fused_step), mk(split_step)
        sh_only = mk(lambda x, ids, w, w1, w2: shared(x, w1, w2))
        args = (self.xs, self.ids, self.ws, w1, w2)
        np.testing.assert_allclose(np.asarray(ss(*args), np.float32), np.asarray(fs(*args), np.float32),
                                   rtol=1e-6, atol=1e-6)
        pair = _time_pair(lambda: ss(*args), lambda: fs(*args), self.args.iters, self.args.warmup)
        t_split, t_fused = pair.tj, pair.tb
        jl = self.smap(self.jc_layer, 3)
        t_comm = _time_one(lambda: jl(self.xs, self.ids, self.ws), self.args.iters, self.args.warmup)
        t_shared = _time_one(lambda: sh_only(*args), self.args.iters, self.args.warmup)
        hidden = (t_fused - t_split) / min(t_comm, t_shared)
        return [_Row("overlap step: split vs fused", pair, None, None,
                     f"shared expert (F={F}) alone {t_shared * 1e3:.2f} ms, MoE alone {t_comm * 1e3:.2f} ms; "
                     f"saved {(t_fused - t_split) * 1e3:.2f} ms = {100 * hidden:.0f}% of the shorter "
                     f"(baseline column: fused calls)")]

    def _layer_step(self) -> _Row:
        """Times one MoE-layer training step on jaxcomm and on the baseline; checks they agree."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P

        import jaxcomm

        args, xs, mesh = self.args, self.xs, self.mesh
        R, T, H, K, E, El = self.R, self.T, self.H, self.K, self.E, self.El
        F = args.ffn or max(1, H // 4)
        f32 = jnp.float32
        k1, k2, k3, k4 = jax.random.split(jax.random.key(args.seed + 1), 4)
        rep, ep = NamedSharding(mesh, P()), NamedSharding(mesh, P("ep"))
        params = {
            "router": jax.device_put(jax.random.normal(k1, (H, E), f32) / np.sqrt(H), rep),
            "w_in": jax.device_put(jax.random.normal(k2, (E, H, F), f32) / np.sqrt(H), ep),
            "w_out": jax.device_put(jax.random.normal(k3, (E, F, H), f32) / np.sqrt(F), ep),
        }
        target = jax.device_put(jax.random.normal(k4, xs.shape, xs.dtype), ep)
        specs = {"router": P(), "w_in": P("ep"), "w_out": P("ep")}

        def route(x, router):
            probs = jax.nn.softmax(x.astype(f32) @ router, axis=-1)
            wts, ids = jax.lax.top_k(probs, K)
            return ids.astype(jnp.int32), wts

        def ffn(slabs, p):  # [El, N, H] -> [El, N, H], shared by both sides
            h = jax.nn.gelu(jnp.einsum("enh,ehf->enf", slabs, p["w_in"].astype(slabs.dtype)))
            return jnp.einsum("enf,efh->enh", h, p["w_out"].astype(slabs.dtype))

        # Static no-drop capacities for this routing (it does not change: the step is timed
        # on fixed parameters).
        ids = np.asarray(jax.jit(lambda x, r: route(x, r)[0])(xs, params["router"]))
        slab = int(np.bincount(ids.reshape(-1), minlength=E).max())
        src = np.repeat(np.arange(R), T * K)
        cap = int(np.bincount(src * E + ids.reshape(-1), minlength=R * E).max())

        def jc_layer(x, p):
            ids, wts = route(x, p["router"])
            ex, _, h = jaxcomm.moe.dispatch_padded(x, ids, num_experts=E, axis_name="ep", capacity=slab)
            return jaxcomm.moe.combine_padded(ffn(ex, p), h, wts)

        def base_layer(x, p):
            ids, wts = route(x, p["router"])
            slot, inv = self.base_plan(ids, cap)
            xp = jnp.concatenate([x, jnp.zeros((1, H), x.dtype)])
            buf = jax.lax.all_to_all(xp[inv].reshape(R, El * cap, H), "ep", 0, 0, tiled=True)
            slabs = buf.reshape(R, El, cap, H).transpose(1, 0, 2, 3).reshape(El, R * cap, H)
            ey = ffn(slabs, p).reshape(El, R, cap, H).transpose(1, 0, 2, 3).reshape(R, El * cap, H)
            back = jax.lax.all_to_all(ey, "ep", 0, 0, tiled=True).reshape(E * cap, H)
            back = jnp.concatenate([back, jnp.zeros((1, H), back.dtype)])
            rows = back[slot].reshape(T, K, H).astype(f32)
            return jnp.einsum("tk,tkh->th", wts, rows).astype(x.dtype)

        def step_of(layer):
            def local_loss(x, t, p):
                err = layer(x, p).astype(f32) - t.astype(f32)
                return jax.lax.psum(jnp.sum(err * err), "ep") / err.size / R
            loss = jax.shard_map(local_loss, mesh=mesh, in_specs=(P("ep"), P("ep"), specs),
                                 out_specs=P())
            return jax.jit(jax.value_and_grad(loss, argnums=2))

        js, bs = step_of(jc_layer), step_of(base_layer)
        (lj, gj), (lb, gb) = js(xs, target, params), bs(xs, target, params)
        np.testing.assert_allclose(float(lj), float(lb), rtol=1e-3)
        for k in params:
            np.testing.assert_allclose(np.asarray(gj[k]), np.asarray(gb[k]), rtol=2e-2, atol=2e-4,
                                       err_msg=f"layer gradient of {k}")
        pair = _time_pair(lambda: js(xs, target, params), lambda: bs(xs, target, params), args.iters,
                          args.warmup)
        return _Row("MoE layer train step", pair, None, None,
                    f"F={F}; jaxcomm slabs of {slab} rows per expert, baseline R*cap = {R * cap}")


if __name__ == "__main__":
    main(sys.argv[1:])
