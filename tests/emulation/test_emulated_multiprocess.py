"""The emulated CUDA backend (JAXCOMM_EMULATE_CUDA=1) in jobs of several processes: the
CUDA backend's routes between processes, CUDA IPC and NCCL (the mock NCCL), on the emulated
runtime, checked against NumPy.

Each job's processes run tests/multiprocess/check_ops.py's cases (its library part: the
same data, groups and NumPy references as the host backend's multi-process tests) over
meshes that span the processes. Before jax loads, each process picks its emulated GPUs
with CUDA_VISIBLE_DEVICES, as a launcher does on a GPU machine:

- ``distinct``: process p sees physical GPUs p*L .. p*L+L-1 (L devices per process), so
  every rank of the job has its own GPU. Groups with one rank per process take the CUDA
  IPC route for the ops on jaxcomm's own kernels (ppermute, the MoE transport) and NCCL
  for the others; groups with several ranks of a process take NCCL.
- ``shared``: every process sees GPUs 0 .. L-1, so the processes share GPUs: a group with
  one rank per process takes the CUDA IPC route for every op (NCCL refuses two ranks on
  one GPU), and a group with two ranks of one process on a GPU another process uses is
  refused with the route's message (ffi/cuda/routes.cc).

Every process then proves which routes served (``jaxcomm.stats()``: ``cuda (emulated):
cuda ipc across processes``, ``cuda (emulated): nccl``), that the seam staged its buffers,
and that the emulated runtime's strict checks stayed silent and it holds no sticky error.
The default run takes a 2 x 1 job; ``JAXCOMM_TEST_EMULATED_FULL=1`` adds 2 x 2, 4 x 1,
4 x 2 and the shared layouts (CI's emulated step).
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
TESTS = HERE.parent
sys.path.insert(0, str(TESTS))

from mp_util import PROLOGUE, assert_ok, run_script  # noqa: E402

FULL = os.environ.get("JAXCOMM_TEST_EMULATED_FULL") == "1"
full_only = pytest.mark.skipif(not FULL, reason="JAXCOMM_TEST_EMULATED_FULL=1 (CI's emulated step)")

_CHECK_OPS = (TESTS / "multiprocess" / "check_ops.py").read_text()
#: check_ops.py's functions and data, without its own checks at the end.
CHECK_LIB = _CHECK_OPS[:_CHECK_OPS.index("\ndevices = np.asarray(jax.devices())")]

#: Picks this process's emulated GPUs before anything loads the emulated runtime.
VISIBLE = """\
import os, sys
_p, _l = int(os.environ["JAXCOMM_PROCESS_ID"]), int(os.environ["JAXCOMM_LOCAL_DEVICES"])
_first = _p * _l if sys.argv[1] == "distinct" else 0
os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(_first + k) for k in range(_l))
"""

#: After the cases: this process's routes, staging and strict checks, as one JSON line.
REPORT = """
from jaxcomm import _jaxcomm_emu as emu
report = dict(
    algorithms=sorted({s.algorithm for s in jaxcomm.stats()}),
    by_op=sorted({(s.op, s.algorithm) for s in jaxcomm.stats()}),
    violations=list(emu.emu_strict_violations()), sticky=emu.emu_sticky_error(),
    staged=emu.emu_seam_stats()["calls"], visible=os.environ["CUDA_VISIBLE_DEVICES"],
    uuids=[emu.cuda_device_uuid(k) for k in range(LOCAL)])
print("REPORT " + json.dumps(report), flush=True)
"""

CHECKS = VISIBLE + PROLOGUE + "import json\n" + CHECK_LIB + """
# One program per case: XLA:CPU runs a program's independent custom calls in any order
# (XLA:GPU issues a device's in program order), and NCCL needs every rank to issue its
# collectives in one order.
_run_together = run_cases
def run_cases(tag, mesh, axes, X, cases, donate=False):
    for name, case in cases.items():
        _run_together(tag, mesh, axes, X, {name: case}, donate)

devices = np.asarray(jax.devices()).reshape(NPROC, LOCAL)
if LOCAL > 1:
    mesh2 = jax.sharding.Mesh(devices, ("p", "l"))
    check_all(mesh2, ("p",), "p", moe=("packed",))
    check_all(mesh2, ("l",), "l", moe=())
    check_all(mesh2, ("p", "l"), "pl", moe=("padded",))
else:
    mesh1 = jax.sharding.Mesh(devices.reshape(-1)[::-1], ("x",))
    check_all(mesh1, ("x",), "x", moe=("packed",) if sys.argv[2] == "smoke" else ("packed", "padded"))

