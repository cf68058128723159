"""Collective benchmark: jaxcomm against XLA's native collectives, nccl-tests style.

Run ``python -m jaxcomm.bench --help`` for the command line; call :func:`run` from Python.

Conventions (those of nccl-tests):

* **size** is the per-device message size in bytes: the buffer each device sends or
  receives in full. all_reduce, ppermute, broadcast: the operand (= result) size.
  all_gather: the *output* size (each device contributes size/n). reduce_scatter: the
  *input* size (each device keeps size/n). all_to_all: the input (= output) size, of
  which size/n goes to each peer. Where the op needs the element count to be a multiple
  of the device count n, the count is rounded down to one, as nccl-tests does; sizes
  that round to zero elements, or to a size already measured, are skipped.
* **algbw** = size / time; **busbw** = algbw * factor, with factor 2(n-1)/n for
  all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for ppermute
  (a ring shift by one) and broadcast (root 0). GB/s are 1e9 bytes per second.
* **ratio** = XLA time / jaxcomm time: above 1 means jaxcomm is faster.
* **local** (single calls only): the time of a program with no communication that reads
  the operand and writes a result of the collective's size, in every device at once, in
  the same run (all_reduce, all_to_all, ppermute, broadcast: ``x + x``; all_gather:
  ``x + x`` tiled n times; reduce_scatter: the sum of the operand's n blocks). Every
  implementation moves at least these bytes, so **xla/local** = XLA time / local time
  is the ratio an implementation as fast as XLA's own memory-bound loops would reach:
  where it is low, XLA's collective costs little more than its memory traffic. It is a
  reference, not a bound: jaxcomm writes large results with streaming stores, which
  XLA's loops do not, and can beat it.

The XLA side of each op: ``jax.lax.psum``, ``all_gather(tiled=True)``,
``psum_scatter(tiled=True)``, ``all_to_all(tiled=True)``, ``ppermute``, and for
broadcast ``psum(where(axis_index == root, x, 0))``.

How time is measured. Both sides are compiled as the same ``jit(shard_map(...))``
program except for the collective itself, and are timed interleaved in one process (the
order alternates every iteration so neither side always runs on a warmer cache).

* Sizes up to ``loop_threshold`` (64 KiB): latency. One program runs ``loop_count``
  (100) collectives in a ``lax.fori_loop`` whose carry is the previous collective's
  result (so XLA can neither hoist nor overlap them); the time per program call is
  divided by ``loop_count``. For ops whose result shape differs from the operand's, the
  carry is rebuilt with a static slice (all_gather) or a partial in-place update
  (reduce_scatter), identically on both sides.
* Larger sizes: one collective per program call, timed with ``block_until_ready``.
  By default out-of-place: the operand is a non-donated jit argument (an op whose result
  reused its operand's buffer would pay for XLA's copy of it; jaxcomm's all_reduce and
  broadcast do so only up to 64 KiB). ``inplace=True`` (``--inplace``) donates the
  operand of the shape-preserving ops instead, as nccl-tests' in-place runs, and gives
  each call a fresh one.

Each figure is the median over ``iters`` timed calls, after ``warmup`` untimed ones.
The first warmup results of the two sides are compared (``check=True``), so a wrong
jaxcomm result is reported rather than timed silently. The inputs are small integers,
so the comparison can be tight: exact for integer types, 1e-5 relative for 32/64-bit
floats, loose only for 16-bit floats (summation order shows there).

HugeTLB: glibc reads ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` only at process start, so
:func:`run` records the state of the running process, and the command line re-executes
itself for the setting it is not running under (``--hugetlb both``, the default).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxcomm
from jaxcomm.bench import common, report

#: Every op the benchmark knows, in its default order.
ALL_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                            "ppermute", "broadcast")
#: Sizes up to this many bytes are timed as a loop of collectives (latency mode).
LOOP_THRESHOLD = 64 << 10
#: Collectives per program call in latency mode.
LOOP_COUNT = 100
#: The mesh axis the benchmark's one-dimensional mesh is built over.
AXIS = "bench"
ROOT = 0

Collective = Callable[[jax.Array, int], jax.Array]


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One benchmarked op: its two implementations and its nccl-tests bookkeeping.

    Attributes:
      name: the jaxcomm function name.
      bus_factor: busbw / algbw for a group of n devices.
      whole_blocks: the element count must be a multiple of n (it is split into blocks).
      same_shape: the result has the operand's shape, so a donated operand can hold it.
      in_elems: operand elements per device from the count behind "size" and n.
      jaxcomm: ``f(x, n, timeout_s)`` with jaxcomm's collective, inside shard_map over
        :data:`AXIS` (``timeout_s`` None: jaxcomm's default deadline).
      xla: the same with XLA's native collective.
      feedback: the next loop carry from the carry and the collective's result; the same
        for both sides, so the two loop programs differ only in the collective.
      local: ``f(x, n)`` moving the collective's bytes without communication (the
        "local" reference of the module docstring).
    """

    name: str
    bus_factor: Callable[[int], float]
    whole_blocks: bool
    same_shape: bool
    in_elems: Callable[[int, int], int]
    jaxcomm: Callable[[jax.Array, int, float | None], jax.Array]
    xla: Collective
    feedback: Callable[[jax.Array, jax.Array], jax.Array]
    local: Collective


