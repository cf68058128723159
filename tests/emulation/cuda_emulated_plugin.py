"""pytest plugin: the host backend's tests, run on the emulated CUDA backend.

Loaded by tests/emulation/test_emulated_suites.py with ``-p cuda_emulated_plugin`` in a
process where ``JAXCOMM_EMULATE_CUDA=1`` (the emulation replaces the host handlers for the
whole process, so it cannot share one with the host backend's tests). Around every test:

- the statistics are reset before and read after: every op the CUDA backend serves must
  show its emulated algorithm (``cuda (emulated): <route>``), which proves that the CUDA
  backend's code served it and not the host's;
- the emulated runtime's strict checks must have reported nothing, and its context must
  hold no sticky error.

What the tests observed (calls per algorithm) goes to the JSON file named by
``JAXCOMM_EMU_REPORT``. Tests of the host backend's own mechanisms are skipped here
(HOST_ONLY, with the reason); where the CUDA backend's answer is known to differ, the test
is a strict xfail (KNOWN_DIFFERENCES).
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Iterator

import pytest

#: Tests (file::name prefix) of the host backend's own mechanisms, with the reason they
#: do not apply to the CUDA backend.
_INDEPENDENT = ("independent NCCL collectives in one program: XLA:CPU runs them in different orders "
                "on different devices (XLA:GPU issues a device's thunks in program order, and runs "
                "every initialize stage before executing), so the ranks enqueue them in different "
                "orders, which NCCL's same-order rule forbids")
HOST_ONLY: dict[str, str] = {
    "test_collectives.py::test_groups_of_five_to_seven_ranks_match_numpy": _INDEPENDENT,
    "test_collectives.py::test_many_independent_jaxcomm_collectives": _INDEPENDENT,
    "test_collectives.py::test_independent_jaxcomm_and_xla_collectives": _INDEPENDENT,
    "test_moe_inference.py::test_split_phase_leaves_work_between_the_halves": (
        "inspects the host backend's fused dispatch (moe_dispatch) in the compiled program"),
    "test_moe_inference.py::test_split_send_returns_before_its_peers_arrive": (
        "injects its hang into moe_dispatch_send, the host backend's fused dispatch, which the "
        "CUDA backend does not have (its deadlines: test_emulated_faults.py)"),
    "test_moe_inference.py::test_split_low_latency_fp8_across_processes": (
        "its job's processes share emulated GPUs 0 and 1 (run_script sets no "
        "CUDA_VISIBLE_DEVICES), where NCCL refuses two ranks on a GPU; "
        "test_emulated_multiprocess.py runs this job with a GPU per rank"),
}

#: Where the CUDA backend's answer differs from the host backend's (and jax.lax's): a
#: strict xfail, so that a fix shows up as XPASS.
KNOWN_DIFFERENCES: dict[str, str] = {
    "test_collectives.py::test_all_reduce_nan_propagates": (
        "NCCL's max/min (fmaxf/fminf, and the mock NCCL's) drop a NaN that the host kernels "
        "propagate"),
    "test_ragged.py::test_out_of_range_is_an_error": (
        "groups of several ranks lower to jax.lax's ragged_all_to_all (the CUDA handler serves "
        "one-rank groups), which does not check bounds; a one-rank group's kernel writes "
        "nothing (docs/cuda.md, Routes)"),
}

_calls: collections.Counter = collections.Counter()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    for item in items:
        nodeid = item.nodeid.split("/")[-1]
        for prefix, why in HOST_ONLY.items():
            if nodeid.startswith(prefix):
                item.add_marker(pytest.mark.skip(reason=f"not under the emulation: {why}"))
        for prefix, why in KNOWN_DIFFERENCES.items():
            if nodeid.startswith(prefix):
                item.add_marker(pytest.mark.xfail(strict=True, reason=f"CUDA backend: {why}"))


def _cuda_ops() -> frozenset[str]:
    from jaxcomm._src.ops import table
    return frozenset(n for n, e in table._load()[0].items() if "cuda" in e.backends)


@pytest.fixture(autouse=True)
def _emulated_cuda_checks() -> Iterator[None]:
    import jaxcomm
    from jaxcomm._src.backends import cuda_emulated
    jaxcomm.stats(reset=True)
    cuda_emulated.strict_violations()
    yield
    rows = jaxcomm.stats()
    served = _cuda_ops()
    wrong = [(r.op, r.algorithm) for r in rows
             if r.op in served and not r.algorithm.startswith(cuda_emulated.ALGORITHM_PREFIX)]
    for r in rows:
        _calls[r.algorithm] += r.calls
    assert not wrong, f"ops the CUDA backend serves ran elsewhere: {wrong}"
    violations = cuda_emulated.strict_violations()
    assert not violations, f"the emulated CUDA runtime's strict checks: {violations}"
    sticky = cuda_emulated.module().emu_sticky_error()
    assert not sticky, f"the emulated CUDA context holds a sticky error: {sticky}"


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get("JAXCOMM_EMU_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"calls": dict(_calls)}, f)
