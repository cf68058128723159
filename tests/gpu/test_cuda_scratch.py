"""Issue 30, defect 1: the CUDA handlers' scratch requests keep XLA:GPU's allocator
contract. `XLA_FFI_DeviceMemory_Allocate` (xla/ffi/ffi_api.cc) refuses any alignment above
its kMaxAlignment, 16 ("Unsupported alignment"); the handlers asked for 256, so every
call that needs scratch failed, and their message did not say why.

These run the handlers' own allocation code (ffi/cuda/xla_context.h's DeviceScratch)
against an FFI API whose allocator keeps that contract on host memory. Under the CPU
emulation (tests/emulation/) the handlers themselves allocate through the emulated one."""

from __future__ import annotations

import pytest

from jaxcomm import _jaxcomm
from jaxcomm._src import cuda_runtime

pytestmark = pytest.mark.skipif(not cuda_runtime.built_with_cuda(),
                                reason="jaxcomm was built without the CUDA backend")

XLA_MAX_ALIGNMENT = 16  # kMaxAlignment in xla/ffi/ffi_api.cc (jax 0.10 to 0.12)


def test_requested_alignment_is_one_xla_accepts():
    alignment, xla_max = _jaxcomm.cuda_scratch_alignment()
    assert xla_max == XLA_MAX_ALIGNMENT
    assert alignment <= xla_max and alignment & (alignment - 1) == 0


@pytest.mark.parametrize("nbytes", [0, 1, 4096, 3 << 20])
def test_scratch_allocates_under_xlas_contract(nbytes):
    error, address = _jaxcomm.cuda_scratch_probe(nbytes)
    assert error == ""
    assert address != 0 and address % XLA_MAX_ALIGNMENT == 0


def test_refused_scratch_carries_xlas_reason():
    error, address = _jaxcomm.cuda_scratch_probe(2 << 30)
    assert address == 0
    assert error == (f"XLA's scratch allocator refused {2 << 30} bytes at alignment "
                     f"{_jaxcomm.cuda_scratch_alignment()[0]}: RESOURCE_EXHAUSTED: out of memory")
