"""GPU test setup: skips GPU tests cleanly where there is no GPU or no CUDA build.

Run them on a GPU machine with both platforms visible, e.g.
``JAX_PLATFORMS=cuda,cpu pytest tests/gpu`` (tests/conftest.py defaults JAX_PLATFORMS to
cpu). The GPU tests compare with jax.lax on the GPU and with NumPy references
(moe_reference.py), never with jaxcomm's host backend. The CPU tests of this directory
(test_cuda_host.py, test_kernel_logic.py) run everywhere.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxcomm._src import cuda_runtime


def gpu_skip_reason() -> str | None:
    """Why the GPU tests cannot run here, or None."""
    if not cuda_runtime.built_with_cuda():
        return "jaxcomm was built without the CUDA backend (JAXCOMM_CUDA)"
    if not cuda_runtime.gpu_backend_present():
        return "no GPU backend (jax.devices('gpu') fails; set JAX_PLATFORMS=cuda,cpu on a GPU machine)"
    return None


@pytest.fixture(scope="session")
def gpu_mesh() -> Mesh:
    """A one-GPU mesh with axis "x" (skips without a GPU)."""
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    return Mesh(np.array(jax.devices("gpu")[:1]), ("x",))
