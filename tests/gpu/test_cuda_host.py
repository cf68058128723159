"""The CUDA backend's host side, which runs (and is tested) without a GPU: registration
against the GPU plugin's contract, the typed attributes of every instantiate stage, the
route decision, the peer rendezvous of loop bodies, the cross-process records exchange
of the CUDA IPC route, and what Python prepares when a program is lowered."""

from __future__ import annotations

import collections
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxlib import xla_client

import jaxcomm
from jaxcomm import _jaxcomm
from jaxcomm._src import cuda_loopback, cuda_runtime, runtime
from jaxcomm._src.moe import fused
from jaxcomm._src.ops import common

needs_cuda_build = pytest.mark.skipif(not cuda_runtime.built_with_cuda(),
                                      reason="jaxcomm was built without the CUDA backend")


# ----------------------------------------------------------------- registration (defects 1, 5)

class FakeGpuPlugin:
    """Registers for platform "CUDA" as jaxlib's GPU plugin does (RegisterCustomCallTarget
    and RegisterCustomType in jaxlib/gpu/gpu_plugin_extension.cc, jax 0.10 to 0.11): any
    custom-call traits are refused, handlers must be PyCapsules (one, or a dict of stages),
    and a type is a dict with a `type_id` capsule and an optional `type_info` capsule."""

    STAGES = {"instantiate", "prepare", "initialize", "execute"}

    def __init__(self):
        self.targets: dict[str, dict] = {}
        self.types: list[str] = []

    def register_target(self, name, fn, platform, api_version, traits):
        if traits != 0:
            raise RuntimeError("UNIMPLEMENTED: The plugin does not support custom call traits.")
        if api_version != 1:
            raise RuntimeError(f"jaxcomm registers typed FFI handlers (api_version=1), got {api_version}")
        stages = fn if isinstance(fn, dict) else {"execute": fn}
        if not set(stages) <= self.STAGES:
            raise RuntimeError(f"unknown stages {set(stages) - self.STAGES}")
        for stage, capsule in stages.items():
            if type(capsule).__name__ != "PyCapsule":
                raise RuntimeError("INVALID_ARGUMENT: Custom call target registration requires "
                                   "handlers as PyCapsules")
        self.targets[name] = stages

    def register_type(self, name, type_registration):
        if not isinstance(type_registration, dict) or "type_id" not in type_registration:
            raise RuntimeError("INVALID_ARGUMENT: the type must be a dict with `type_id`")
        for value in type_registration.values():
            if type(value).__name__ != "PyCapsule":
                raise RuntimeError("INVALID_ARGUMENT: Custom type registration requires PyCapsules")
        self.types.append(name)


@pytest.fixture
def fake_plugin(monkeypatch):
    plugin = FakeGpuPlugin()
    monkeypatch.setitem(xla_client._custom_callback_handler, "CUDA", plugin.register_target)
    monkeypatch.setitem(xla_client._custom_type_id_handler, "CUDA", plugin.register_type)
    monkeypatch.setattr(cuda_runtime, "available", lambda: True)
    return plugin


def test_fake_plugin_refuses_what_the_real_one_refuses(fake_plugin):
    capsule = next(iter(_jaxcomm.cpu_targets().values()))["execute"]
    with pytest.raises(RuntimeError, match="does not support custom call traits"):
        jax.ffi.register_ffi_target("jaxcomm_test_traits", {"execute": capsule}, platform="CUDA",
                                    traits=xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE)
    with pytest.raises(RuntimeError, match="PyCapsules"):
        jax.ffi.register_ffi_target("jaxcomm_test_not_capsule", {"execute": 42}, platform="CUDA")


@needs_cuda_build
def test_registration_honours_the_gpu_plugin_contract(fake_plugin, monkeypatch):
    marks = collections.Counter()
    monkeypatch.setattr(jax.ffi, "register_ffi_target_as_batch_partitionable", lambda n: marks.update([n]))
    # A fresh once-per-name marker: as if the CPU registration had marked its targets.
    fresh = functools.cache(runtime.mark_batch_partitionable.__wrapped__)
    monkeypatch.setattr(runtime, "mark_batch_partitionable", fresh)
    for op in _jaxcomm.cpu_targets():
        fresh(runtime.target_name(op))
    cuda_runtime.ensure_registered.__wrapped__()
    names = {runtime.target_name(op) for op in _jaxcomm.cuda_targets()}
    local = {runtime.target_name(op) for op in _jaxcomm.cuda_local_targets()}
    assert local == {"jaxcomm_moe_fp8_quantize"}
    assert set(fake_plugin.targets) == names | local
    assert all(set(fake_plugin.targets[n]) == {"instantiate", "initialize", "execute"} for n in names)
    assert all(set(fake_plugin.targets[n]) == {"execute"} for n in local)
    assert fake_plugin.types == ["jaxcomm_cuda_instruction_state"]
    assert names <= set(marks) and all(n == 1 for n in marks.values()), marks


