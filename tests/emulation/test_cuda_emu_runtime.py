"""The emulated CUDA runtime (ffi/cuda_emu/runtime/) against the runtime's documented rules,
and the SIMT layer (ffi/cuda_emu/simt/) against CUDA's execution model.

The cases live in tests/emulation/cpp/runtime_test.cc and run in a test binary built here
with the host C++ compiler alone (no CUDA toolkit): streams asynchronous and in order,
events across streams and processes, the last-error rules (cudaGetLastError clears,
cudaPeekAtLastError does not, an event poll's cudaErrorNotReady stays), sticky errors,
poisoned fresh memory, launch and pitch limits, the legacy stream's implicit ordering,
peer access refused to the device itself, CUDA IPC between two processes (and handles that
name one block or event for good, descriptors being reused), the devices a
process sees under CUDA_VISIBLE_DEVICES (count, and each one's physical identity), and the strict
checks (a wait on an event never recorded, freeing memory queued work uses, a host read on
the legacy stream racing a non-blocking stream's queued work, an IPC mapping used after it
was closed). The SIMT cases (tests/emulation/cpp/simt_test.cu, rewritten by
host_cu.py as the build rewrites kernels.cu): barriers and dynamic shared memory, warp
shuffles, ballots and matches, __syncthreads_count/_and, atomics, refused launch
configurations, threads that returned counting as arrived, and a real deadlock reported
as a sticky launch failure instead of a hang.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(glob.glob(str(ROOT / "ffi/cuda_emu/runtime/*.cc")))
INCLUDES = [f"-I{ROOT / 'ffi'}", f"-I{ROOT / 'ffi/cuda_emu/runtime/include'}",
            f"-I{ROOT / 'ffi/cuda_emu/simt/include'}", f"-I{ROOT / 'tests/emulation/cpp'}"]
SIMT_CASES = ["launches", "warps", "barriers"]
CASES = ["stream_order", "last_error", "sticky", "poison", "launch_limits", "events_across_streams",
         "legacy_stream", "peer_access", "strict_never_recorded", "strict_free_in_use",
         "strict_host_read_unsynchronized", "ipc", "visible_devices",
         "ipc_handles_unique"]


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    return cxx


@pytest.fixture(scope="module")
def runtime_test(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cuda_emu") / "runtime_test"
    subprocess.run([_compiler(), "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread", *INCLUDES,
                    *SOURCES, str(ROOT / "tests/emulation/cpp/runtime_test.cc"), "-o", str(out)],
                   check=True)
    return out


@pytest.fixture(scope="module")
def simt_test(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("cuda_emu_simt")
    source = work / "simt_test.cc"
    subprocess.run([sys.executable, str(ROOT / "ffi/cuda_emu/simt/host_cu.py"),
                    str(ROOT / "tests/emulation/cpp/simt_test.cu"), str(source)], check=True)
    out = work / "simt_test"
    subprocess.run([_compiler(), "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread", *INCLUDES,
                    *SOURCES, str(ROOT / "ffi/cuda_emu/simt/simt.cc"), str(source), "-o", str(out)],
                   check=True)
    return out


def _run_case(binary: Path, case: str) -> None:
    r = subprocess.run([str(binary), case], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def _listed(binary: Path) -> list[str]:
    return sorted(subprocess.run([str(binary), "--list"], check=True, capture_output=True,
                                 text=True).stdout.split())


def test_cases_listed(runtime_test: Path, simt_test: Path) -> None:
    assert _listed(runtime_test) == sorted(CASES)
    assert _listed(simt_test) == sorted(SIMT_CASES)


@pytest.mark.parametrize("case", CASES)
def test_runtime(runtime_test: Path, case: str) -> None:
    _run_case(runtime_test, case)


#: CUDA_VISIBLE_DEVICES (None: unset) -> what the process sees: cudaGetDeviceCount's error
#: (0 success, 100 cudaErrorNoDevice), the count, and per ordinal the physical device, its
#: PCI bus id and its UUID's last byte (both the physical device's, as on a GPU).
VISIBLE = {
    None: "0 8 [0,1,2,3,4,5,6,7] [0,1,2,3,4,5,6,7] [0,1,2,3,4,5,6,7]",
    "3": "0 1 [3] [3] [3]",
    "5,2": "0 2 [5,2] [5,2] [5,2]",
    " 1 , 6 ": "0 2 [1,6] [1,6] [1,6]",
    "0,1,9,2": "0 2 [0,1] [0,1] [0,1]",     # the list ends at an index out of range
    "4,x,5": "0 1 [4] [4] [4]",             # ... at an entry that is not an index
    "2,3,2,4": "0 2 [2,3] [2,3] [2,3]",     # ... at a repeat
    "": "100 0 [] [] []",                   # set but empty: no device
    "-1": "100 0 [] [] []",
}


@pytest.mark.parametrize("visible", list(VISIBLE), ids=lambda v: "unset" if v is None else repr(v))
def test_cuda_visible_devices(runtime_test: Path, visible: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    r = subprocess.run([str(runtime_test), "visible_devices"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == VISIBLE[visible]


@pytest.mark.parametrize("case", SIMT_CASES)
def test_simt(simt_test: Path, case: str) -> None:
    _run_case(simt_test, case)
