"""Fault-tolerant data-parallel training: one of four processes dies, the others finish.

    python examples/ft_training.py [--processes 4] [--steps 12] [--kill-process 3] [--kill-step 5]

Starts itself as a 4-process job on this machine (jaxcomm.launch, with survivors kept
running), one data-parallel replica of a linear-regression model per process. Each step
computes the local gradient on the replica's own data and averages it over the replicas
still alive with ``jaxcomm.ft.all_reduce``. Process ``--kill-process`` is killed (SIGKILL)
just before step ``--kill-step``; the survivors notice within milliseconds, leave it out
of that step and of the rest, and finish. Process 0 then checks its parameters against a
NumPy replay of the same schedule (all replicas before the kill, the survivors after)
and the launcher process prints the flight-recorder analyzer's verdict on the dumps
(``python -m jaxcomm.trace analyze``), which names the dead process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

import numpy as np

FEATURES, ROWS, LR = 8, 64, 0.1


def replica_data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Replica ``rank``'s shard: inputs [ROWS, FEATURES] and targets [ROWS]."""
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((ROWS, FEATURES)).astype(np.float32)
    w_true = np.linspace(-1.0, 1.0, FEATURES, dtype=np.float32)
    return x, (x @ w_true + 0.01 * rng.standard_normal(ROWS)).astype(np.float32)


def numpy_replay(processes: int, steps: int, kill_rank: int, kill_step: int) -> np.ndarray:
    """The parameters after training, replayed with NumPy: who contributed at each step."""
    w = np.zeros(FEATURES, np.float32)
    data = [replica_data(r) for r in range(processes)]
    for step in range(steps):
        alive = [r for r in range(processes) if not (r == kill_rank and step >= kill_step)]
        grads = [2.0 / ROWS * x.T @ (x @ w - y) for x, y in (data[r] for r in alive)]
        w = w - LR * np.sum(grads, axis=0) / len(alive)
    return w


def worker(args: argparse.Namespace) -> None:
    import jax

    # Survivors of a dead process must not be shut down by JAX's coordination service.
    jax.config.update("jax_enable_recoverability", True)
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxcomm

    jaxcomm.init()
    rank = jax.process_index()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("dp",))

    def loss(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    def step(w, x, y):
        g = jax.grad(loss)(w, x[0], y[0])
        total, contributed = jaxcomm.ft.all_reduce(g, "dp", timeout_s=5.0)
        return w - LR * total / contributed.sum(), contributed, loss(w, x[0], y[0])[None]

    train = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("dp"), P("dp")),
                                  out_specs=(P(), P(), P("dp")), check_vma=False))
    x, y = replica_data(rank)
    shard = lambda a: jax.make_array_from_process_local_data(NamedSharding(mesh, P("dp")), a[None])
    xs, ys = shard(x), shard(y)
    w = jax.device_put(jnp.zeros(FEATURES, jnp.float32), NamedSharding(mesh, P()))
    for i in range(args.steps):
        if rank == args.kill_rank and i == args.kill_step:
            print(f"step {i}: killing myself", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        t = time.perf_counter()
        w, contributed, local_loss = train(w, xs, ys)
        mask = np.asarray(contributed.addressable_shards[0].data)
        ms = (time.perf_counter() - t) * 1e3
        print(f"step {i}: loss {float(local_loss.addressable_shards[0].data[0]):.4f}, "
              f"replicas {mask.astype(int).tolist()}, {ms:.1f} ms", flush=True)
    final = np.asarray(w.addressable_shards[0].data)
    # Every survivor must hold the same parameters: their mean over the survivors is the
    # survivors' own (one more fault-tolerant call).
    mean = jax.jit(jax.shard_map(lambda v: jaxcomm.ft.all_reduce(v, "dp"), mesh=mesh,
                                 in_specs=P(), out_specs=(P(), P()), check_vma=False))(w)
    total, alive = (np.asarray(a.addressable_shards[0].data) for a in mean)
    spread = float(np.max(np.abs(total / alive.sum() - final)))
    if spread > 1e-6:
        sys.exit(f"the survivors' parameters differ (max |mean - mine| = {spread:.2e})")
    if rank == min(r for r in range(args.processes) if r != args.kill_rank):
        want = numpy_replay(args.processes, args.steps, args.kill_rank, args.kill_step)
        err = float(np.max(np.abs(final - want)))
        print(f"the survivors hold the same parameters, and they match the NumPy replay of "
              f"the survivors' schedule: max |diff| = {err:.2e}", flush=True)
        if err > 1e-4:
            sys.exit(f"mismatch: {final} vs {want}")
    print("RESULT " + json.dumps({"excluded": jaxcomm.ft.excluded()}), flush=True)


def driver(args: argparse.Namespace) -> int:
    from jaxcomm import launch, trace

    with tempfile.TemporaryDirectory(prefix="jaxcomm-ft-") as dumps:
        env = dict(os.environ, JAXCOMM_TRACE_DIR=dumps)
        argv = [os.path.abspath(__file__), *sys.argv[1:]]
        result = launch.launch(argv, args.processes, env=env, keep_going=True, timeout_s=300)
        survivors = [r for r, code in enumerate(result.returncodes) if code == 0]
        print(f"survivors: {survivors}; process {args.kill_rank} exited with "
              f"{result.returncodes[args.kill_rank]}")
        print("flight recorder analysis of the survivors' dumps:")
        report = trace.analyze(dumps)
        print(report.text())
    expected = [r for r in range(args.processes) if r != args.kill_rank]
    return 0 if survivors == expected else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-process", "--kill-rank", dest="kill_rank", type=int, default=3,
                   help="the process (jax.process_index()) killed at --kill-step")
    p.add_argument("--kill-step", type=int, default=5)
    args = p.parse_args()
    if not 0 <= args.kill_rank < args.processes:
        p.error("--kill-process must name one of the processes (0 included: the launcher runs "
                "JAX's coordination service in a process of its own)")
    if "JAXCOMM_PROCESS_ID" in os.environ:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
