"""Several processes sharing one GPU: jaxcomm's own kernels and copies across processes
through CUDA IPC, every op and MoE dispatch/combine checked against NumPy
(multiprocess_check.py). NCCL groups cannot be tested this way: NCCL refuses two ranks
on one GPU ("Duplicate GPU detected"), which is why jaxcomm routes such groups to CUDA IPC.

Skipped without a GPU or a CUDA build."""

from __future__ import annotations

import pathlib

import pytest

from jaxcomm import _jaxcomm
from jaxcomm._src import cuda_runtime

HERE = pathlib.Path(__file__).parent
CHECK = (HERE / "multiprocess_check.py").read_text()


def gpu_env() -> dict[str, str]:
    """Every process on GPU 0, each with a small share of its memory."""
    return {"JAX_PLATFORMS": "cuda,cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
            "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.15", "CUDA_VISIBLE_DEVICES": "0",
            "JAXCOMM_TESTS_DIR": str(HERE.parent), "JAXCOMM_TIMEOUT_S": "60"}


@pytest.fixture(scope="module")
def one_gpu():
    if not cuda_runtime.built_with_cuda():
        pytest.skip("jaxcomm was built without the CUDA backend (JAXCOMM_CUDA)")
    if _jaxcomm.cuda_device_count() < 1:
        pytest.skip("no GPU: the processes would share GPU 0 (NCCL groups are not testable "
                    "this way either: NCCL refuses two ranks on one GPU)")


@pytest.mark.parametrize("processes", [2, 4])
def test_every_op_and_moe_across_processes_on_one_gpu(one_gpu, processes):
    from mp_util import assert_ok, run_script
    res = run_script(CHECK, processes, env=gpu_env(), timeout_s=240)
    assert_ok(res)
    for rank in range(processes):
        assert res.output[rank].count("CHECKED ") == 16, res.output[rank]
