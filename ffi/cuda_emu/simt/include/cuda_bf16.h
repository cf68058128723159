// The emulation's <cuda_bf16.h>: __nv_bfloat16 as its 16 bits (see cuda_fp16.h).
#pragma once

#include <cstdint>

#include "core/number_formats.h"

struct __nv_bfloat16 {
  uint16_t __x;
};

inline float __bfloat162float(__nv_bfloat16 h) { return ::jaxcomm::Bf16ToF32(h.__x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{::jaxcomm::F32ToBf16(f)}; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