# A one-sided put (jaxcomm.tp) over the axis of one rank per process, work in between.
axis = "p" if LOCAL > 1 else "x"
put_mesh = mesh2 if LOCAL > 1 else mesh1
G = put_mesh.shape[axis]
perm = [(i, (i + 1) % G) for i in range(G)]
def put_case(x):
    pending = jaxcomm.tp.put_start(x, axis, perm)
    h = jnp.tanh(x) * 2
    return jaxcomm.tp.put_done(pending), h
def put_expected(X, g, r):
    return X[g[(r - 1) % len(g)]], np.tanh(X[g[r]]) * 2
run_cases(axis, put_mesh, (axis,), global_data(put_mesh.devices.size, BLOCK),
          {"put": (put_case, put_expected, (None, 1e-6))})

# Training: the gradient of an MoE layer's summed output through dispatch and combine
# (their transposes move the cotangents back across the processes). Token t's row goes
# to experts e_k, each computing row * (e + 1) + 0.5 e, and comes back weighted w_k: the
# gradient of its sum is sum_k w_k (e_k + 1) in every channel.
E_grad = 2 * G
def moe_grad(x):
    r = jax.lax.axis_index(axis)
    ids, w = moe_routing(r, E_grad, jnp)
    El = E_grad // G
    def loss(x):
        ex, sizes, h = jaxcomm.moe.dispatch(x, ids, num_experts=E_grad, axis_name=axis)
        el = jnp.sum(jnp.arange(ex.shape[0])[:, None] >= jnp.cumsum(sizes)[None, :], axis=1)
        e = (r * El + el).astype(jnp.float32)[:, None]
        return jaxcomm.moe.combine(expert(e, ex), h, w).sum()
    return jax.grad(loss)(x)
def moe_grad_expected(X, g, r):
    ids, w = moe_routing(r, E_grad)
    return np.repeat((w * (ids + 1)).sum(1, keepdims=True), X.shape[-1], axis=1).astype(np.float32)
run_cases(axis, put_mesh, (axis,), global_data(put_mesh.devices.size, BLOCK),
          {"moe grad": (moe_grad, moe_grad_expected, 1e-6)})
