// The operand contract of the MoE transport custom call (jaxcomm/_src/moe/fused.py), which
// every backend checks alike: src, dest s32[T, K] (destination rank of each slot, or -1),
// pos s32[T, K] (the slot's row on that rank, or -1), w f32[T, K], g, and the result, as
// the mode (core/moe_modes.h) requires.
#pragma once

#include <cstdint>
#include <string>

#include "core/moe_modes.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

// What a transport call's operands say: tokens T, slots K, hidden H, result rows (the
// gathers') or src rows (the others), the bytes of one result row, whether the mode
// gathers rows, and the element types of src, g and the result.
struct MoeOperandShape {
  int64_t T = 0, K = 0, H = 0, rows = 0, row_bytes = 0;
  bool gather = false;
  xla::ffi::DataType src_type = xla::ffi::DataType::F32, g_type = xla::ffi::DataType::F32,
                     out_type = xla::ffi::DataType::F32;
};

// float32, bfloat16 or float16: the float types the transports take.
bool IsMoeFloat(xla::ffi::DataType t);

// Checks a transport call's operands against its mode; returns "" and fills `shape`, or
// why the call is malformed.
std::string CheckMoeOperands(int64_t mode, const xla::ffi::AnyBuffer& src,
                             const xla::ffi::AnyBuffer& dest, const xla::ffi::AnyBuffer& pos,
                             const xla::ffi::AnyBuffer& w, const xla::ffi::AnyBuffer& g,
                             const xla::ffi::AnyBuffer& result, MoeOperandShape* shape);

}  // namespace jaxcomm