def _ring(n: int) -> list[tuple[int, int]]:
    """ppermute's pairs: a shift by one around the ring."""
    return [(i, (i + 1) % n) for i in range(n)]


def _xla_broadcast(x: jax.Array, n: int) -> jax.Array:
    # XLA has no broadcast collective; this is how one is written with jax.lax.
    is_root = jax.lax.axis_index(AXIS) == ROOT
    return jax.lax.psum(jnp.where(is_root, x, jnp.zeros_like(x)), AXIS)


def _same(carry: jax.Array, y: jax.Array) -> jax.Array:
    """Loop feedback for shape-preserving ops: the result is the next operand."""
    return y


def _head(carry: jax.Array, y: jax.Array) -> jax.Array:
    """Loop feedback for all_gather: the first operand-sized slice of the result."""
    # A static slice, not a dynamic slice at axis_index: XLA rewrites
    # dynamic-slice(all-gather(x), partition-id) into x, which would delete the collective.
    return y[: carry.shape[0]]


def _overwrite_head(carry: jax.Array, y: jax.Array) -> jax.Array:
    """Loop feedback for reduce_scatter: the carry with its head replaced by the result."""
    # In place: costs |y| bytes, not a fresh |carry|-sized buffer per iteration.
    return jax.lax.dynamic_update_slice(carry, y, (0,))


def _touch(x: jax.Array, n: int) -> jax.Array:
    """Local reference of the shape-preserving ops: reads x, writes a result of its size."""
    return x + x


def _touch_tiled(x: jax.Array, n: int) -> jax.Array:
    """Local reference of all_gather: reads x, writes a result n times its size."""
    return jnp.tile(x + x, n)


def _sum_blocks(x: jax.Array, n: int) -> jax.Array:
    """Local reference of reduce_scatter: reads x, writes the sum of its n blocks."""
    # Slices added one by one fuse into one loop; XLA:CPU's reduce over the leading axis
    # of (n, m) was 10-25x slower than this.
    blocks = x.reshape(n, -1)
    total = blocks[0]
    for k in range(1, n):
        total = total + blocks[k]
    return total


