"""The CUDA backend's host-side logic, which runs (and is tested) without a GPU."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from jaxcomm import _jaxcomm
from jaxcomm._src import cuda_loopback, cuda_runtime, runtime
from jaxcomm._src.ops import common


def test_build_has_cuda_where_nvcc_is():
    # AUTO builds the CUDA backend whenever nvcc is found; CI relies on this to
    # compile and link it (a build that silently dropped it would pass CPU tests).
    if shutil.which("nvcc") and os.environ.get("JAXCOMM_EXPECT_CUDA", "1") == "1":
        assert cuda_runtime.built_with_cuda()


def test_cuda_targets_cover_every_op():
    if not cuda_runtime.built_with_cuda():
        pytest.skip("built without CUDA")
    cpu = set(_jaxcomm.cpu_targets())
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
