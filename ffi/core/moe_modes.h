// The four transports of jaxcomm.moe (the custom call's `mode` attribute; the Python side
// is jaxcomm/_src/moe/fused.py), shared by every backend. No XLA here: the CUDA kernels
// include it too. The codes are core/op_table.h's JAXCOMM_MOE_MODES:
//   kGatherCopy    rank r: out[pos_s[t, k]] = src_s[t] for every source s and slot with
//                  dest_s[t, k] == r; rows nobody writes are zero. src [T, H] any dtype,
//                  out [rows, H] the same (dispatch).
//   kGatherScaled  as kGatherCopy with out[pos] = w_s[t, k] * src_s[t] in float32
//                  (combine's gradient towards expert_y).
//   kReduce        rank s: y[t] = sum over ranks d in order of (sum over slots k with
//                  dest_s[t, k] == d, in order, of w_s[t, k] * src_d[pos_s[t, k]]);
//                  src [rows, H] f32, out [T, H] f32 (combine, and with unit weights
//                  dispatch's gradient).
//   kDot           rank s: out[t, k] = <g_s[t], src_d[pos_s[t, k]]> for d = dest_s[t, k],
//                  else 0; out [T, K] f32 (combine's gradient towards the weights).
// IsMoeMode(code) and CheckMoeMode(code) come with the table.
#pragma once

#include <cstdint>

#include "core/op_table.h"

namespace jaxcomm {

enum MoeMode : int { JAXCOMM_MOE_MODES(JAXCOMM_ENUMERATOR_) };

}  // namespace jaxcomm
