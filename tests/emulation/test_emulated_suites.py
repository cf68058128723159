"""The collective, ragged and MoE tests of the host backend, run on the CUDA backend's
own code on the emulated CUDA runtime (JAXCOMM_EMULATE_CUDA=1, one process x 8 devices),
against the same jax.lax and NumPy references.

Each suite runs in a pytest process of its own (the emulation serves the whole process),
with tests/emulation/cuda_emulated_plugin.py checking around every test that the CUDA
backend served its ops (jaxcomm.stats()), that the strict checks stayed silent and that no
sticky error was raised. The default run takes a smoke subset of each suite;
``JAXCOMM_TEST_EMULATED_FULL=1`` runs them whole (CI's second step).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
FULL = os.environ.get("JAXCOMM_TEST_EMULATED_FULL") == "1"

#: Suite -> the -k expression of its smoke subset (the default run).
SUITES = {
    "test_collectives.py": ("test_all_reduce_known_values or test_all_gather_scalar or "
                            "test_reduce_scatter_known_values or test_all_to_all_known_values or "
                            "test_ppermute_perms or test_broadcast_bits_preserved or "
                            "test_mesh_2x4_groups_known_values"),
    "test_ragged.py": "test_doc_example or test_vjp_random or test_vmap",
    "test_moe.py": "test_dispatch_combine_match_numpy or test_small_capacity_drops_are_accounted",
    "test_moe_inference.py": ("test_low_latency_layout_and_combine or test_fp8_dispatch_matches_numpy_quantization "
                              "or test_split_phase_equals_fused"),
}

#: Suites whose groups all have several ranks, where the CUDA backend hands the op to
#: jax.lax (ragged_all_to_all: its handler serves one-rank groups, test_emulated_backend.py).
LAX_ON_CUDA = {"test_ragged.py"}


def _pytest() -> str:
    exe = Path(sys.executable).parent / "pytest"
    return str(exe) if exe.exists() else (shutil.which("pytest") or "pytest")


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_suite_on_emulated_cuda(suite: str, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    env = dict(os.environ, JAXCOMM_EMULATE_CUDA="1", JAXCOMM_EMU_REPORT=str(report),
               PYTHONPATH=os.pathsep.join([str(TESTS / "emulation")] +
                                          [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("PYTEST_XDIST_WORKER", None)
    args = [_pytest(), "-n", "0", "-q", "-p", "no:cacheprovider", "-p", "cuda_emulated_plugin",
            str(TESTS / suite)]
    if not FULL:
        args += ["-k", SUITES[suite]]
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout, tail
    print(suite, r.stdout.strip().splitlines()[-1])  # the counts (shown with -rA)
    calls = json.loads(report.read_text())["calls"]
    emulated = {a: n for a, n in calls.items() if a.startswith("cuda (emulated): ")}
    if suite in LAX_ON_CUDA:
        assert not calls, calls
    else:
        assert emulated, f"no call ran on the emulated CUDA backend: {calls}"
