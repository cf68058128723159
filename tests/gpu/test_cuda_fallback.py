"""Issue 30, defect 5: jaxcomm's CUDA backend takes over platform CUDA only where its
handlers can run: the CUDA runtime it was built with (linked statically) sees a device and
the driver supports that runtime's major. Elsewhere its ops lower to jax.lax, with one log
line saying why. The CUDA probes are faked here; `cuda_versions` itself is checked for
shape on the real module."""

from __future__ import annotations

import logging
import types

import pytest

from jaxcomm import _jaxcomm
from jaxcomm._src import cuda_runtime, runtime


def fake_module(devices: int, runtime_version: int, driver: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        has_cuda=lambda: True, cuda_device_count=lambda: devices,
        cuda_versions=lambda: {"built": runtime_version, "runtime": runtime_version, "driver": driver})


@pytest.fixture
def gpu_process(monkeypatch):
    """A process with a GPU backend whose CUDA probes `fake(...)` answers."""
    monkeypatch.setattr(cuda_runtime, "gpu_backend_present", lambda: True)
    cuda_runtime.available.cache_clear()

    def fake(devices: int, runtime_version: int, driver: int) -> None:
        monkeypatch.setattr(cuda_runtime, "_jaxcomm", fake_module(devices, runtime_version, driver))

    yield fake
    cuda_runtime.available.cache_clear()


def jaxcomm_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "jaxcomm" and r.levelno == logging.WARNING]


def test_usable_device_takes_over_the_platform(gpu_process, caplog):
    gpu_process(devices=1, runtime_version=13000, driver=13010)
    with caplog.at_level(logging.WARNING, logger="jaxcomm"):
        assert cuda_runtime.available()
        assert "gpu" in runtime.served_platforms()
    assert jaxcomm_warnings(caplog) == []


@pytest.mark.parametrize("devices,driver,why", [
    (0, 12080, "the driver supports CUDA 12.8, older than the CUDA 13.0 runtime jaxcomm was built with"),
    (1, 12090, "the driver supports CUDA 12.9, older than the CUDA 13.0 runtime jaxcomm was built with"),
    (0, 13000, "the CUDA 13.0 runtime sees no device (driver for CUDA 13.0)"),
    (0, 0, "no CUDA driver"),
])
def test_unusable_device_falls_back_to_lax_with_one_log_line(gpu_process, caplog, devices, driver, why):
    gpu_process(devices=devices, runtime_version=13000, driver=driver)
    with caplog.at_level(logging.WARNING, logger="jaxcomm"):
        assert not cuda_runtime.available()
        assert not cuda_runtime.available()
        assert "gpu" not in runtime.served_platforms()
    assert jaxcomm_warnings(caplog) == [
        f"jaxcomm: not using its CUDA backend ({why}); jaxcomm ops on GPU lower to jax.lax"]


def test_newer_driver_minor_and_major_are_usable(gpu_process):
    for driver in (13000, 13020, 14000):
        cuda_runtime.available.cache_clear()
        gpu_process(devices=2, runtime_version=13010, driver=driver)
        assert cuda_runtime.available(), driver


def test_no_gpu_backend_is_silent(monkeypatch, caplog):
    monkeypatch.setattr(cuda_runtime, "gpu_backend_present", lambda: False)
    monkeypatch.setattr(cuda_runtime, "_jaxcomm", fake_module(0, 13000, 0))
    cuda_runtime.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="jaxcomm"):
            assert not cuda_runtime.available()
        assert jaxcomm_warnings(caplog) == []
    finally:
        cuda_runtime.available.cache_clear()


@pytest.mark.skipif(not cuda_runtime.built_with_cuda(), reason="jaxcomm was built without the CUDA backend")
def test_cuda_versions_of_the_real_module():
    versions = _jaxcomm.cuda_versions()
    assert set(versions) == {"built", "runtime", "driver"}
    assert versions["built"] >= 12000
    assert versions["runtime"] in (0, versions["built"])  # the static runtime is the one built with
    assert versions["driver"] >= 0