@needs_cuda_build
def test_cuda_targets_cover_every_op():
    # Exactly the op table's group ops marked for CUDA (host-only ones, e.g. ft.all_reduce,
    # moe_dispatch, the put ops, lower to jax.lax on GPU) and its local CUDA kernels.
    ops = dict(_jaxcomm.op_table()["ops"])
    cuda = {name for name, op in ops.items() if "cuda" in op["backends"]}
    assert set(_jaxcomm.cuda_targets()) == {name for name in cuda if not ops[name]["local"]}
    assert set(_jaxcomm.cuda_local_targets()) == {name for name in cuda if ops[name]["local"]}
    assert {"ft_all_reduce", "moe_dispatch"} <= set(_jaxcomm.cpu_targets()) - set(_jaxcomm.cuda_targets())


# ------------------------------------------------------------ typed attributes (defect 4)

@functools.cache
def _register_probe() -> None:
    """The CUDA instantiate stages, registered on CPU under jaxcomm_cudaprobe_<op> with an
    execute stage that reports what they parsed (as its error)."""
    runtime.ensure_registered()
    jax.ffi.register_ffi_type("jaxcomm_cuda_state_probe", _jaxcomm.cuda_state_type(), platform="cpu")
    for op, stages in _jaxcomm.cuda_attr_probe_targets().items():
        jax.ffi.register_ffi_target(f"jaxcomm_cudaprobe_{op}", stages, platform="cpu")


@pytest.fixture
def probe(monkeypatch):
    if not cuda_runtime.built_with_cuda():
        pytest.skip("jaxcomm was built without the CUDA backend")
    if cuda_runtime.gpu_backend_present():
        pytest.skip("the probe registers the CUDA state type on CPU; the GPU tests run the real thing")
    _register_probe()
    monkeypatch.setattr(runtime, "target_name", lambda op: f"jaxcomm_cudaprobe_{op}")
    return Mesh(np.array(jax.devices("cpu")[:2]), ("x",))


def probe_error(mesh, f, *args) -> str:
    """What the CUDA instantiate stage parsed from f's custom call (its probe error)."""
    placed = [jax.device_put(a, NamedSharding(mesh, P("x"))) for a in args]
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * len(args), out_specs=P("x"),
                              check_vma=False))
    with pytest.raises(Exception) as info:
        jax.block_until_ready(g(*placed))
    return str(info.value)


PROBES = {
    "all_reduce": (lambda v: jaxcomm.all_reduce(v, "x", op="max"), "reduce_op=max"),
    "all_gather": (lambda v: jaxcomm.all_gather(v, "x", axis=1, tiled=True), "axis_index=1"),
    "reduce_scatter": (lambda v: jaxcomm.reduce_scatter(v, "x", scatter_dimension=1, tiled=True, op="min"),
                       "reduce_op=min scatter_dimension=1"),
    "all_to_all": (lambda v: jaxcomm.all_to_all(v, "x", 1, 2, tiled=True), "split_axis=1 concat_axis=2"),
    "ppermute": (lambda v: jaxcomm.ppermute(v, "x", [(0, 1), (1, 0)]), "sources=[1 0]"),
    "broadcast": (lambda v: jaxcomm.broadcast(v, "x", root=1), "root=1"),
    "ragged_all_to_all": (lambda v: jaxcomm.ragged_all_to_all(
        v[0], v[0], jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32), jnp.zeros(2, jnp.int32),
        jnp.ones(2, jnp.int32), axis_name="x")[None], "mode=0 src_rows=4 dst_rows=4"),
    "moe_transport": (lambda v: fused.transport(
        fused.REDUCE, v[0].reshape(4, -1), jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32),
        "x", w=jnp.ones((2, 1)))[None], "mode=2"),
    "moe_transport_send": (lambda v: fused.transport_send(
        fused.GATHER_SPARSE, v[0].reshape(2, -1), jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32),
        "x", rows=4)[0][None], "mode=4"),
    "moe_recv": (lambda v: fused.recv(
        v[0].reshape(4, -1), jnp.zeros((fused.STATUS_WORDS,), jnp.int32), [], "x",
        fused=fused.fused_key("transport", mode=fused.REDUCE))[0][None], ""),
}


