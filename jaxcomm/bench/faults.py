"""How fast a job of 4 processes learns of a fault, and what the flight recorder costs.

    python -m jaxcomm.bench.faults [--repeats 3] [--deadline 5] [--transport auto|tcp]
                                   [--skip-detection] [--skip-overhead]

Detection: each run launches 4 processes (``python -m jaxcomm.launch``, one CPU device
each) looping over a 4 B all_reduce with a ``--deadline`` s timeout, and injects one
fault at the loop's second call (``JAXCOMM_FAULT``): a process exits, hangs, or arrives
``8 x deadline`` late, at process 0 or at the last process; or, with
``jaxcomm.ft.all_reduce`` in a ``--keep-going`` job, process 0 or the last process is
SIGKILLed. The time measured runs from the fault (the time the fault printed, or the
kill) to the last survivor's error as its flight recorder holds it (the end of its
failed call), or, for ft.all_reduce, to the end of the last survivor's call that went
on without the dead process. A hang or a late process can only be told from a slow one
at the deadline: those rows also show the time past it.

Overhead: ``python -m jaxcomm.trace overhead`` (8 devices in one process, recorder on
and off alternately) with the rings in memory and in the file under
``JAXCOMM_TRACE_DIR``, each in a process of its own, and the recorder's own CPU time
per 8-rank round for both storages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

N = 4

LOOP = textwrap.dedent("""
    import os, time
    import numpy as np
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxcomm

    jaxcomm.init()
    deadline = float(os.environ["FAULT_BENCH_DEADLINE_S"])
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    def barrier(v):
        return jaxcomm.all_reduce(v, "x", timeout_s=120)

    def faulty(v):
        return jaxcomm.all_reduce(v, "x", timeout_s=deadline)

    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                               np.ones((1, 1), np.float32))
    step = smap(faulty).lower(x).compile()
    jax.block_until_ready(smap(barrier)(x))
    for i in range(4):
        jax.block_until_ready(step(x))
""")

FT = textwrap.dedent("""
    import json, os, signal, time
    import numpy as np
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxcomm

    jaxcomm.init()
    rank, victim = jax.process_index(), int(os.environ["FAULT_BENCH_VICTIM"])
    mesh = jax.make_mesh((jax.device_count(),), ("dp",))
    f = jax.jit(jax.shard_map(lambda v: jaxcomm.ft.all_reduce(v, "dp", timeout_s=60.0),
                              mesh=mesh, in_specs=P("dp"), out_specs=(P(), P()),
                              check_vma=False))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("dp")),
                                               np.ones((1, 1), np.float32))
    for step in range(6):
        if rank == victim and step == 3:
            print("KILLED_AT", time.time(), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.time()
        total, mask = f(x)
        jax.block_until_ready(total)
        print("STEP", json.dumps({"step": step, "start": t0, "end": time.time(),
                                  "alive": int(np.asarray(mask.addressable_shards[0].data).sum())}),
              flush=True)
""")

_FIRED = re.compile(r"JAXCOMM_FAULT .* fired at .*, at (\d+) us\)")


def _launch(script: str, env: dict[str, str], keep_going: bool = False) -> Any:
    from jaxcomm import launch

    with tempfile.TemporaryDirectory(prefix="jaxcomm-fault-bench-") as work:
        path = os.path.join(work, "job.py")
        with open(path, "w") as f:
            f.write(script)
        return launch.launch([path], N, env=env, capture=True, timeout_s=300, grace_s=3,
                             keep_going=keep_going, cwd=work)


def detect_once(kind: str, victim: int, deadline: float, transport: str) -> dict[str, Any]:
    """One run of a loop with one injected fault; seconds from the fault to the last
    survivor's error (from the survivors' flight records)."""
    from jaxcomm.trace import analyzer

    action = {"exit": "exit", "hang": "hang", "delay": f"delay:{deadline * 8:g}"}[kind]
    with tempfile.TemporaryDirectory(prefix="jaxcomm-fault-trace-") as trace:
        env = dict(os.environ, JAXCOMM_TRANSPORT=transport, JAXCOMM_TRACE_DIR=trace,
                   JAX_PLATFORMS="cpu", FAULT_BENCH_DEADLINE_S=str(deadline),
                   JAXCOMM_FAULT=f"process={victim},site=(faulty),call=2,action={action}")
        res = _launch(LOOP, env)
        fired = [int(m.group(1)) for _, _, line in res.lines if (m := _FIRED.search(line))]
        ends = [e["end_us"] for d in analyzer.load(trace) if d["process_index"] != victim
                for e in d["entries"]
                if "(faulty)" in e["call_site"] and e["state"] == "failed" and e["end_us"]]
        verdict = analyzer.analyze(trace).findings
    if not fired or len(ends) < N - 1:
        raise RuntimeError(f"{kind} at process {victim}: no fault time or survivors' errors "
                           f"({len(fired)} fault lines, {len(ends)} failed calls)\n{res.format()}")
    return dict(seconds=(max(ends) - fired[0]) / 1e6,
                named=verdict[0].processes if verdict else [])


def ft_once(victim: int, transport: str) -> dict[str, Any]:
    """One ft.all_reduce job whose ``victim`` is SIGKILLed before its 4th step; seconds
    from the kill to the end of the last survivor's step that went on without it."""
    env = dict(os.environ, JAXCOMM_TRANSPORT=transport, JAX_PLATFORMS="cpu",
               FAULT_BENCH_VICTIM=str(victim))
    res = _launch(FT, env, keep_going=True)
    killed = [float(line.split()[1]) for r, _, line in res.lines if line.startswith("KILLED_AT")]
    steps = [json.loads(line.split(" ", 1)[1]) for r, _, line in res.lines
             if line.startswith("STEP ")]
    after = [s for s in steps if s["step"] == 3]
    before = [s["end"] - s["start"] for s in steps if s["step"] == 2]
    if not killed or len(after) != N - 1 or any(s["alive"] != N - 1 for s in after):
        raise RuntimeError(f"ft run with process {victim} killed went wrong:\n{res.format()}")
    return dict(seconds=max(s["end"] for s in after) - killed[0],
                step_before_s=statistics.median(before) if before else float("nan"))


