// The fused host dispatch of jaxcomm.moe (jaxcomm/_src/moe/routed.py): routing and the
// token copy in one collective call. Every rank publishes its tokens and expert ids; once
// all have arrived, the routing is computed from the ids (moe_routing.h, no separate count
// exchange) and each receiver's expert rows are copied straight from the sources' token
// rows. Optionally the tokens travel as FP8 (float8_e4m3fn, one float32 scale per 128
// channels, quantized by each source as it arrives, moe_convert.h), delivered as FP8 or
// dequantized by the receiver; and the call may be the send half of a split-phase pair
// (moe_split.h).
//
// Operands: x [T, H] (any whole-byte dtype; float32/bfloat16/float16 with FP8), ids s32[T, K].
// Results:
//   expert_x [rows, H]: x's dtype, or float8_e4m3fn when FP8 is delivered as such;
//   route s32[S + 2*T*K + E_local + 3]: S = kStatusWords for a send half (its status block),
//     else 0; then this rank's slot tables pos [T*K] and dest [T*K] (row and rank of each
//     slot, or -1), its experts' row counts [E_local], and the counters dropped, invalid,
//     recv_dropped (jaxcomm.moe.Handle's);
//   q s8-sized float8_e4m3fn [T, H] and scales f32 [T, ceil(H/128)]: this rank's quantized
//     tokens with FP8 (empty arrays without).
// Attributes: num_experts, slab (rows per expert, 0 for the packed layout), fp8 (0 none,
// 1 dequantized delivery, 2 FP8 delivery), zero_unused (write zeros to the rows no
// assignment fills; the low-latency layout leaves them), check_ids (fail on an expert id
// outside [-1, num_experts) instead of counting it), split (send half).
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jaxcomm::cpu {

extern XLA_FFI_Handler* const kMoeDispatch;

}  // namespace jaxcomm::cpu