@pytest.mark.parametrize("op", sorted(PROBES))
def test_every_op_attributes_bind_typed_in_the_cuda_instantiate_stage(probe, op):
    f, parsed = PROBES[op]
    x = np.arange(2 * 4 * 2 * 6, dtype=np.float32).reshape(2, 4, 2, 6)
    msg = probe_error(probe, f, x)
    assert f"jaxcomm CUDA attribute probe: op={op} " in msg, msg
    assert parsed in msg and "groups=[0 1]" in msg, msg


def _handmade_all_reduce(mesh, **attrs):
    """An all_reduce custom call with attributes written here, not by the lowering."""
    common_attrs = dict(call_site="test.py:1", axis="x", timeout_ms=1000,
                        groups=np.array([0, 1], np.int64), group_size=2,
                        partition_devices=np.array([0, 0, 0, 1], np.int64))
    common_attrs.update(attrs)

    def f(v):
        return jax.ffi.ffi_call("jaxcomm_cudaprobe_all_reduce", jax.ShapeDtypeStruct(v.shape, v.dtype))(
            v, **common_attrs)
    return probe_error(mesh, f, np.ones((2, 3), np.float32))


def test_unknown_reduction_code_is_an_error(probe):
    msg = _handmade_all_reduce(probe, reduce_op=7)
    assert "unknown reduction code 7" in msg and "test.py:1" in msg, msg
    assert "probe" not in msg  # refused at instantiation, before any execute


def test_misspelled_or_extra_attribute_is_an_error(probe):
    msg = _handmade_all_reduce(probe, reduce_opp=3)
    assert "reduce_op" in msg and "probe" not in msg, msg
    msg = _handmade_all_reduce(probe, reduce_op=3, extra=1)
    assert "Wrong number of attributes" in msg, msg


# ------------------------------------------------------------------- loops (defect 2)

@needs_cuda_build
def test_peer_rounds_of_a_loop_body_never_meet_each_other():
    # Rank 0 races into the next iteration while its peers still leave the previous one;
    # keyed by run id alone, it met the previous round ("joined the same call twice").
    assert _jaxcomm.cuda_test_peer_rounds(3, 300, 10000) == ["", "", ""]


@needs_cuda_build
def test_peer_round_names_the_rank_that_never_arrives():
    errors = _jaxcomm.cuda_test_peer_rounds(3, 2, 300, absent=1)
    for r in (0, 2):
        assert "timed out after 0.3 s" in errors[r] and "waiting for ranks [1] (partitions [0]), which never " \
            "arrived at this call; 2 of 3 ranks did" in errors[r], errors


# ------------------------------------------------------------ NCCL deadlines (defect 3)

@needs_cuda_build
def test_nccl_call_past_its_deadline_aborts_the_communicator():
    first, aborted, second = _jaxcomm.cuda_test_nccl_call("hang", 200)
    assert "jaxcomm.all_reduce over axis x" in first and "call site test.py:1, execution #3" in first, first
    assert "still in progress in NCCL after" in first and "timeout_s / JAXCOMM_TIMEOUT_S" in first, first
    assert aborted
    assert "was aborted earlier" in second and "still in progress" in second, second


@needs_cuda_build
def test_nccl_call_error_aborts_and_names_the_call():
    first, aborted, second = _jaxcomm.cuda_test_nccl_call("error", 5000)
    assert "ncclAllReduce (group nccl:0/0,1/0, rank 1 of 2) failed: fake NCCL error" in first, first
    assert aborted and "aborted earlier" in second


@needs_cuda_build
def test_nccl_call_in_progress_a_while_then_done_is_fine():
    first, aborted, second = _jaxcomm.cuda_test_nccl_call("slow", 5000)
    assert (first, aborted) == ("", False)


# --------------------------------------------------------------------- routes (item 3)

def members(*specs):
    """(process, ordinal, host, device) tuples."""
    return [tuple(s) for s in specs]


ROUTES = [
    ("all_reduce", members((0, 0, "h", "g0")), 0, "cuda copy", ""),
    ("all_reduce", members((0, 0, "h", "g0"), (0, 1, "h", "g1")), 0, "nccl", ""),
    ("ppermute", members((0, 0, "h", "g0"), (0, 1, "h", "g1")), 0, "cuda peers in process", ""),
    ("moe_transport", members((0, 0, "", ""), (0, 1, "", "")), 0, "cuda peers in process", ""),
    # One process per GPU on one host: own kernels through CUDA IPC, NCCL for the rest.
    ("ppermute", members((0, 0, "h", "g0"), (1, 0, "h", "g1")), 1, "cuda ipc across processes", ""),
    ("moe_transport", members((0, 0, "h", "g0"), (1, 0, "h", "g1")), 0, "cuda ipc across processes", ""),
    ("all_gather", members((0, 0, "h", "g0"), (1, 0, "h", "g1")), 0, "nccl", ""),
    # Several processes sharing one GPU: NCCL refuses it; every op takes CUDA IPC.
    ("all_reduce", members((0, 0, "h", "g0"), (1, 0, "h", "g0")), 0, "cuda ipc across processes", ""),
    ("all_to_all", members((0, 0, "h", "g0"), (1, 0, "h", "g0"), (2, 0, "h", "g0")), 2,
     "cuda ipc across processes", ""),
    # Across hosts: NCCL; the MoE transport has no route there.
    ("ppermute", members((0, 0, "a", "g0"), (1, 0, "b", "g1")), 0, "nccl", ""),
    ("moe_transport", members((0, 0, "a", "g0"), (1, 0, "b", "g1")), 0, "nccl", "one host"),
    ("moe_transport", members((0, 0, "h", "g0"), (0, 1, "h", "g1"), (1, 0, "h", "g2")), 0, "nccl", "one rank each"),
    # A shared GPU that the peer route cannot serve: an error, not a NCCL failure.
    ("all_reduce", members((0, 0, "h", "g0"), (0, 1, "h", "g1"), (1, 0, "h", "g0")), 0, "nccl", "NCCL refuses"),
    ("all_reduce", members((0, 0, "", ""), (1, 0, "", "")), 0, "nccl", ""),  # nothing published
]


@pytest.mark.parametrize("op,group,me,route,error", ROUTES)
def test_route_of_each_layout(op, group, me, route, error):
    name, why = _jaxcomm.cuda_route(op, group, me)
    assert name == route
    assert (error in why) if error else why == "", why


def test_one_rank_nccl_routes_a_lone_rank_through_nccl_where_nccl_has_the_op():
    lone = members((0, 0, "h", "g0"))
    assert _jaxcomm.cuda_route("all_reduce", lone, 0, True)[0] == "nccl"
    assert _jaxcomm.cuda_route("ppermute", lone, 0, True)[0] == "nccl"
    assert _jaxcomm.cuda_route("moe_transport", lone, 0, True)[0] == "cuda copy"
    assert _jaxcomm.cuda_route("ragged_all_to_all", lone, 0, True)[0] == "cuda copy"


# -------------------------------------------------------- lowering across processes

def test_partition_devices_fill_other_processes_ordinals():
    dev = lambda i, p, hw: types.SimpleNamespace(id=i, process_index=p, local_hardware_id=hw)
    ctx = types.SimpleNamespace(mesh=types.SimpleNamespace(devices=np.array([dev(0, 0, 0), dev(1, 0, 1),
                                                                             dev(2, 1, None), dev(3, 1, None)])))
    infos = {1: dict(host="h", devices=[dict(id=2, ordinal=0, uuid="u2"), dict(id=3, ordinal=1, uuid="u3")])}
    assert cuda_runtime.partition_devices(ctx).tolist() == [0, 0, 0, 1, 1, -1, 1, -1]
    pd = cuda_runtime.partition_devices(ctx, infos)
    assert pd.tolist() == [0, 0, 0, 1, 1, 0, 1, 1]
    # Both processes now name the group of partitions (1, 3) alike.
    assert cuda_runtime.group_key((1, 3), pd) == "nccl:0/1,1/1"


