"""Issue 30, defects 3 and 4: what installing and building the CUDA backend depends on.

Defect 4: ffi/cuda/ipc.cc called cudaGetDriverEntryPointByVersion, which CUDA has only
from 12.5, so CUDA 12.0-12.4 failed the build. Here nvcc compiles ipc.cc against this
machine's toolkit with a shim cuda_runtime_api.h that pretends CUDA 12.4: CUDART_VERSION
12040 and no cudaGetDriverEntryPointByVersion (any use is an undeclared name)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import jax.ffi
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH")

CUDA_12_4_SHIM = """\
#pragma once
#include_next <cuda_runtime_api.h>
#undef CUDART_VERSION
#define CUDART_VERSION 12040
#define cudaGetDriverEntryPointByVersion cuda_12_4_has_no_cudaGetDriverEntryPointByVersion
"""


def compile_ipc(tmp_path: pathlib.Path, shim: str | None) -> subprocess.CompletedProcess:
    includes = []
    if shim is not None:
        (tmp_path / "shim").mkdir()
        (tmp_path / "shim" / "cuda_runtime_api.h").write_text(shim)
        includes = ["-I", str(tmp_path / "shim")]
    cmd = [NVCC, "-std=c++17", "-c", str(ROOT / "ffi" / "cuda" / "ipc.cc"), "-o", str(tmp_path / "ipc.o"),
           *includes, "-I", str(ROOT / "ffi"), "-I", jax.ffi.include_dir()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@needs_nvcc
def test_ipc_compiles_with_cuda_12_4(tmp_path):
    done = compile_ipc(tmp_path, CUDA_12_4_SHIM)
    assert done.returncode == 0, done.stderr


@needs_nvcc
def test_the_shim_really_hides_the_12_5_call(tmp_path):
    (tmp_path / "probe.cc").write_text(
        "#include <cuda_runtime_api.h>\n"
        "static_assert(CUDART_VERSION == 12040);\n"
        "void* f() { void* p; cudaDriverEntryPointQueryResult s;\n"
        "  cudaGetDriverEntryPointByVersion(\"x\", &p, 12000, cudaEnableDefault, &s); return p; }\n")
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "cuda_runtime_api.h").write_text(CUDA_12_4_SHIM)
    done = subprocess.run([NVCC, "-c", str(tmp_path / "probe.cc"), "-o", str(tmp_path / "probe.o"),
                           "-I", str(tmp_path / "shim")], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "cuda_12_4_has_no_cudaGetDriverEntryPointByVersion" in done.stderr


def test_no_extra_pins_an_nccl_of_one_cuda_major():
    # Defect 3: nvidia-nccl-cu12 and -cu13 install the same nvidia/nccl/lib/libnccl.so.2,
    # which jax's CUDA plugin loads for either major; an extra naming one replaced the
    # NCCL of a `jax[cuda12]` install with the CUDA 13 one.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for name, requirements in project.get("optional-dependencies", {}).items():
        for requirement in requirements:
            assert not requirement.startswith("nvidia-nccl"), (name, requirement)
    assert "cuda" not in project.get("optional-dependencies", {})


def configure(tmp_path: pathlib.Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Configures jaxcomm's top-level CMake project (as pip's scikit-build-core does: the
    extension itself is a sub-build, not configured here)."""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake on PATH")
    cmd = [cmake, "-S", str(ROOT), "-B", str(tmp_path / "build"), "-DSKBUILD=ON",
           f"-DPython_EXECUTABLE={sys.executable}", f"-DXLA_FFI_INCLUDE_DIR={jax.ffi.include_dir()}",
           "-Dnanobind_ROOT=unused-by-the-top-level-project", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@needs_nvcc
def test_auto_falls_back_to_cpu_only_when_the_toolkit_cannot_build_it(tmp_path):
    # An architecture this nvcc cannot compile for stands for any toolkit that cannot build
    # the backend (CUDA < 12, a broken install, a compiler error).
    done = configure(tmp_path, "-DJAXCOMM_CUDA=AUTO", "-DCMAKE_CUDA_ARCHITECTURES=5")
    assert done.returncode == 0, done.stderr
    assert "jaxcomm CUDA backend: OFF (JAXCOMM_CUDA=AUTO)" in done.stdout
    assert "cannot build the CUDA\n  backend, so this is a CPU-only build" in done.stderr


@needs_nvcc
def test_configure_warns_when_jax_cuda_plugin_is_another_major(tmp_path):
    nvcc_major = re.search(r"release (\d+)\.", subprocess.run([NVCC, "--version"], capture_output=True,
                                                              text=True).stdout).group(1)
    other = "12" if nvcc_major == "13" else "13"
    plugin = tmp_path / "site" / f"jax_cuda{other}_plugin"
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text("")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    done = configure(tmp_path, "-DJAXCOMM_CUDA=ON", env=env)
    assert done.returncode == 0, done.stderr
    message = " ".join(done.stderr.split())
    assert (f"the CUDA backend is built with CUDA {nvcc_major}" in message
            and f"jax CUDA plugin is for CUDA {other}" in message), done.stderr
