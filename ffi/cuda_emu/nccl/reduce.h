// The mock NCCL's element types and reductions, on the host.
#pragma once

#include <cstddef>

#include "cuda_emu/nccl/nccl_abi.h"

namespace jaxcomm::nccl_mock {

// Bytes of one element; 0 for a type NCCL does not have.
size_t TypeBytes(ncclDataType_t type);
const char* TypeName(ncclDataType_t type);
const char* OpName(ncclRedOp_t op);

// out[i] = op over ranks r = 0, 1, ... of in[r][i], for i < count, in rank order. Half
// precision types are reduced in float32 and rounded once (real NCCL rounds after each
// step of its ring: the results may differ in the last bit); integers wrap; max and min
// of floating point values drop NaNs (fmax, fmin). `out` may be one of the inputs.
void Reduce(ncclDataType_t type, ncclRedOp_t op, const void* const* in, int ranks, void* out, size_t count);

}  // namespace jaxcomm::nccl_mock