def test_prepare_lowering_links_ipc_groups_and_exchanges_nccl_ids(monkeypatch):
    dev = lambda i, p: types.SimpleNamespace(id=i, process_index=p, local_hardware_id=0 if p == 0 else None)
    ctx = types.SimpleNamespace(mesh=types.SimpleNamespace(devices=np.array([dev(0, 0), dev(1, 1), dev(2, 2)])))
    infos = {0: dict(host="h", devices=[dict(id=0, ordinal=0, uuid="g0")]),
             1: dict(host="h", devices=[dict(id=1, ordinal=0, uuid="g1")]),
             2: dict(host="other", devices=[dict(id=2, ordinal=0, uuid="g2")])}
    monkeypatch.setattr(cuda_runtime.jax, "process_count", lambda: 3)
    monkeypatch.setattr(cuda_runtime.jax, "process_index", lambda: 0)
    monkeypatch.setattr(cuda_runtime, "process_info", lambda procs, t, flavor: infos)
    linked, exchanged = [], []
    from jaxcomm._src import bootstrap
    monkeypatch.setattr(bootstrap, "ensure_linked", lambda procs: linked.append(set(procs)))
    monkeypatch.setattr(cuda_runtime, "_exchange_unique_id", lambda g, pd, t, flavor: exchanged.append(tuple(g)))
    monkeypatch.setattr(cuda_runtime, "one_rank_nccl", lambda: False)
    pd = cuda_runtime.prepare_lowering("ppermute", ((0, 1), (2,)), ctx, 1000)
    assert pd.tolist() == [0, 0, 1, 0, 2, 0]
    assert linked == [{0, 1}] and exchanged == []
    cuda_runtime.prepare_lowering("ppermute", ((0, 2), (1,)), ctx, 1000)  # across hosts
    assert exchanged == [(0, 2)]
    with pytest.raises(RuntimeError, match="one host"):
        cuda_runtime.prepare_lowering("moe_transport", ((0, 2), (1,)), ctx, 1000)


def test_unique_ids_travel_from_rank0_process(monkeypatch):
    """The process holding a group's rank 0 makes its NCCL id and publishes it; the other
    processes fetch it."""
    store: dict[str, bytes] = {}

    class Client:
        def key_value_set_bytes(self, key, value):
            store[key] = value

        def blocking_key_value_get_bytes(self, key, timeout_ms):
            assert timeout_ms == 1000
            return store[key]

    given: dict[str, bytes] = {}
    fake = types.SimpleNamespace(cuda_nccl_unique_id=lambda: b"u" * 128,
                                 cuda_set_unique_id=lambda k, v: given.__setitem__(k, v))
    monkeypatch.setattr(cuda_runtime, "_kv_client", lambda: Client())
    monkeypatch.setattr(cuda_runtime, "_jaxcomm", fake)
    monkeypatch.setattr(cuda_runtime, "_exchanged", set())
    pd = np.array([0, 0, 0, 1, 1, 0, 1, 1])  # partitions 0, 1 on process 0; 2, 3 on process 1
    monkeypatch.setattr(cuda_runtime.jax, "process_index", lambda: 0)
    cuda_runtime._exchange_unique_id((0, 2), pd, 1000)
    assert given == {"nccl:0/0,1/0": b"u" * 128} and len(store) == 1
    given.clear()
    monkeypatch.setattr(cuda_runtime, "_exchanged", set())
    monkeypatch.setattr(cuda_runtime.jax, "process_index", lambda: 1)
    fake.cuda_nccl_unique_id = lambda: pytest.fail("only rank 0's process makes the id")
    cuda_runtime._exchange_unique_id((0, 2), pd, 1000)
    assert given == {"nccl:0/0,1/0": b"u" * 128}


# --------------------------------------------------------------------------- misc

def test_smallest_capacity_drops_nothing():
    ids = cuda_loopback.random_routing(4, 32, 3, 16, seed=3)
    assert (np.sort(ids, -1)[..., 1:] != np.sort(ids, -1)[..., :-1]).all()  # distinct
    total = cuda_loopback.expert_totals(ids, 16)
    assert total.sum() == ids.size
    assert cuda_loopback.smallest_capacity(ids, 16, True) == total.max()
    assert cuda_loopback.smallest_capacity(ids, 16, False) == total.reshape(4, 4).sum(1).max()


