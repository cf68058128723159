// XLA FFI handler of jaxcomm.moe's fused transports on the host backend (moe_kernels.cc).
#pragma once

#include "core/moe_operands.h"  // the modes and operand contract every backend shares
#include "cpu/moe_convert.h"
#include "xla/ffi/api/c_api.h"

namespace jaxcomm::cpu {

// The host kernels' element type of a float32, bfloat16 or float16 buffer; false for others.
bool AsReal(xla::ffi::DataType t, Real* r);

// The expert-parallel transports, fused with the local expand/reduce: every rank
// reads its peers' rows in place (one address space) instead of packing, sending and
// unpacking them. Operands: src, dest s32[T, K] (destination rank of each slot, or -1),
// pos s32[T, K] (the slot's row on that rank, or -1), w f32[T, K], g; attribute `mode`
// (MoeMode in core/moe_modes.h) says which transport the call is.
extern XLA_FFI_Handler* const kMoeTransport;

// The send half of a split transport (jaxcomm.moe.combine_send): the same operands, and a
// second result, the status block the receive half waits on (moe_split.h). On the host
// backend the float operands and results of kGatherScaled, kReduce and kDot may also be
// bfloat16 or float16 (converted in the row loops, accumulated in float32); the same holds
// for kMoeTransport there.
extern XLA_FFI_Handler* const kMoeTransportSend;

}  // namespace jaxcomm::cpu