OPS: dict[str, OpSpec] = {spec.name: spec for spec in (
    OpSpec("all_reduce", lambda n: 2 * (n - 1) / n, False, True, lambda c, n: c,
           lambda x, n, t: jaxcomm.all_reduce(x, AXIS, timeout_s=t),
           lambda x, n: jax.lax.psum(x, AXIS), _same, _touch),
    OpSpec("all_gather", lambda n: (n - 1) / n, True, False, lambda c, n: c // n,
           lambda x, n, t: jaxcomm.all_gather(x, AXIS, tiled=True, timeout_s=t),
           lambda x, n: jax.lax.all_gather(x, AXIS, tiled=True), _head, _touch_tiled),
    OpSpec("reduce_scatter", lambda n: (n - 1) / n, True, False, lambda c, n: c,
           lambda x, n, t: jaxcomm.reduce_scatter(x, AXIS, tiled=True, timeout_s=t),
           lambda x, n: jax.lax.psum_scatter(x, AXIS, tiled=True), _overwrite_head,
           _sum_blocks),
    OpSpec("all_to_all", lambda n: (n - 1) / n, True, True, lambda c, n: c,
           lambda x, n, t: jaxcomm.all_to_all(x, AXIS, 0, 0, tiled=True, timeout_s=t),
           lambda x, n: jax.lax.all_to_all(x, AXIS, 0, 0, tiled=True), _same, _touch),
    OpSpec("ppermute", lambda n: 1.0, False, True, lambda c, n: c,
           lambda x, n, t: jaxcomm.ppermute(x, AXIS, _ring(n), timeout_s=t),
           lambda x, n: jax.lax.ppermute(x, AXIS, _ring(n)), _same, _touch),
    OpSpec("broadcast", lambda n: 1.0, False, True, lambda c, n: c,
           lambda x, n, t: jaxcomm.broadcast(x, AXIS, root=ROOT, timeout_s=t),
           _xla_broadcast, _same, _touch),
)}


# ------------------------------------------------------------------------------ programs

def _program(mesh: Mesh, collective: Collective, n: int, feedback: Callable | None,
             loop_count: int, donate: bool = False) -> Callable[[jax.Array], jax.Array]:
    """``jit(shard_map(...))`` running ``collective`` once, or ``loop_count`` times chained.

    check_vma is off because psum's result is typed invariant while the loop carry is
    varying; with it on, the loop would need a cast that only one side's types call for.
    ``donate`` gives the operand's buffer to the program (in-place runs).
    """
    if feedback is None:
        def local(x: jax.Array) -> jax.Array:
            return collective(x, n)
    else:
        def local(x: jax.Array) -> jax.Array:
            return jax.lax.fori_loop(0, loop_count,
                                     lambda _, c: feedback(c, collective(c, n)), x)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                                 check_vma=False), donate_argnums=(0,) if donate else ())


