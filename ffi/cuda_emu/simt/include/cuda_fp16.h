// The emulation's <cuda_fp16.h>: __half as its 16 bits, converted with jaxcomm's own
// round-to-nearest-even conversions (core/number_formats.h), which are the GPU's __*_rn.
#pragma once

#include <cstdint>

#include "core/number_formats.h"

struct __half {
  uint16_t __x;
};

inline float __half2float(__half h) { return ::jaxcomm::F16ToF32(h.__x); }
inline __half __float2half_rn(float f) { return __half{::jaxcomm::F32ToF16(f)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }
