"""Rounds completed inline on the device thread (RoundTable::ArriveInline).

A group with one rank in each of its processes, all on this host, exchanges small
operands through shared memory and runs the work on the calling device thread from its
second round on. These tests check that the path is taken (counted by
``_jaxcomm.inline_rounds()``), that every op's values equal a NumPy reference of the
global data on it and with it turned off (JAXCOMM_INLINE=0), and that a peer that is
late or dies is still named at the deadline or at once.
"""

from __future__ import annotations

import pytest

from mp_util import assert_ok, results, run_script

EVERY_OP = """
import json
from jaxcomm import _jaxcomm
N = jax.device_count()
mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("x",))
ring = [(i, (i + 1) % N) for i in range(N)]
OPS = {
    "all_reduce": (lambda v: jaxcomm.all_reduce(v, "x"), lambda g: np.tile(g.sum(0), (N, 1))),
    "all_reduce_max": (lambda v: jaxcomm.all_reduce(v, "x", op="max"), lambda g: np.tile(g.max(0), (N, 1))),
    "all_gather": (lambda v: jaxcomm.all_gather(v, "x", tiled=True),
                   lambda g: np.tile(g.reshape(-1), (N, 1))),
    "all_to_all": (lambda v: jaxcomm.all_to_all(v, "x", 1, 1, tiled=True),
                   lambda g: np.stack([np.concatenate([g[j].reshape(N, -1)[d] for j in range(N)])
                                       for d in range(N)])),
    "ppermute": (lambda v: jaxcomm.ppermute(v, "x", ring), lambda g: np.roll(g, 1, axis=0)),
    "reduce_scatter": (lambda v: jaxcomm.reduce_scatter(v, "x", scatter_dimension=1, tiled=True),
                       lambda g: g.sum(0).reshape(N, -1)),
    "broadcast": (lambda v: jaxcomm.broadcast(v, "x", root=1), lambda g: np.tile(g[1], (N, 1))),
}
report = {}
for elements in (1 * N, 1024, 65536):  # 4 B per rank up to the largest inline size
    for name, (op, reference) in OPS.items():
        if name in ("all_to_all", "reduce_scatter") and elements % N:
            continue
        f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
        before = _jaxcomm.inline_rounds()
        for call in range(4):  # the first round makes the plan, later ones may run inline
            rng = np.random.default_rng(100 * call + elements)
            g = rng.integers(-50, 50, size=(N, elements)).astype(np.float32)
            out = f(jax.device_put(g, NamedSharding(mesh, P("x"))))
            want = reference(g)
            for shard in out.addressable_shards:
                r = list(mesh.devices.flat).index(shard.device)
                np.testing.assert_array_equal(np.asarray(shard.data).reshape(-1), want[r].reshape(-1),
                                              err_msg=f"{name} {elements} call {call}")
        report[f"{name}/{elements}"] = _jaxcomm.inline_rounds() - before
print("RESULT", json.dumps(report), flush=True)
"""


@pytest.mark.parametrize("inline", ["1", "0"])
def test_every_op_equals_numpy_on_and_off_the_inline_path(inline: str) -> None:
    # A spin budget of 1 s: on a loaded machine a peer descheduled for longer than the
    # default 200 us would send the round off the inline path, and the count would vary.
    res = run_script(EVERY_OP, 2, 1, env={"JAXCOMM_INLINE": inline, "JAXCOMM_SPIN_US": "1000000"},
                     timeout_s=240)
    assert_ok(res)
    counts = results(res)
    assert sorted(counts) == [0, 1], res.format()
    for rank, per_case in counts.items():
        assert len(per_case) == 21, per_case  # 7 ops x 3 sizes
        for case, taken in per_case.items():
            # Every call but the first, which makes the plan.
            assert taken == (0 if inline == "0" else 3), (rank, case, taken)


LATE_AFTER_WARMUP = """
import time
mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("x",))
f = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, "x", timeout_s=2.0),
                          mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
x = jax.device_put(np.ones(jax.device_count(), np.float32), NamedSharding(mesh, P("x")))
from jaxcomm import _jaxcomm
for _ in range(3):
    f(x).block_until_ready()
print("INLINE", _jaxcomm.inline_rounds(), flush=True)
if RANK == 1:
    if MODE == "late":
        time.sleep(6)   # alive, but misses the deadline of the next call
    os._exit(0)         # "dies": exits without arriving
try:
    f(x).block_until_ready()
    print("NO ERROR", flush=True)
except Exception as e:
    print("ERROR", str(e).replace("\\n", " "), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("mode", ["late", "dead"])
def test_a_missing_peer_is_named_after_inline_rounds(mode: str) -> None:
    # The warmup's rounds must run inline on both ranks, loaded machine or not: a spin
    # budget of 1 s (as above), still half the calls' deadline.
    res = run_script(f"MODE = {mode!r}\n" + LATE_AFTER_WARMUP, 2, 1, env={"JAXCOMM_SPIN_US": "1000000"},
                     timeout_s=60, grace_s=10)
    out = res.output[0]
    inline = [int(l.split()[1]) for l in out.splitlines() if l.startswith("INLINE ")]
    assert inline and inline[0] >= 1, res.format()
    line = next((l for l in out.splitlines() if l.startswith("ERROR")), "")
    assert "jaxcomm.all_reduce" in line and "process 1" in line and "ranks [1]" in line, res.format()
    if mode == "late":
        assert line.startswith("ERROR DEADLINE_EXCEEDED") and "did not arrive at this call" in line, line
    else:
        assert "failed: it exited" in line and "timed out" not in line, line