def _input_maker(mesh: Mesh, n: int, elems: int, dtype: np.dtype) -> Callable[[], jax.Array]:
    """A function returning a fresh operand: device k holds small integers shifted by k.

    Generated on the devices (no host copy of up to n x 64 MiB). Small integers (0..3)
    keep every sum of the timed loops exact in f32/f16/bf16, so the two sides must agree.
    """
    def gen() -> jax.Array:
        i = jnp.arange(n * elems, dtype=jnp.uint32)
        return ((i + i // max(elems, 1)) % 4).astype(dtype)
    return jax.jit(gen, out_shardings=NamedSharding(mesh, P(AXIS)))


def _tolerance(dtype: np.dtype, loop: bool) -> tuple[float, float] | None:
    """(rtol, atol) for comparing the two sides; None means exact."""
    if not jnp.issubdtype(dtype, jnp.inexact):
        return None
    if jnp.finfo(dtype).bits <= 16:
        # Repeated reductions round differently in each summation order.
        return (0.25, 1.0) if loop else (1e-2, 1e-2)
    return 1e-5, 1e-6


def _agree(a: jax.Array, b: jax.Array, tol: tuple[float, float] | None) -> bool:
    """Whether the two sides' results match, computed on the devices."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if tol is None:
        return bool(jax.jit(lambda a, b: jnp.all(a == b))(a, b))
    rtol, atol = tol
    return bool(jax.jit(lambda a, b: jnp.all(jnp.isclose(a, b, rtol=rtol, atol=atol,
                                                         equal_nan=True)))(a, b))


#: One timed call: when it was dispatched and when its result was ready, in seconds of
#: ``time.perf_counter()`` (CLOCK_MONOTONIC: one clock for every process of a machine).
Span = tuple[float, float]


def _time_call(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> Span:
    """When ``fn(x)`` was dispatched and when its result was ready."""
    jax.block_until_ready(x)  # a freshly made operand must not be timed with the call
    t0 = time.perf_counter()
    out = fn(x)
    jax.block_until_ready(out)
    t1 = time.perf_counter()
    del out  # free the output before the next call allocates its own
    return t0, t1


def _short(exc: BaseException, limit: int = 400) -> str:
    """An exception as one bounded line for a table footnote."""
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= limit else text[:limit] + " ..."


# ----------------------------------------------------------------------------------- run

def plan(ops: Sequence[str], sizes: Sequence[int], n: int, itemsize: int
         ) -> list[tuple[str, int, int]]:
    """The (op, bytes, count) cases to measure, nccl-tests rounding applied.

    ``count`` is the number of elements behind ``bytes`` (see the module docstring).
    Sizes that round to 0 elements or to an already planned size are dropped.
    """
    cases: list[tuple[str, int, int]] = []
    for op in ops:
        seen: set[int] = set()
        for size in sizes:
            count = size // itemsize
            if OPS[op].whole_blocks:
                count -= count % n
            if count <= 0 or count in seen:
                continue
            seen.add(count)
            cases.append((op, count * itemsize, count))
    return cases


def run(ops: Sequence[str] = ALL_OPS,
        sizes: Sequence[int] | str = "4B:64MiB",
        devices: int | None = None,
        dtype: str | np.dtype = "float32",
        iters: int = 20,
        warmup: int = 3,
        *,
        factor: int = 2,
        loop_threshold: int = LOOP_THRESHOLD,
        loop_count: int = LOOP_COUNT,
        timeout_s: float | None = None,
        check: bool = True,
        inplace: bool = False,
        progress: bool = False,
        title: str = "",
        sync: Sync | None = None) -> list[dict[str, Any]]:
    """Measures each op at each size, jaxcomm against XLA, in this process.

    Works in a process where jax is already initialised: it uses the first ``devices``
    devices of the default backend (all of them if None) and never re-executes itself.
    For emulated CPU devices, set ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
    before jax creates its backend.

    Args:
      ops: op names from :data:`ALL_OPS`.
      sizes: per-device message sizes in bytes, or a spec such as ``"4B:64MiB"``
        (expanded with ``factor``).
      devices: how many devices form the benchmark's one-axis mesh.
      dtype: element type of the messages.
      iters: timed calls per side and case (the median is reported).
      warmup: untimed calls per side and case, after compilation (at least one is
        always made: its result is the one checked).
      factor: growth factor between sizes when ``sizes`` is a range spec.
      loop_threshold: sizes up to this are timed as ``loop_count`` chained collectives.
      loop_count: collectives per program call in that latency mode.
      timeout_s: jaxcomm's rendezvous deadline (None: jaxcomm's default).
      check: compare the two sides' results once per case.
      inplace: donate the operand of one-call programs whose result has its shape
        (all_reduce, all_to_all, ppermute, broadcast), as nccl-tests' in-place runs do;
        each timed call then gets a freshly made operand (made outside the timing).
      progress: show a progress bar on stderr.
      title: label shown on the progress bar.
      sync: in a multi-process job, how the processes agree on failures and combine
        their timings (:class:`Sync`; see :mod:`jaxcomm.bench.multiprocess`). Every
        process must then call :func:`run` with the same arguments.

    Returns:
      One record per (op, size): ``op, bytes, count, dtype, devices, processes,
      hugetlb, mode``
      (``"loop"`` or ``"call"``), ``inplace`` (whether the operand was donated),
      ``jaxcomm_us, xla_us`` (median per collective),
      ``ratio`` (xla_us / jaxcomm_us), ``algbw_gbps, busbw_gbps`` (jaxcomm),
      ``xla_busbw_gbps``, ``match`` (None when unchecked or failed) and ``error`` (None,
      or what failed; the failed side's figures are then None).
    """
    if isinstance(sizes, str):
        sizes = common.parse_sizes(sizes, factor)
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}; choose from {', '.join(ALL_OPS)}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    dtype = np.dtype(jnp.dtype(dtype))
    if not jnp.issubdtype(dtype, jnp.number):
        raise ValueError(f"dtype must be numeric, got {dtype}")
    available = jax.devices()
    n = len(available) if devices is None else int(devices)
    if not 1 <= n <= len(available):
        raise RuntimeError(
            f"asked for {n} devices but the {jax.default_backend()} backend has "
            f"{len(available)}; for CPU set XLA_FLAGS=--xla_force_host_platform_device_count={n} "
            f"before jax initialises (the command line does this with --devices)")
    _warn_if_not_jaxcomm()
    mesh = Mesh(np.asarray(available[:n]), (AXIS,))
    hugetlb = common.hugetlb_enabled()
    cases = plan(ops, list(sizes), n, dtype.itemsize)
    records = []
    with common.ProgressDisplay(len(cases), title=title, enabled=progress) as bar:
        for op, nbytes, count in cases:
            bar.step(f"{op} {common.format_bytes(nbytes)}")
            rec = _measure(OPS[op], mesh, n, nbytes, count, dtype, iters, warmup,
                           loop_threshold, loop_count, timeout_s, check, inplace, sync)
            rec["hugetlb"] = hugetlb
            if rec["error"]:
                bar.note(f"{op} {common.format_bytes(nbytes)}: {rec['error']}")
            elif rec["match"] is False:
                bar.note(f"{op} {common.format_bytes(nbytes)}: jaxcomm's result differs "
                         f"from XLA's")
            records.append(rec)
    return records


def _warn_if_not_jaxcomm() -> None:
    """Says so on stderr when jaxcomm would lower to jax.lax (the comparison is moot)."""
    from jaxcomm._src import config, runtime
    if config.backend() == "xla" or (config.backend() == "auto"
                                     and jax.default_backend() not in runtime.PLATFORMS):
        print(f"warning: jaxcomm lowers to jax.lax here (JAXCOMM_BACKEND={config.backend()}, "
              f"platform {jax.default_backend()}): both sides measure XLA", file=sys.stderr)


class Sync:
    """How the processes of a multi-process benchmark stay in step (see :func:`run`).

    A single process needs none of it: these defaults keep its own view.
    """

    def agree(self, failures: dict[str, str]) -> dict[str, str]:
        """All processes' failures per side ("jaxcomm"/"xla" -> message), merged.

        A side that failed anywhere is dropped everywhere, so no process waits in a
        collective that another one skips.
        """
        return failures

    def combine(self, samples: dict[str, list[Span]], errors: list[str]
                ) -> tuple[dict[str, list[float]], list[str]]:
        """All processes' timed calls merged into one series of seconds per side, and
        their errors."""
        return {side: [t1 - t0 for t0, t1 in spans] for side, spans in samples.items()}, errors


def _measure(spec: OpSpec, mesh: Mesh, n: int, nbytes: int, count: int, dtype: np.dtype,
             iters: int, warmup: int, loop_threshold: int, loop_count: int,
             timeout_s: float | None, check: bool, inplace: bool,
             sync: Sync | None = None) -> dict[str, Any]:
    """Compiles, checks and times one case on both sides; returns its record."""
    loop = nbytes <= loop_threshold
    # A loop's carry is updated in place anyway; donation matters for one-call programs.
    donate = inplace and spec.same_shape and not loop

    def jc_collective(x: jax.Array, n: int) -> jax.Array:
        return spec.jaxcomm(x, n, timeout_s)
    feedback = spec.feedback if loop else None
    sync = sync or Sync()
    rec: dict[str, Any] = dict(op=spec.name, bytes=nbytes, count=count, dtype=dtype.name,
                               devices=n, processes=jax.process_count(), hugetlb=None,
                               mode="loop" if loop else "call",
                               inplace=donate,
                               jaxcomm_us=None, xla_us=None, ratio=None, algbw_gbps=None,
                               busbw_gbps=None, xla_busbw_gbps=None, local_us=None,
                               xla_vs_local=None, match=None, error=None)
    errors: list[str] = []
    make_input = _input_maker(mesh, n, spec.in_elems(count, n), dtype)
    x = make_input()
    # A donated operand is consumed by the call: each call then gets a fresh one.
    operand: Callable[[], jax.Array] = make_input if donate else (lambda: x)
    sides: dict[str, Callable[[jax.Array], jax.Array]] = {}
    first_out: dict[str, jax.Array] = {}
    failures: dict[str, str] = {}
    # Compile both sides, agree, then run: in a multi-process job a side that failed to
    # compile in one process must not be run by the others (they would wait for it).
    programs: list[tuple[str, Collective]] = [("jaxcomm", jc_collective), ("xla", spec.xla)]
    if not loop:
        programs.append(("local", spec.local))
    for side, collective in programs:
        try:
            sides[side] = _program(mesh, collective, n, feedback, loop_count,
                                   donate).lower(x).compile()
        except Exception as exc:  # a failing side is reported, the other still measured
            failures[side] = _short(exc)
    failures = sync.agree(failures)
    for side in list(sides):
        if side in failures:
            del sides[side]
            continue
        try:
            first_out[side] = jax.block_until_ready(sides[side](operand()))
        except Exception as exc:
            failures[side] = _short(exc)
    failures = sync.agree(failures)
    for side, message in failures.items():
        sides.pop(side, None)
        first_out.pop(side, None)
        errors.append(f"{side}: {message}")
    if check and "jaxcomm" in first_out and "xla" in first_out:
        rec["match"] = _agree(first_out["jaxcomm"], first_out["xla"], _tolerance(dtype, loop))
    first_out.clear()
    samples: dict[str, list[Span]] = {side: [] for side in sides}
    try:
        for i in range(max(warmup - 1, 0) + iters):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for side in order:
                span = _time_call(sides[side], operand())
                if i >= warmup - 1:
                    samples[side].append(span)
    except Exception as exc:
        errors.append(f"while timing: {_short(exc)}")
        samples = {}
    samples, errors = sync.combine(samples, errors)
    per = loop_count if loop else 1
    med = {side: statistics.median(s) / per for side, s in samples.items() if s}
    factor = spec.bus_factor(n)
    if "jaxcomm" in med:
        rec["jaxcomm_us"] = med["jaxcomm"] * 1e6
        rec["algbw_gbps"] = nbytes / med["jaxcomm"] / 1e9
        rec["busbw_gbps"] = rec["algbw_gbps"] * factor
    if "xla" in med:
        rec["xla_us"] = med["xla"] * 1e6
        rec["xla_busbw_gbps"] = nbytes / med["xla"] / 1e9 * factor
    if "jaxcomm" in med and "xla" in med:
        rec["ratio"] = med["xla"] / med["jaxcomm"]
    if "local" in med:
        rec["local_us"] = med["local"] * 1e6
        if "xla" in med:
            rec["xla_vs_local"] = med["xla"] / med["local"]
    rec["error"] = "; ".join(errors) or None
    return rec


# ---------------------------------------------------------------------------------- CLI

def build_parser(prog: str = "python -m jaxcomm.bench") -> argparse.ArgumentParser:
    """The collective benchmark's command line."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Times jaxcomm's collectives against XLA's native ones, side by side "
                    "in one process, in the manner of nccl-tests.",
        epilog="Other subcommands: 'python -m jaxcomm.bench moe --help'. Sizes are "
               "per-device bytes (all_gather: output; reduce_scatter: input). Sizes up to "
               f"{common.format_bytes(LOOP_THRESHOLD)} are timed as {LOOP_COUNT} chained "
               "collectives in one program (latency); larger ones one per call.")
    p.add_argument("--ops", default=",".join(ALL_OPS),
                   help="comma list of ops (default: all: %(default)s)")
    p.add_argument("--sizes", default="4B:64MiB",
                   help="START:END (multiplied by --factor), one size, or a comma list; "
                        "units B, KiB, MiB, GiB (binary; K/KB/M/MB too) (default %(default)s)")
    p.add_argument("--factor", type=int, default=2, help="size growth factor (default 2)")
    p.add_argument("--devices", type=int, default=8,
                   help="emulated CPU devices, via XLA_FLAGS (default %(default)s)")
    p.add_argument("--dtype", default="float32", help="element type (default %(default)s)")
    p.add_argument("--iters", type=int, default=20,
                   help="timed calls per side and size; the median is reported "
                        "(default %(default)s)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed calls per side and size (default %(default)s)")
    p.add_argument("--hugetlb", choices=("off", "on", "both"), default="both",
                   help="run with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 off, on, or both; "
                        "the setting this process was not started with runs in a child "
                        "process (default %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write the records as a JSON list")
    p.add_argument("--plot", metavar="FILE.png",
                   help="plot bus bandwidth against size (needs matplotlib)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="jaxcomm rendezvous deadline (default: JAXCOMM_TIMEOUT_S or 300)")
    p.add_argument("--inplace", action="store_true",
                   help="donate the operand of one-call programs (sizes above the loop "
                        "threshold) of all_reduce, all_to_all, ppermute and broadcast, so "
                        "the result may reuse its buffer (nccl-tests' in-place); default: "
                        "out-of-place")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="do not compare jaxcomm's results with XLA's")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress display")
    # Set by the parent when it re-executes itself for the other HugeTLB setting.
    p.add_argument("--emit-json", metavar="FILE", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m jaxcomm.bench [options]``; returns the exit status.

    Must run before the process creates a JAX backend (``--devices`` sets XLA_FLAGS).
    Exit status 1 when some case failed or jaxcomm disagreed with XLA.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        parser.error(f"--ops: unknown op(s) {bad}; choose from {','.join(ALL_OPS)}")
    try:
        common.parse_sizes(args.sizes, args.factor)
        jnp.dtype(args.dtype)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (fail now, not after the whole run)
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib)")
    common.set_host_device_count(args.devices)

    settings = {"off": [False], "on": [True], "both": [False, True]}[args.hugetlb]
    current = common.hugetlb_enabled()
    if args.emit_json:
        if settings != [current]:
            parser.error("--emit-json runs one HugeTLB setting: the process's own")
        records = _run_here(args, ops)
        report.write_json(records, args.emit_json)
        return 0

    report.print_header(_environment(args))
    all_records: list[dict[str, Any]] = []
    failed_children = False
    for setting in settings:
        if setting == current:
            records = _run_here(args, ops)
        else:
            records = _run_child(args, setting)
            failed_children |= records is None
            records = records or []
        report.print_tables(records)
        all_records.extend(records)
    bad_records = report.finish(all_records, args.json, args.plot)
    return 1 if bad_records or failed_children else 0


def _run_here(args: argparse.Namespace, ops: list[str]) -> list[dict[str, Any]]:
    hugetlb = "on" if common.hugetlb_enabled() else "off"
    return run(ops, common.parse_sizes(args.sizes, args.factor), args.devices, args.dtype,
               args.iters, args.warmup, timeout_s=args.timeout, check=args.check,
               inplace=args.inplace,
               progress=args.progress, title=f"hugetlb={hugetlb}")


def _run_child(args: argparse.Namespace, hugetlb: bool) -> list[dict[str, Any]] | None:
    """Re-executes the benchmark with malloc's huge pages ``hugetlb``; its records or None."""
    fd, path = tempfile.mkstemp(prefix="jaxcomm-bench-", suffix=".json")
    os.close(fd)
    try:
        child_args = ["--ops", args.ops, "--sizes", args.sizes, "--factor", str(args.factor),
                      "--devices", str(args.devices), "--dtype", args.dtype,
                      "--iters", str(args.iters), "--warmup", str(args.warmup),
                      "--hugetlb", "on" if hugetlb else "off", "--emit-json", path]
        if args.timeout is not None:
            child_args += ["--timeout", str(args.timeout)]
        if not args.check:
            child_args.append("--no-check")
        if args.inplace:
            child_args.append("--inplace")
        if not args.progress:
            child_args.append("--no-progress")
        rc = common.run_module_child(child_args, common.hugetlb_env(hugetlb))
        try:
            with open(path) as f:
                records = json.load(f)
        except (OSError, ValueError):
            records = None
        if rc != 0 or not records:
            print(f"error: the hugetlb={'on' if hugetlb else 'off'} run (a child process) "
                  f"exited with status {rc} and no results", file=sys.stderr)
            return None
        return records
    finally:
        os.unlink(path)


def _environment(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "jax": jax.__version__,
        "jaxcomm": jaxcomm.__version__,
        "backend": jax.default_backend(),
        "devices": args.devices,
        "dtype": args.dtype,
        "iters": args.iters,
        "warmup": args.warmup,
        "cpus": os.cpu_count(),
        "hugetlb": args.hugetlb,
        "inplace": args.inplace,
        "THP": common.transparent_hugepage_mode(),
    }
