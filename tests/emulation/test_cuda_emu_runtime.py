"""The emulated CUDA runtime (ffi/cuda_emu/runtime/) against the runtime's documented rules.

The cases live in tests/emulation/cpp/runtime_test.cc and run in a test binary built here
with the host C++ compiler alone (no CUDA toolkit): streams asynchronous and in order,
events across streams and processes, the last-error rules (cudaGetLastError clears,
cudaPeekAtLastError does not, an event poll's cudaErrorNotReady stays), sticky errors,
poisoned fresh memory, launch and pitch limits, the legacy stream's implicit ordering,
peer access refused to the device itself, CUDA IPC between two processes, and the strict
checks (a wait on an event never recorded, freeing memory queued work uses, an IPC mapping
used after it was closed).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(glob.glob(str(ROOT / "ffi/cuda_emu/runtime/*.cc")))
CASES = ["stream_order", "last_error", "sticky", "poison", "launch_limits", "events_across_streams",
         "legacy_stream", "peer_access", "strict_never_recorded", "strict_free_in_use", "ipc"]


@pytest.fixture(scope="module")
def runtime_test(tmp_path_factory) -> Path:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    out = tmp_path_factory.mktemp("cuda_emu") / "runtime_test"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread",
                    f"-I{ROOT / 'ffi'}", f"-I{ROOT / 'ffi/cuda_emu/runtime/include'}", *SOURCES,
                    str(ROOT / "tests/emulation/cpp/runtime_test.cc"), "-o", str(out)],
                   check=True)
    return out


def test_cases_listed(runtime_test: Path) -> None:
    listed = subprocess.run([str(runtime_test), "--list"], check=True, capture_output=True,
                            text=True).stdout.split()
    assert sorted(listed) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_runtime(runtime_test: Path, case: str) -> None:
    r = subprocess.run([str(runtime_test), case], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
