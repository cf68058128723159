"""The routes of the CUDA backend under JAXCOMM_EMULATE_CUDA=1, told apart by
jaxcomm.stats(): one program per route in a process of its own (the emulation serves the
whole process), results against jax.lax.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxcomm
    from jaxcomm._src.backends import cuda_emulated

    def run(mesh, spec, f, ref, x):
        x = jax.device_put(x, NamedSharding(mesh, spec))
        sm = lambda g: jax.jit(jax.shard_map(g, mesh=mesh, in_specs=spec, out_specs=spec))
        jaxcomm.stats(reset=True)
        got = [np.asarray(sm(f)(x)) for _ in range(2)]  # two executions
        want = np.asarray(sm(ref)(x))
        rows = [dict(op=r.op, algorithm=r.algorithm, calls=r.calls, bytes=r.bytes)
                for r in jaxcomm.stats()]
        return dict(equal=all(np.array_equal(g, want) for g in got), rows=rows)

    def ragged_one_rank(mesh):
        # One-rank groups (axis y): rows 1-2 of each device's operand to rows 3-4 of its output.
        operand = jnp.arange(8 * 4 * 2, dtype=jnp.float32).reshape(8 * 4, 2)
        idx = lambda v: jnp.full((1,), v, jnp.int32)
        f = lambda a: jaxcomm.ragged_all_to_all(a, jnp.zeros((6, 2), a.dtype), idx(1), idx(2), idx(3),
                                                idx(2), axis_name="y")
        spec = P(("x", "y"))
        a = jax.device_put(operand, NamedSharding(mesh, spec))
        jaxcomm.stats(reset=True)
        got = np.asarray(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))(a))
        want = np.zeros((8, 6, 2), np.float32)
        want[:, 3:5] = np.asarray(operand).reshape(8, 4, 2)[:, 1:3]
        # Its transpose (RaggedTransposeKernel): the cotangent of rows 3-4 flows to rows 1-2.
        ct = jnp.arange(8 * 6 * 2, dtype=jnp.float32).reshape(8 * 6, 2) + 1
        g = lambda a, c: jax.vjp(f, a)[1](c)[0]
        c = jax.device_put(ct, NamedSharding(mesh, spec))
        grad = np.asarray(jax.jit(jax.shard_map(g, mesh=mesh, in_specs=(spec, spec), out_specs=spec))(a, c))
        want_grad = np.zeros((8, 4, 2), np.float32)
        want_grad[:, 1:3] = np.asarray(ct).reshape(8, 6, 2)[:, 3:5]
        rows = [dict(op=r.op, algorithm=r.algorithm, calls=r.calls, bytes=r.bytes)
                for r in jaxcomm.stats()]
        return dict(equal=bool(np.array_equal(got.reshape(8, 6, 2), want)
                               and np.array_equal(grad.reshape(8, 4, 2), want_grad)), rows=rows)

    mesh8 = jax.make_mesh((8,), ("x",))
    mesh81 = jax.make_mesh((8, 1), ("x", "y"))
    x = jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8)
    perm = [(i, (i + 1) % 8) for i in range(8)]
    out = {
        "peers": run(mesh8, P("x"), lambda v: jaxcomm.ppermute(v, "x", perm),
                     lambda v: jax.lax.ppermute(v, "x", perm), x),
        "nccl": run(mesh8, P("x"), lambda v: jaxcomm.all_reduce(v, "x"),
                    lambda v: jax.lax.psum(v, "x"), x),
        "copy": run(mesh81, P("x", "y"), lambda v: jaxcomm.all_gather(v, "y", tiled=True),
                    lambda v: jax.lax.all_gather(v, "y", tiled=True), x),
        "ragged": ragged_one_rank(mesh81),
        "violations": cuda_emulated.strict_violations(),
    }
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def routes() -> dict:
    env = dict(os.environ, JAXCOMM_EMULATE_CUDA="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600, cwd="/")
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, (r.stdout + r.stderr)[-4000:]
    return json.loads(line[0][len("RESULT "):])


@pytest.mark.parametrize("route,op,algorithm", [
    ("peers", "ppermute", "cuda (emulated): cuda peers in process"),
    ("nccl", "all_reduce", "cuda (emulated): nccl"),
    ("copy", "all_gather", "cuda (emulated): cuda copy"),
    ("ragged", "ragged_all_to_all", "cuda (emulated): cuda copy"),  # RaggedForwardKernel
])
def test_route_serves_and_matches_lax(routes, route, op, algorithm):
    res = routes[route]
    assert res["equal"]
    assert {(row["op"], row["algorithm"]) for row in res["rows"]} == {(op, algorithm)}


def test_no_strict_check_fired(routes):
    assert routes["violations"] == []


@pytest.mark.parametrize("route", ["peers", "nccl"])
def test_stats_count_rounds_of_the_group(routes, route):
    # As the host backend's (jaxcomm.stats() documents it): one call per execution of the
    # group, not one per rank (the CUDA watcher finishes each rank's entry on its own; it
    # counted 16 calls for 2 executions of a group of 8 before).
    (row,) = routes[route]["rows"]
    assert row["calls"] == 2
