// The transports of jaxcomm.moe (the custom call's `mode` attribute; the Python side
// is jaxcomm/_src/moe/fused.py), shared by every backend. No XLA here: the CUDA kernels
// include it too.
#pragma once

#include <cstdint>

namespace jaxcomm {

enum MoeMode : int {
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
  // rows past each expert's count hold unspecified values).
  kGatherSparse = 4,
};

// Whether `mode` is one of the above.
constexpr bool IsMoeMode(int64_t mode) { return mode >= kGatherCopy && mode <= kGatherSparse; }

}  // namespace jaxcomm
