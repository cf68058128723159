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
(HOST_ONLY, with the reason).
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Iterator

import pytest

#: Tests (file::name prefix) of the host backend's own mechanisms, with the reason they
#: do not apply to the CUDA backend.
HOST_ONLY: dict[str, str] = {
}

_calls: collections.Counter = collections.Counter()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    for item in items:
        nodeid = item.nodeid.split("/")[-1]
        for prefix, why in HOST_ONLY.items():
            if nodeid.startswith(prefix):
                item.add_marker(pytest.mark.skip(reason=f"host backend only: {why}"))


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