""" + REPORT + 'print("ALL CHECKED", flush=True)\n'

#: What check_all prints per mesh and axis (check_ops.py), and the MoE layouts run there.
CASES = ["all_reduce sum", "all_reduce max", "all_reduce prod", "all_gather", "all_gather axis 1",
         "reduce_scatter", "reduce_scatter dim 1", "all_to_all", "all_to_all split 1 concat 0",
         "ppermute", "broadcast", "ragged_all_to_all"]

IPC = "cuda (emulated): cuda ipc across processes"
NCCL = "cuda (emulated): nccl"
PEERS = "cuda (emulated): cuda peers in process"

#: Ops on jaxcomm's own kernels (the IPC route between processes of one host, one rank each).
OWN_KERNELS = {"ppermute", "moe_transport", "put_start"}
#: Ops NCCL serves.
NCCL_OPS = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}


def _run(n: int, local: int, layout: str, size: str = "full", timeout_s: float = 600) -> dict[int, dict]:
    res = run_script(CHECKS, n, local, prologue=False, args=[layout, size],
                     env={"JAXCOMM_EMULATE_CUDA": "1", "JAXCOMM_TIMEOUT_S": "60"},
                     timeout_s=timeout_s)
    assert_ok(res)
    reports = {}
    for p in range(n):
        out = res.output[p]
        assert "ALL CHECKED" in out, res.format()
        line = next(ln for ln in out.splitlines() if ln.startswith("REPORT "))
        reports[p] = json.loads(line[len("REPORT "):])
        reports[p]["checked"] = [ln.split("CHECKED ", 1)[1] for ln in out.splitlines()
                                 if ln.startswith("CHECKED ")]
    return reports


def _assert_clean(reports: dict[int, dict]) -> None:
    for p, r in reports.items():
        assert r["violations"] == [], (p, r["violations"])
        assert r["sticky"] == "", (p, r["sticky"])
        assert r["staged"] > 0, (p, r)
        # Every call of a jaxcomm op that the CUDA backend serves ran its code.
        cuda_ops = NCCL_OPS | OWN_KERNELS
        assert all(a.startswith("cuda (emulated): ") for op, a in r["by_op"] if op in cuda_ops), r["by_op"]


def _routes(report: dict) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for op, algorithm in report["by_op"]:
        out.setdefault(op, set()).add(algorithm)
    return out


def test_two_processes_one_gpu_each_smoke() -> None:
    """2 x 1, each process its own GPU: ppermute and the MoE transport through CUDA IPC,
    the other collectives through the mock NCCL, all against NumPy."""
    reports = _run(2, 1, "distinct", "smoke", timeout_s=300)
    _assert_clean(reports)
    assert reports[0]["uuids"] != reports[1]["uuids"]
    for p, r in reports.items():
        assert sorted(r["checked"]) == sorted(f"x {c}" for c in CASES + ["moe packed", "put", "moe grad"]), r["checked"]
        routes = _routes(r)
        assert routes["ppermute"] == {IPC} and routes["moe_transport"] == {IPC}, routes
        assert routes["put_start"] == {IPC}, routes
        for op in NCCL_OPS:
            assert routes[op] == {NCCL}, (op, routes)


@full_only
@pytest.mark.parametrize("n,local", [(2, 2), (4, 1), (4, 2)])
def test_distinct_gpus(n: int, local: int) -> None:
    """Each rank its own GPU: the one-rank-per-process groups' own-kernel ops through CUDA
    IPC, everything else across processes through the mock NCCL; within a process, the
    peers route and NCCL."""
    reports = _run(n, local, "distinct")
    _assert_clean(reports)
    assert len({tuple(r["uuids"]) for r in reports.values()}) == n
    for r in reports.values():
        routes = _routes(r)
        if local == 1:
            assert sorted(r["checked"]) == sorted(f"x {c}" for c in CASES + ["moe packed", "moe padded", "put", "moe grad"])
            assert routes["ppermute"] == {IPC} and routes["moe_transport"] == {IPC}, routes
            assert routes["put_start"] == {IPC}, routes
            for op in NCCL_OPS:
                assert routes[op] == {NCCL}, (op, routes)
        else:
            want = {f"{t} {c}" for t, moe in {"p": ["moe packed"], "l": [], "pl": ["moe padded"]}.items()
                    for c in CASES + moe} | {"p put", "p moe grad"}
            assert sorted(r["checked"]) == sorted(want)
            # ppermute: over "p" (one rank per process) IPC, over "l" the peers in the
            # process, over both NCCL.
            assert routes["ppermute"] == {IPC, PEERS, NCCL}, routes
            assert routes["put_start"] == {IPC}, routes
            for op in NCCL_OPS:
                assert routes[op] == {NCCL}, (op, routes)


@full_only
@pytest.mark.parametrize("n", [2, 4])
def test_shared_gpu_takes_the_ipc_route(n: int) -> None:
    """n x 1 on one GPU: NCCL would refuse two ranks on it, so every op of the group takes
    the CUDA IPC route."""
    reports = _run(n, 1, "shared")
    _assert_clean(reports)
    assert len({tuple(r["uuids"]) for r in reports.values()}) == 1
    for r in reports.values():
        routes = _routes(r)
        for op in NCCL_OPS | OWN_KERNELS | {"put_start"}:
            assert routes[op] == {IPC}, (op, routes)


def _moe_inference_body() -> str:
    """tests/test_moe_inference.py's job across processes: the split-phase low-latency FP8
    dispatch and combine against the fused calls, a bfloat16 combine against NumPy."""
    tree = ast.parse((TESTS / "test_moe_inference.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "SPLIT_ACROSS_PROCESSES":
            return ast.literal_eval(node.value)
    raise AssertionError("tests/test_moe_inference.py has no SPLIT_ACROSS_PROCESSES")


MOE_INFERENCE = VISIBLE + PROLOGUE + "import json\n" + _moe_inference_body() + REPORT + 'print("ALL CHECKED", flush=True)\n'


@pytest.mark.parametrize("n,local", [(2, 1), pytest.param(2, 2, marks=full_only)])
def test_moe_inference_split_phase(n: int, local: int) -> None:
    """MoE inference (low-latency layout, FP8, split-phase halves) across processes, each
    rank its own GPU: one GPU per process, the halves' transport goes through CUDA IPC
    (moe_transport_send's movement outliving its call, its staged buffers pinned until
    moe_recv); two per process, the composed transport over the mock NCCL."""
    res = run_script(MOE_INFERENCE, n, local, prologue=False, args=["distinct"],
                     env={"JAXCOMM_EMULATE_CUDA": "1", "JAXCOMM_TIMEOUT_S": "60"}, timeout_s=300)
    assert_ok(res)
    for p in range(n):
        out = res.output[p]
        assert "CHECKED split-phase low-latency FP8 across processes" in out, res.format()
        assert "CHECKED bfloat16 combine across processes" in out, res.format()
        r = json.loads(next(ln for ln in out.splitlines() if ln.startswith("REPORT "))[len("REPORT "):])
        _assert_clean({p: r})
        routes = _routes(r)
        if local == 1:
            # (moe_recv only waits: no statistics row of its own.)
            for op in ("moe_transport", "moe_transport_send"):
                assert routes.get(op) == {IPC}, (op, routes)
        else:
            assert "moe_transport_send" not in routes and "moe_transport" not in routes, routes
            assert set(r["algorithms"]) == {NCCL}, routes


STAGING = """
from jaxcomm import _jaxcomm_emu as emu
mesh = Mesh(np.asarray(jax.devices()), ("x",))
sh = NamedSharding(mesh, P("x"))
x = jax.device_put(np.arange(2 * 6, dtype=np.float32).reshape(2, 6), sh)

