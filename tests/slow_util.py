"""Test cases beyond the README's time budget (``pytest`` under ~8 minutes on 2 cores).

Each is skipped unless ``JAXCOMM_TEST_SLOW=1`` and marked ``slow``, so that CI's second
step (.ci/run) runs exactly them: ``JAXCOMM_TEST_SLOW=1 pytest -m slow``.

    from slow_util import slow

    @pytest.mark.parametrize("n", [2, 4, slow(8)])
"""

from __future__ import annotations

import os
from typing import Any

import pytest

#: Whether this run includes the slow cases.
RUN = os.environ.get("JAXCOMM_TEST_SLOW") == "1"


def slow(*values: Any, reason: str = "more of the matrix") -> Any:
    """A parameter case that runs only with JAXCOMM_TEST_SLOW=1 (marked ``slow``)."""
    return pytest.param(*values, marks=[pytest.mark.slow,
                                        pytest.mark.skipif(not RUN, reason=f"{reason}: JAXCOMM_TEST_SLOW=1")])
