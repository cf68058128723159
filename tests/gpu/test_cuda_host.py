"""The CUDA backend's host-side logic, which runs (and is tested) without a GPU."""

from __future__ import annotations

import types

import numpy as np
import pytest

from jaxcomm import _jaxcomm
from jaxcomm._src import cuda_loopback, cuda_runtime, runtime
from jaxcomm._src.ops import common


def test_cuda_targets_cover_every_op():
    if not cuda_runtime.built_with_cuda():
        pytest.skip("built without CUDA")
    # ft.all_reduce is the host backend's (its tolerance lives in the cross-process
    # exchange); on GPU it lowers to jax.lax.psum.
    cpu = set(_jaxcomm.cpu_targets()) - {"ft_all_reduce"}
    cuda = _jaxcomm.cuda_targets()
    assert set(cuda) == cpu
    for op, (stages, graph_ok) in cuda.items():
        assert set(stages) == {"instantiate", "initialize", "execute"}, op
        assert isinstance(graph_ok, bool)


def test_no_gpu_means_no_cuda_platform(monkeypatch):
    monkeypatch.setattr(cuda_runtime, "available", lambda: False)
    assert runtime.served_platforms() == ("cpu",)


def test_cuda_device_count_without_driver_is_zero_not_a_crash():
    if not cuda_runtime.built_with_cuda():
        pytest.skip("built without CUDA")
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


def test_missing_nccl_is_a_clear_error(monkeypatch):
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
    assert common.use_xla("moe_transport", np.float32, group_size=2)
    monkeypatch.setattr(cuda_runtime, "available", lambda: False)
    assert common.use_xla("all_reduce", np.float32)


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


def test_cuda_registration_code_runs_without_a_gpu(monkeypatch):
    """Registration for platform CUDA only queues in xla_client without a GPU plugin, so
    the Python side of it (capsules, traits, type) can be exercised here."""
    if not cuda_runtime.built_with_cuda():
        pytest.skip("built without CUDA")
    monkeypatch.setattr(cuda_runtime, "available", lambda: True)
    cuda_runtime.ensure_registered.__wrapped__()


def test_unique_ids_travel_from_rank0_process(monkeypatch):
    """The process holding a group's rank 0 makes its NCCL id and publishes it; the other
    processes fetch it; groups inside one process take no part (ids made locally)."""
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
    monkeypatch.setattr(cuda_runtime.jax, "process_index", lambda: 0)
    pd = np.array([0, 0, 0, 1, 1, 0, 1, 1])  # partitions 0, 1 on process 0; 2, 3 on process 1
    spanning = {"nccl:0/0,1/0", "nccl:0/1,1/1"}
    cuda_runtime.exchange_unique_ids([(0, 2), (1, 3), (0, 1)], pd, 1000)
    assert set(given) == spanning and len(store) == 2
    given.clear()
    monkeypatch.setattr(cuda_runtime, "_exchanged", set())
    monkeypatch.setattr(cuda_runtime.jax, "process_index", lambda: 1)
    fake.cuda_nccl_unique_id = lambda: pytest.fail("only rank 0's process makes the id")
    cuda_runtime.exchange_unique_ids([(0, 2), (1, 3), (2, 3)], pd, 1000)
    assert given == {k: b"u" * 128 for k in spanning}
