// The transports of jaxcomm.moe (the custom call's `mode` attribute; the Python side
// is jaxcomm/_src/moe/fused.py), shared by every backend. No XLA here: the CUDA kernels
// include it too. "Float" below is float32, bfloat16 or float16: the kernels convert
// half precision as they load and store, and accumulate in float32. The codes are
// core/op_table.h's JAXCOMM_MOE_MODES:
//   kGatherCopy    rank r: out[pos_s[t, k]] = src_s[t] for every source s and slot with
//                  dest_s[t, k] == r; rows nobody writes are zero. src [T, H] any dtype,
//                  out [rows, H] the same (dispatch).
//   kGatherScaled  as kGatherCopy with out[pos] = w_s[t, k] * src_s[t] in float32, src
//                  and out any float (combine's gradient towards expert_y).
//   kReduce        rank s: y[t] = sum over ranks d in order of (sum over slots k with
//                  dest_s[t, k] == d, in order, of w_s[t, k] * src_d[pos_s[t, k]]) in
//                  float32, rounded once to out's type; src [rows, H] and out [T, H] any
//                  float (combine, and with unit weights dispatch's gradient).
//   kDot           rank s: out[t, k] = <g_s[t], src_d[pos_s[t, k]]> for d = dest_s[t, k],
//                  else 0; src and g any float, out [T, K] f32 (combine's gradient
//                  towards the weights).
//   kGatherSparse  as kGatherCopy, leaving the rows nobody writes as they are (the
//                  low-latency layout's rows past each expert's count hold unspecified
//                  values).
//   kGatherDequant FP8 dispatch delivered dequantized: src [T, H] float8_e4m3fn codes and
//                  g [T, ceil(H/128)] f32 their scales (core/number_formats.h's format);
//                  out[pos] = the row's codes times their block scales, out [rows, H] any
//                  float; rows nobody writes are zero.
//   kGatherDequantSparse  as kGatherDequant, leaving the rows nobody writes as they are
//                  (low-latency layout).
// IsMoeMode(code) and CheckMoeMode(code) come with the table.
#pragma once

#include <cstdint>

#include "core/number_formats.h"  // JAXCOMM_HD
#include "core/op_table.h"

namespace jaxcomm {

enum MoeMode : int { JAXCOMM_MOE_MODES(JAXCOMM_ENUMERATOR_) };

// Whether `mode` writes expert rows (its result is [rows, H]), and whether it zeroes the
// rows no slot writes.
JAXCOMM_HD constexpr bool IsMoeGather(int64_t mode) { return mode != kReduce && mode != kDot; }
JAXCOMM_HD constexpr bool ZeroesUnwritten(int64_t mode) {
  return mode == kGatherCopy || mode == kGatherScaled || mode == kGatherDequant;
}

}  // namespace jaxcomm