def calls(f, *args):
    before = emu.emu_seam_stats()["calls"]
    out = jax.block_until_ready(f(*args))
    stats = emu.emu_seam_stats()
    return out, stats["calls"] - before, stats

# all_reduce reuses its operand's buffer (input_output_aliases): one staged block serves
# both, and the sum comes back into XLA:CPU's buffer.
reduce = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"),
                               out_specs=P("x")))
out, n, stats = calls(reduce, x)
np.testing.assert_array_equal(np.asarray(out), np.tile(np.asarray(x).sum(0), (2, 1)))
assert n == 2, n  # one call per device
operand, result = stats["last_call"]
assert not operand["result"] and result["result"], stats["last_call"]
assert operand["xla"] == result["xla"] and operand["staged"] == result["staged"], stats["last_call"]
assert operand["bytes"] == result["bytes"] == 6 * 4, stats["last_call"]
print("CHECKED aliased", flush=True)

# all_gather: operand and result apart, each in emulated device memory, not XLA:CPU's.
gather = jax.jit(jax.shard_map(lambda v: jaxcomm.all_gather(v, "x", tiled=True), mesh=mesh,
                               in_specs=P("x"), out_specs=P("x")))
out, n, stats = calls(gather, x)
np.testing.assert_array_equal(np.asarray(out).reshape(2, 2, 6)[0], np.asarray(x))
operand, result = stats["last_call"]
assert operand["staged"] != result["staged"] and result["bytes"] == 2 * operand["bytes"], stats["last_call"]
for b in stats["last_call"]:
    assert b["device_memory"] and b["staged"] != b["xla"], b
print("CHECKED apart", flush=True)

# The arena: one region per device so far (exported handles stay valid), nothing pinned.
# (XLA:CPU calls no custom call on zero-size arrays: the seam's zero-size blocks, a valid
# device address as XLA:GPU gives, are not reached from jax.)
assert stats["arenas"] == 2 and stats["pinned"] == 0, stats
assert emu.emu_strict_violations() == [] and emu.emu_sticky_error() == ""
print("CHECKED staging", flush=True)
"""


def test_seam_stages_xla_buffers_in_device_memory() -> None:
    """The seam hands a handler emulated device memory for XLA:CPU's buffers (what the
    CUDA IPC route exports), one block for an operand and the result aliased to it, and
    copies the results back to XLA:CPU."""
    res = run_script(STAGING, 1, 2, env={"JAXCOMM_EMULATE_CUDA": "1"}, timeout_s=120)
    assert_ok(res)
    for tag in ("aliased", "apart", "staging"):
        assert f"CHECKED {tag}" in res.output[0], res.format()


SHARED_NCCL = VISIBLE + PROLOGUE + """
mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(NPROC, LOCAL), ("p", "l"))
f = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, ("p", "l")), mesh=mesh,
                          in_specs=P(("p", "l")), out_specs=P(("p", "l"))))
x = jax.device_put(np.ones((NPROC * LOCAL, 3), np.float32), NamedSharding(mesh, P(("p", "l"))))
try:
    f(x)
except Exception as e:
    print("REFUSED", str(e).replace("\\n", " "), flush=True)
else:
    print("RAN", flush=True)
"""


def test_ranks_sharing_a_gpu_are_refused_nccl() -> None:
    """Two processes of 2 GPUs each, both on GPUs 0 and 1, in one group of 4: the group
    needs NCCL (two ranks per process), which refuses two ranks on one GPU; the route says
    so when the program is lowered, in every process."""
    res = run_script(SHARED_NCCL, 2, 2, prologue=False, args=["shared"],
                     env={"JAXCOMM_EMULATE_CUDA": "1"}, timeout_s=120)
    assert_ok(res)
    for p in range(2):
        line = next((ln for ln in res.output[p].splitlines() if ln.startswith(("REFUSED", "RAN"))), "")
        assert line.startswith("REFUSED"), res.format()
        assert "jaxcomm.all_reduce on emulated CUDA: two ranks of the group run on one GPU (" in line, line
        assert ("which NCCL refuses, and jaxcomm's own transport between them needs one rank per "
                "process, all on one host") in line, line
