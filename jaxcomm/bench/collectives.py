"""Collective benchmark in one process: jaxcomm against XLA's own collectives.

Run ``python -m jaxcomm.bench --help`` for the command line; call :func:`run` from Python.
With ``--processes N`` the same command runs across processes instead
(:mod:`jaxcomm.bench.multiprocess`); both measure by the method of
:mod:`jaxcomm.bench.method` and print the tables of :mod:`jaxcomm.bench.report`.

Conventions (those of nccl-tests):

* **size** is the per-device message size in bytes: the buffer each device sends or
  receives in full. all_reduce, ppermute, broadcast: the operand (= result) size.
  all_gather: the *output* size (each device contributes size/n). reduce_scatter: the
  *input* size (each device keeps size/n). all_to_all: the input (= output) size, of
  which size/n goes to each peer. Where the op needs the element count to be a multiple
  of the device count n, the count is rounded down to one, as nccl-tests does; a size
  below one element per device is rounded up to it (the smallest size the op has), and a
  size that rounds to one already measured is measured once. Each such change is said on
  stderr before the run (:func:`plan`'s notes).
* **ratio** = peer's time / jaxcomm's time: above 1 means jaxcomm is faster.

The sides, all in ``jit(shard_map(...))`` over a one-axis mesh of the devices, each a
``lax.fori_loop`` of n steps whose carry is the previous step's result:

* ``jaxcomm``: jaxcomm's collective;
* ``xla``: ``jax.lax``'s (``psum``, ``all_gather(tiled=True)``, ``psum_scatter(tiled=True)``,
  ``all_to_all(tiled=True)``, ``ppermute``, and for broadcast
  ``psum(where(axis_index == root, x, 0))``): XLA:CPU's in-process collectives;
* ``plain``: an elementwise op of the operand's shape in place of the collective, the
  fixed cost of a plain jit to compare jaxcomm's with.

Each step feeds the collective's result back as the next operand, identically on every
side (all_reduce scaled by 1/n, so 1000 sums stay finite; all_gather sliced back to the
operand's size; reduce_scatter written into the carry), so XLA can neither hoist nor
overlap the collectives. The inputs are small integers, so the results of the sides can
be compared tightly: exact for integer types, 1e-5 relative for 32/64-bit floats, loose
only for 16-bit floats (summation order shows there).

HugeTLB: glibc reads ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` only at process start, so
:func:`run` records the state of the running process, and the command line re-executes
itself for a setting it is not running under (``--hugetlb on|both``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from typing import Any, Callable, Sequence

from jaxcomm.bench import common, measure, method, options, report
from jaxcomm.bench.options import ALL_OPS

#: The mesh axis the benchmark's one-dimensional mesh is built over.
AXIS = "bench"
ROOT = 0


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One benchmarked op: its implementations and its loop step.

    Attributes:
      name: the jaxcomm function name.
      whole_blocks: the element count must be a multiple of n (it is split into blocks).
      in_elems: operand elements per device from the count behind "size" and n.
      jaxcomm: ``f(x, n, timeout_s)`` with jaxcomm's collective, inside shard_map over
        :data:`AXIS` (``timeout_s`` None: jaxcomm's default deadline).
      xla: ``f(x, n)`` with ``jax.lax``'s collective (XLA's own, or gloo across processes).
      feedback: ``f(carry, result, n)``, the next loop carry; the same for every side, so
        the sides' loops differ only in the collective.
    """

    name: str
    whole_blocks: bool
    in_elems: Callable[[int, int], int]
    jaxcomm: Callable[[Any, int, float | None], Any]
    xla: Callable[[Any, int], Any]
    feedback: Callable[[Any, Any, int], Any]


def _ring(n: int) -> list[tuple[int, int]]:
    """ppermute's pairs: a shift by one around the ring."""
    return [(i, (i + 1) % n) for i in range(n)]