def overhead(rounds: int) -> dict[str, Any]:
    """The recorder's cost with the rings in memory and in a file, one process each."""
    from jaxcomm import _jaxcomm

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="jaxcomm-trace-overhead-") as trace:
        for name, extra in (("memory", {}), ("file", {"JAXCOMM_TRACE_DIR": trace})):
            env = {k: v for k, v in os.environ.items() if k != "JAXCOMM_TRACE_DIR"}
            env.update(extra, JAX_PLATFORMS="cpu")
            proc = subprocess.run([sys.executable, "-m", "jaxcomm.trace", "overhead",
                                   "--rounds", str(rounds)], env=env, capture_output=True,
                                  text=True, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(proc.stdout + proc.stderr)
            out[name] = proc.stdout.strip()
        costs = {name: min(_jaxcomm.trace_round_cost_ns(8, 20000, 2048, d) for _ in range(5))
                 for name, d in (("memory", ""), ("file", trace))}
    out["round_cost_ns"] = costs
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxcomm.bench.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per fault (the table gives their median, min and max) (default %(default)s)")
    p.add_argument("--deadline", type=float, default=5.0, metavar="SECONDS",
                   help="the looped all_reduce's timeout_s (default %(default)g)")
    p.add_argument("--transport", choices=("auto", "tcp"), default="auto",
                   help="JAXCOMM_TRANSPORT of the jobs: auto (shared memory on one host) or tcp "
                        "(default %(default)s)")
    p.add_argument("--overhead-rounds", type=int, default=15,
                   help="alternations of recorder on and off in the overhead measurement "
                        "(default %(default)s)")
    p.add_argument("--skip-detection", action="store_true",
                   help="leave out the fault detection table (most of the run's time)")
    p.add_argument("--skip-overhead", action="store_true",
                   help="leave out the flight recorder's overhead")
    args = p.parse_args(argv)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"load average {' '.join(load)}; {N} processes x 1 CPU device, transport "
          f"{args.transport}, deadline {args.deadline:g} s, {args.repeats} runs per row")
    if not args.skip_detection:
        print("| fault | at | fault -> last survivor's error (median, min-max) | named by the analyzer |")
        print("|---|---|---:|---|")
        for kind in ("exit", "hang", "delay"):
            for victim in (0, N - 1):
                runs = [detect_once(kind, victim, args.deadline, args.transport)
                        for _ in range(args.repeats)]
                s = sorted(r["seconds"] for r in runs)
                past = "" if kind == "exit" else f" ({statistics.median(s) - args.deadline:+.3f} s past the deadline)"
                named = sorted({tuple(r["named"]) for r in runs})
                print(f"| {kind} | process {victim} | {statistics.median(s):.3f} s "
                      f"({s[0]:.3f}-{s[-1]:.3f}){past} | {named} |", flush=True)
        for victim in (0, N - 1):
            runs = [ft_once(victim, args.transport) for _ in range(args.repeats)]
            s = sorted(r["seconds"] for r in runs)
            before = statistics.median(r["step_before_s"] for r in runs)
            print(f"| SIGKILL, ft.all_reduce goes on | process {victim} | {statistics.median(s):.3f} s "
                  f"({s[0]:.3f}-{s[-1]:.3f}); a step before it: {before * 1e3:.2f} ms | - |",
                  flush=True)
    if not args.skip_overhead:
        r = overhead(args.overhead_rounds)
        with open("/proc/loadavg") as f:
            print(f"\nrecorder overhead (load average {' '.join(f.read().split()[:3])}):")
        for name in ("memory", "file"):
            print(f"rings in {name}:\n{r[name]}")
        c = r["round_cost_ns"]
        print(f"recorder CPU per 8-rank round: memory {c['memory'] / 1e3:.3f} us, file "
              f"{c['file'] / 1e3:.3f} us (file/memory {c['file'] / c['memory']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
