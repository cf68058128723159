"""jaxcomm.tp across processes (shared memory between the processes of this host):
the collective matmuls and their gradients against NumPy, and split-phase puts (small, and
large enough to stream by ranges) against NumPy's roll, in 2 processes x 1 device and 2
processes x 2 devices."""

from __future__ import annotations

import os

import pytest

from mp_util import assert_ok, results, run_script
from slow_util import slow

BODY = """
from functools import partial
mesh = jax.make_mesh((NPROC * LOCAL,), ("tp",))
R = NPROC * LOCAL
rng = np.random.default_rng(0)
x = rng.integers(-4, 4, size=(R * 3, 8)).astype(np.float32)
w1 = rng.integers(-4, 4, size=(8, R * 2)).astype(np.float32)
w2 = rng.integers(-4, 4, size=(R * 2, 8)).astype(np.float32)

KW = dict(direction=os.environ["TP_DIRECTION"])

def block(x, w1, w2):
    h = jaxcomm.tp.all_gather_matmul(x, w1, "tp", **KW)
    return jaxcomm.tp.matmul_reduce_scatter(h * h, w2, "tp", **KW)

def loss(x, w1, w2):
    return jax.lax.psum((block(x, w1, w2) ** 2).sum(), "tp") / 1e4

def body(x, w1, w2):
    pending = jaxcomm.tp.put_start(x, "tp", [(i, (i + 1) % R) for i in range(R)])
    y = block(x, w1, w2)                                  # runs while x travels
    moved = jaxcomm.tp.put_done(pending)
    return y, moved, jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)

specs = (P("tp"), P(None, "tp"), P("tp"))
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("tp"), P("tp"), specs)))
args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w1, w2), specs)]
y, moved, grads = f(*args)
y, moved, grads = f(*args)                                # a second run of the same program

def gathered(a):
    return np.asarray(jax.jit(lambda v: v, out_shardings=NamedSharding(mesh, P()))(a))

want_y = (x @ w1) ** 2 @ w2
want_moved = np.roll(x.reshape(R, 3, 8), 1, axis=0).reshape(-1, 8)
ref = jax.grad(lambda x, w1, w2: ((((x @ w1) ** 2) @ w2) ** 2).sum() / 1e4, argnums=(0, 1, 2))
want_grads = ref(jnp.asarray(x), jnp.asarray(w1), jnp.asarray(w2))
np.testing.assert_array_equal(gathered(y), want_y)
np.testing.assert_array_equal(gathered(moved), want_moved)
for g, want in zip(grads, want_grads):
    np.testing.assert_allclose(gathered(g), np.asarray(want), rtol=1e-5)
# A put large enough to stream through shared memory by ranges (1.2 MB a rank).
n = 300001
ring = [(i, (i + 1) % R) for i in range(R)]
put = jax.jit(jax.shard_map(lambda v: jaxcomm.tp.put_done(jaxcomm.tp.put_start(v, "tp", ring)), mesh=mesh,
                            in_specs=P("tp"), out_specs=P("tp")))
big = np.arange(R * n, dtype=np.float32)
moved = put(jax.device_put(big, NamedSharding(mesh, P("tp"))))
np.testing.assert_array_equal(gathered(moved), np.roll(big.reshape(R, n), 1, axis=0).reshape(-1))
print("RESULT", '{"ok": true}')
"""


@pytest.mark.parametrize("processes,devices,direction", [
    (2, 1, "one_way"), (2, 2, "bidirectional"),
    slow(2, 2, "none")])
def test_tp_across_processes(processes, devices, direction):
    res = run_script(BODY, processes, devices, timeout_s=120, env={"TP_DIRECTION": direction})
    assert_ok(res)
    assert results(res) == {p: {"ok": True} for p in range(processes)}