def _xla_broadcast(x: Any, n: int) -> Any:
    import jax
    import jax.numpy as jnp
    # XLA has no broadcast collective; this is how one is written with jax.lax.
    is_root = jax.lax.axis_index(AXIS) == ROOT
    return jax.lax.psum(jnp.where(is_root, x, jnp.zeros_like(x)), AXIS)


def _mean(carry: Any, y: Any, n: int) -> Any:
    """all_reduce's loop step: the sum scaled by 1/n (exact for n a power of two)."""
    return y * (1.0 / n)


def _same(carry: Any, y: Any, n: int) -> Any:
    """Loop step of shape-preserving ops: the result is the next operand."""
    return y


def _head(carry: Any, y: Any, n: int) -> Any:
    """all_gather's loop step: the first operand-sized slice of the result."""
    # A static slice, not a dynamic slice at axis_index: XLA rewrites
    # dynamic-slice(all-gather(x), partition-id) into x, which would delete the collective.
    return y[: carry.shape[0]]


def _overwrite_head(carry: Any, y: Any, n: int) -> Any:
    """reduce_scatter's loop step: the carry with its head replaced by the result."""
    import jax
    # In place: costs |y| bytes, not a fresh |carry|-sized buffer per iteration.
    return jax.lax.dynamic_update_slice(carry, y, (0,))


def _jaxcomm_op(name: str, **kwargs: Any) -> Callable[[Any, int, float | None], Any]:
    def call(x: Any, n: int, timeout_s: float | None) -> Any:
        import jaxcomm
        fn = getattr(jaxcomm, name)
        if name == "ppermute":
            return fn(x, AXIS, _ring(n), timeout_s=timeout_s)
        return fn(x, AXIS, timeout_s=timeout_s, **kwargs)
    return call


def _lax_op(name: str, **kwargs: Any) -> Callable[[Any, int], Any]:
    def call(x: Any, n: int) -> Any:
        import jax
        if name == "ppermute":
            return jax.lax.ppermute(x, AXIS, _ring(n))
        return getattr(jax.lax, name)(x, AXIS, **kwargs)
    return call


OPS: dict[str, OpSpec] = {spec.name: spec for spec in (
    OpSpec("all_reduce", False, lambda c, n: c, _jaxcomm_op("all_reduce"), _lax_op("psum"), _mean),
    OpSpec("all_gather", True, lambda c, n: c // n, _jaxcomm_op("all_gather", tiled=True),
           _lax_op("all_gather", tiled=True), _head),
    OpSpec("reduce_scatter", True, lambda c, n: c, _jaxcomm_op("reduce_scatter", tiled=True),
           _lax_op("psum_scatter", tiled=True), _overwrite_head),
    OpSpec("all_to_all", True, lambda c, n: c,
           _jaxcomm_op("all_to_all", split_axis=0, concat_axis=0, tiled=True),
           _lax_op("all_to_all", split_axis=0, concat_axis=0, tiled=True), _same),
    OpSpec("ppermute", False, lambda c, n: c, _jaxcomm_op("ppermute"), _lax_op("ppermute"), _same),
    OpSpec("broadcast", False, lambda c, n: c, _jaxcomm_op("broadcast", root=ROOT),
           _xla_broadcast, _same),
)}


def plain_step(x: Any, n: int) -> Any:
    """The plain side's step: an elementwise op of the operand's shape (bounded values)."""
    return x * 0.5 + 0.25


# ------------------------------------------------------------------------------ programs

def loop_body(op: str, collective: Callable[[Any, int], Any], n: int) -> Callable[[Any, Any], Any]:
    """``f(x, steps)``: ``steps`` collectives chained, each result fed back by the op's
    loop step. ``steps`` is a traced scalar, so one compiled program serves every loop
    length."""
    import jax
    feedback = OPS[op].feedback

    def body(x: Any, steps: Any) -> Any:
        return jax.lax.fori_loop(0, steps, lambda _, c: feedback(c, collective(c, n), n), x)
    return body


