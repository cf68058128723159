// XLA FFI handler of jaxcomm.moe's fused transports on the host backend (moe_kernels.cc).
#pragma once

#include <cstdint>
#include <string>

#include "cpu/moe_convert.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {

// The four transports of jaxcomm.moe (the `mode` attribute), on every backend.
enum MoeMode : int64_t {
  // Rank r: out[pos_s[t, k]] = src_s[t] for every source s and slot with dest_s[t, k] == r;
  // rows nobody writes are zero. src [T, H] any dtype, out [rows, H] the same (dispatch).
  kGatherCopy = 0,
  // As kGatherCopy with out[pos] = w_s[t, k] * src_s[t] in float32 (combine's gradient
  // towards expert_y).
  kGatherScaled = 1,
  // Rank s: y[t] = sum over ranks d in order of (sum over slots k with dest_s[t, k] == d, in
  // order, of w_s[t, k] * src_d[pos_s[t, k]]); src [rows, H] f32, out [T, H] f32 (combine,
  // and with unit weights dispatch's gradient).
  kReduce = 2,
  // Rank s: out[t, k] = <g_s[t], src_d[pos_s[t, k]]> for d = dest_s[t, k], else 0; out [T, K]
  // f32 (combine's gradient towards the weights).
  kDot = 3,
  // As kGatherCopy, leaving the rows nobody writes as they are (the low-latency layout's
  // rows past each expert's count hold unspecified values). Host backend only so far.
  kGatherSparse = 4,
};

// What a transport call's operands say: tokens T, slots K, hidden H, result rows, the
// bytes of one moved row, and whether the mode gathers rows (kGatherCopy/kGatherScaled).
struct MoeOperandShape {
  int64_t T = 0, K = 0, H = 0, rows = 0, row_bytes = 0;
  bool gather = false;
};

// Checks a transport call's operands against its mode (every backend checks alike);
// returns "" and fills `shape`, or why the call is malformed.
std::string CheckMoeOperands(int64_t mode, const xla::ffi::AnyBuffer& src,
                             const xla::ffi::AnyBuffer& dest, const xla::ffi::AnyBuffer& pos,
                             const xla::ffi::AnyBuffer& w, const xla::ffi::AnyBuffer& g,
                             const xla::ffi::AnyBuffer& result, MoeOperandShape* shape);

// The host kernels' element type of a float32, bfloat16 or float16 buffer; false for others.
bool AsReal(xla::ffi::DataType t, Real* r);

// The expert-parallel transports, fused with the local expand/reduce: every rank
// reads its peers' rows in place (one address space) instead of packing, sending and
// unpacking them. Operands: src, dest s32[T, K] (destination rank of each slot, or -1),
// pos s32[T, K] (the slot's row on that rank, or -1), w f32[T, K], g; attribute `mode`
// (MoeMode in moe_kernels.cc) says which of the four transports the call is.
extern XLA_FFI_Handler* const kMoeTransport;

// The send half of a split transport (jaxcomm.moe.combine_send): the same operands, and a
// second result, the status block the receive half waits on (moe_split.h). On the host
// backend the float operands and results of kGatherScaled, kReduce and kDot may also be
// bfloat16 or float16 (converted in the row loops, accumulated in float32); the same holds
// for kMoeTransport there.
extern XLA_FFI_Handler* const kMoeTransportSend;

}  // namespace jaxcomm::cpu