def test_reference_y_skips_dropped_slots():
    x = np.ones((1, 2, 3), np.float32)
    dest = np.array([[[0, -1], [-1, -1]]], np.int32)
    w = np.array([[[0.5, 2.0], [1.0, 1.0]]], np.float32)
    np.testing.assert_array_equal(cuda_loopback.reference_y(x, dest, w)[0, :, 0], [0.5, 0.0])


def test_no_gpu_means_no_cuda_platform(monkeypatch):
    monkeypatch.setattr(cuda_runtime, "available", lambda: False)
    assert runtime.served_platforms() == ("cpu",)


@needs_cuda_build
def test_cuda_device_count_without_driver_is_zero_not_a_crash():
    assert _jaxcomm.cuda_device_count() >= 0


def test_group_key_mirrors_cpp():
    pd = np.array([0, 0, 0, 1, 1, 0, 1, 1], dtype=np.int64)
    assert cuda_runtime.group_key((0, 2), pd) == "nccl:0/0,1/0"
    assert cuda_runtime.group_key((3, 1), pd) == "nccl:1/1,0/1"


def test_nccl_path_override_and_absence(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXCOMM_NCCL_LIBRARY", str(tmp_path / "libnccl.so.2"))
    assert cuda_runtime.nccl_library_path() == str(tmp_path / "libnccl.so.2")
    monkeypatch.delenv("JAXCOMM_NCCL_LIBRARY")
    path = cuda_runtime.nccl_library_path()
    assert path is None or path.endswith((".so.2", ".so"))


def test_missing_nccl_is_a_clear_error():
    if not cuda_runtime.built_with_cuda() or cuda_runtime.nccl_library_path():
        pytest.skip("needs a CUDA build without NCCL installed")
    with pytest.raises(RuntimeError, match="nvidia-nccl-cu13"):
        _jaxcomm.cuda_nccl_version()


def test_use_xla_on_gpu_routes_what_cuda_lacks(monkeypatch):
    monkeypatch.setattr(cuda_runtime, "available", lambda: True)
    monkeypatch.setattr(common.jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("JAXCOMM_BACKEND", raising=False)
    assert not common.use_xla("all_reduce", np.float32)
    assert common.use_xla("all_reduce", np.int16)            # NCCL has no 16-bit integers
    assert not common.use_xla("all_gather", np.int16)        # pure data movement is fine
    assert not common.use_xla("ragged_all_to_all", np.float32, group_size=1)
    assert common.use_xla("ragged_all_to_all", np.float32, group_size=4)
    assert not common.use_xla("moe_transport", np.float32, group_size=2)  # peers, one process
    monkeypatch.setattr(cuda_runtime.jax, "process_count", lambda: 2)
    monkeypatch.setattr(cuda_runtime, "_one_gpu_per_process_on_one_host", lambda flavor: True)
    assert not common.use_xla("moe_transport", np.float32, group_size=2)  # CUDA IPC
    monkeypatch.setattr(cuda_runtime, "_one_gpu_per_process_on_one_host", lambda flavor: False)
    assert common.use_xla("moe_transport", np.float32, group_size=2)      # composed transport
    monkeypatch.setattr(cuda_runtime, "available", lambda: False)
    assert common.use_xla("all_reduce", np.float32)


# -------------------------------------------------- the CUDA IPC route's records exchange

EXCHANGE = """
from jaxcomm import _jaxcomm
from jaxcomm._src import bootstrap
other = 1 - RANK
bootstrap.ensure_linked([other])
got = []
for seq in (1, 2, 3):
    mine = bytes([RANK, seq]) * 40
    got.append(list(_jaxcomm.cuda_test_exchange_records(0xC0DA, seq, [other], mine, 20000)[0][:2]))
late = ""
if RANK == 0:  # process 1 never comes to round 4
    try:
        _jaxcomm.cuda_test_exchange_records(0xC0DA, 4, [other], bytes(80), 500)
    except RuntimeError as e:
        late = str(e)
import json
print("RESULT", json.dumps(dict(got=got, late=late)), flush=True)
"""


@needs_cuda_build
def test_records_exchange_between_processes():
    from mp_util import assert_ok, results, run_script
    res = run_script(EXCHANGE, 2)
    assert_ok(res)
    out = results(res)
    for rank in (0, 1):
        assert out[rank]["got"] == [[1 - rank, seq] for seq in (1, 2, 3)], out
    assert out[0]["late"].startswith("timed out: ") and "process 1" in out[0]["late"], out[0]["late"]