def mesh_program(mesh: Any, op: str, collective: Callable[[Any, int], Any]) -> Callable[[Any, Any], Any]:
    """:func:`loop_body` in ``jit(shard_map(...))`` over ``mesh`` (operand split over
    :data:`AXIS`, ``steps`` replicated).

    check_vma is off because psum's result is typed invariant while the loop carry is
    varying; with it on, the loop would need a cast that only one side's types call for.
    """
    import jax
    from jax.sharding import PartitionSpec as P
    return jax.jit(jax.shard_map(loop_body(op, collective, mesh.size), mesh=mesh,
                                 in_specs=(P(AXIS), P()), out_specs=P(AXIS), check_vma=False))


def mesh_steps(mesh: Any) -> Callable[[int], Any]:
    """The ``steps`` argument of a :func:`mesh_program`: a scalar on every device."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    sharding = NamedSharding(mesh, P())
    return lambda m: jax.make_array_from_callback((), sharding, lambda _: np.int32(m))


def _input_maker(mesh: Any, n: int, elems: int, dtype: Any) -> Callable[[], Any]:
    """A function returning an operand: device k holds small integers shifted by k.

    Generated on the devices (no host copy of up to n x 64 MiB). Small integers (0..3)
    keep every sum exact in f32/f16/bf16, so the sides must agree.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    def gen() -> Any:
        i = jnp.arange(n * elems, dtype=jnp.uint32)
        return ((i + i // max(elems, 1)) % 4).astype(dtype)
    return jax.jit(gen, out_shardings=NamedSharding(mesh, P(AXIS)))


def tolerance(dtype: Any) -> tuple[float, float] | None:
    """(rtol, atol) for comparing the sides' results; None means exact."""
    import jax.numpy as jnp
    if not jnp.issubdtype(dtype, jnp.inexact):
        return None
    if jnp.finfo(dtype).bits <= 16:
        # Repeated reductions round differently in each summation order.
        return 0.25, 1.0
    return 1e-5, 1e-6


def _same_on_devices(tol: tuple[float, float] | None) -> Callable[[Any, Any], bool]:
    """Whether two results match, computed on the devices (no host copy of them)."""
    import jax
    import jax.numpy as jnp

    def compare(a: Any, b: Any) -> bool:
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if tol is None:
            return bool(jax.jit(lambda a, b: jnp.all(a == b))(a, b))
        rtol, atol = tol
        return bool(jax.jit(lambda a, b: jnp.all(jnp.isclose(a, b, rtol=rtol, atol=atol,
                                                             equal_nan=True)))(a, b))
    return compare


# ----------------------------------------------------------------------------------- run

def plan(ops: Sequence[str], sizes: Sequence[int], n: int, itemsize: int,
         notes: list[str] | None = None) -> list[tuple[str, int, int]]:
    """The (op, bytes, count) cases to measure, nccl-tests rounding applied.

    ``count`` is the number of elements behind ``bytes`` (see the module docstring). A
    size under the op's smallest (one element, or one per device where the op splits its
    operand into n blocks) is measured at that smallest size; sizes that round to one
    already planned are planned once. Each such change is appended to ``notes``.

    Example: ``plan(["all_gather"], [4, 64], 8, 4, notes)`` gives
    ``[("all_gather", 32, 8), ("all_gather", 64, 16)]`` and a note that 4B is measured
    as 32B.
    """
    cases: list[tuple[str, int, int]] = []
    for op in ops:
        planned: dict[int, int] = {}  # count -> the size first asked for it
        for size in sizes:
            count = size // itemsize
            smallest = n if OPS[op].whole_blocks else 1
            if OPS[op].whole_blocks:
                count -= count % n
            raised = count < smallest
            count = max(count, smallest)
            said = f"{op} {common.format_bytes(size)}"
            if count in planned:
                if planned[count] != size:
                    _note(notes, f"{said}: the same case as {common.format_bytes(planned[count])} "
                                 f"after rounding ({common.format_bytes(count * itemsize)}), "
                                 f"measured once")
                continue
            if raised:
                why = f"one element of {itemsize} B" + (
                    f" per device, {n} devices" if OPS[op].whole_blocks else "")
                _note(notes, f"{said}: measured at {common.format_bytes(count * itemsize)}, its "
                             f"smallest size ({why})")
            planned[count] = size
            cases.append((op, count * itemsize, count))
    return cases


def _note(notes: list[str] | None, text: str) -> None:
    if notes is not None:
        notes.append(text)


def run(ops: Sequence[str] = ALL_OPS,
        sizes: Sequence[int] | str = options.DEFAULT_SIZES[1],
        devices: int | None = None,
        dtype: Any = "float32",
        rounds: int = 10,
        warmup: int = 1,
        *,
        factor: int = 4,
        lengths: Sequence[int] = method.DEFAULT_LENGTHS,
        timeout_s: float | None = None,
        check: bool = True,
        progress: bool = False,
        title: str = "") -> list[dict[str, Any]]:
    """Measures each op at each size in this process: jaxcomm, XLA and a plain jit.

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
      rounds: timed rounds; in each, every side runs every loop length once, the sides
        in alternating order (:func:`jaxcomm.bench.method.turn_order`).
      warmup: untimed calls per side and length after the first (compiling) call.
      factor: growth factor between sizes when ``sizes`` is a range spec.
      lengths: loop lengths (collectives per call), trimmed per size by
        :func:`jaxcomm.bench.method.lengths_for`.
      timeout_s: jaxcomm's deadline per call (None: jaxcomm's default).
      check: compare XLA's result with jaxcomm's once per case.
      progress: show a progress bar on stderr.
      title: label shown on the progress bar.

    Returns:
      One record per (op, size), as :func:`jaxcomm.bench.measure.measure` makes them
      (per side ``<side>_per_collective_us`` b and ``<side>_per_call_us`` a, ``match``,
      ``error``), with ``op, bytes, count, dtype, processes, devices, hosts, bind,
      hugetlb, load``. Print them with :func:`jaxcomm.bench.report.print_report`.

    Example (8 emulated devices)::

        records = run(["all_reduce"], "4B,1MiB", devices=8, rounds=5)
        records[0]["jaxcomm_per_collective_us"], records[0]["xla_per_collective_us"]
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    if isinstance(sizes, str):
        sizes = common.parse_sizes(sizes, factor)
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}; choose from {', '.join(ALL_OPS)}")
    if rounds < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1 and warmup >= 0, got rounds={rounds}, warmup={warmup}")
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
    compare = _same_on_devices(tolerance(dtype)) if check else None
    steps = mesh_steps(mesh)
    notes: list[str] = []
    cases = plan(ops, list(sizes), n, dtype.itemsize, notes)
    for note in notes:
        print(f"note: {note}", file=sys.stderr, flush=True)
    records = []
    with common.ProgressDisplay(len(cases), title=title, enabled=progress) as bar:
        for op, nbytes, count in cases:
            bar.step(f"{op} {common.format_bytes(nbytes)}")
            spec = OPS[op]
            x = _input_maker(mesh, n, spec.in_elems(count, n), dtype)()
            collectives = {"jaxcomm": lambda c, n, spec=spec: spec.jaxcomm(c, n, timeout_s),
                           "xla": spec.xla, "plain": plain_step}
            sides = {name: measure.Side(mesh_program(mesh, op, fn), x, steps, lambda out: out)
                     for name, fn in collectives.items()}
            measure.jaxcomm_rounds(op)  # from zero
            rec = measure.measure(sides, method.lengths_for(nbytes, lengths), rounds, warmup,
                                  measure.LocalSync(), compare)
            rec.update(op=op, bytes=nbytes, count=count, dtype=dtype.name, processes=1, devices=n,
                       hosts=1, bind="process", hugetlb=hugetlb, load=method.load_average(),
                       jaxcomm_rounds=measure.jaxcomm_rounds(op))
            if rec["error"]:
                bar.note(f"{op} {common.format_bytes(nbytes)}: {rec['error']}")
            elif False in rec["match"].values():
                bar.note(f"{op} {common.format_bytes(nbytes)}: jaxcomm's result differs from XLA's")
            records.append(rec)
            del x, sides
    return records


def _warn_if_not_jaxcomm() -> None:
    """Says so on stderr when jaxcomm would lower to jax.lax (the comparison is moot)."""
    import jax
    from jaxcomm._src import config, runtime
    if config.backend() == "xla" or (config.backend() == "auto"
                                     and jax.default_backend() not in runtime.PLATFORMS):
        print(f"warning: jaxcomm lowers to jax.lax here (JAXCOMM_BACKEND={config.backend()}, "
              f"platform {jax.default_backend()}): both sides measure XLA", file=sys.stderr)


# ---------------------------------------------------------------------------------- CLI

def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m jaxcomm.bench [options]`` in one process; the exit status.

    Must run before the process creates a JAX backend (``--devices`` sets XLA_FLAGS).
    Exit status 1 when some case failed or jaxcomm's result differed from XLA's.
    """
    args = options.parse(sys.argv[1:] if argv is None else argv)
    if args.show:
        records = report.read_json(args.show)
        report.print_report(records, args.targets)
        return 0
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (fail now, not after the whole run)
        except ImportError:
            print("error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
    common.set_host_device_count(args.devices)
    settings = {"off": [False], "on": [True], "both": [False, True]}[args.hugetlb]
    current = common.hugetlb_enabled()
    if args.emit_json:
        report.write_json(_run_here(args), args.emit_json)
        return 0
    print(f"# jaxcomm collective benchmark, one process: {args.devices} devices, "
          f"{os.cpu_count()} cpus, rounds {args.rounds}, THP {common.transparent_hugepage_mode()}",
          flush=True)
    all_records: list[dict[str, Any]] = []
    failed_children = False
    for setting in settings:
        records = _run_here(args) if setting == current else _run_child(args, setting)
        failed_children |= records is None
        records = records or []
        load = method.load_average()
        for r in records:
            r.update(started_by=f"python -m jaxcomm.bench --devices {args.devices}", load_after=load)
        report.print_report(records, args.targets)
        all_records.extend(records)
    if args.json:
        report.write_json(all_records, args.json)
    if args.plot and all_records:
        report.plot(all_records, args.plot)
    return 1 if report.failed(all_records) or failed_children else 0


def _run_here(args: argparse.Namespace) -> list[dict[str, Any]]:
    hugetlb = "on" if common.hugetlb_enabled() else "off"
    return run(options.op_list(args), common.parse_sizes(args.sizes, args.factor), args.devices,
               args.dtype, args.rounds, args.warmup, lengths=options.length_list(args),
               timeout_s=args.timeout, check=args.check, progress=args.progress,
               title=f"hugetlb={hugetlb}")


def _run_child(args: argparse.Namespace, hugetlb: bool) -> list[dict[str, Any]] | None:
    """Re-executes the benchmark with malloc's huge pages ``hugetlb``; its records or None."""
    fd, path = tempfile.mkstemp(prefix="jaxcomm-bench-", suffix=".json")
    os.close(fd)
    try:
        child_args = ["--ops", args.ops, "--sizes", args.sizes, "--factor", str(args.factor),
                      "--devices", str(args.devices), "--dtype", args.dtype,
                      "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                      "--lengths", args.lengths,
                      "--hugetlb", "on" if hugetlb else "off", "--emit-json", path]
        if args.timeout is not None:
            child_args += ["--timeout", str(args.timeout)]
        if not args.check:
            child_args.append("--no-check")
        if not args.progress:
            child_args.append("--no-progress")
        rc = common.run_module_child(child_args, common.hugetlb_env(hugetlb))
        try:
            records = report.read_json(path)
        except (OSError, ValueError):
            records = None
        if rc != 0 or not records:
            print(f"error: the hugetlb={'on' if hugetlb else 'off'} run (a child process) "
                  f"exited with status {rc} and no results", file=sys.stderr)
            return None
        return records
    finally:
        os.unlink(path)


if __name__ == "__main__":
    sys.exit(main())
