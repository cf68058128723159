// XLA FFI handler of jaxcomm.moe's fused transports on the host backend (moe_kernels.cc).
#pragma once

#include "core/moe_operands.h"  // the modes and operand contract every backend shares
#include "xla/ffi/api/c_api.h"

namespace jaxcomm::cpu {

// The expert-parallel transports, fused with the local expand/reduce: every rank
// reads its peers' rows in place (one address space) instead of packing, sending and
// unpacking them. Operands: src, dest s32[T, K] (destination rank of each slot, or -1),
// pos s32[T, K] (the slot's row on that rank, or -1), w f32[T, K], g; attribute `mode`
// (MoeMode in moe_kernels.cc) says which of the four transports the call is.
extern XLA_FFI_Handler* const kMoeTransport;

}  // namespace jaxcomm::cpu
