// The number formats jaxcomm's MoE kernels convert between, as functions that any C++
// compiler builds for the host and nvcc for the device: bfloat16, float16 and FP8
// (float8_e4m3fn) to and from float32, and jaxcomm's FP8 token format (DeepEP's: one
// float32 scale per 128 channels of a token). The host kernels (cpu/moe_convert.h) and
// the CUDA kernels (cuda/kernels.cu) both call these, so both backends round alike.
//
// Written as integer and float arithmetic without branches or tables, so that the host
// compiler vectorises the row loops around them (bfloat16 -> float32 is a 16-bit shift
// of each lane; the others add a rebias, a rounding increment and a select per lane).
// Rounding is IEEE round-to-nearest-even, NaN stays NaN, as ml_dtypes (NumPy) converts;
// FP8 saturates to +-448 instead of becoming NaN (DeepEP's quantization never exceeds it).
// Subnormal inputs are converted through integer arithmetic, so a flush-to-zero setting
// (XLA's threads) does not change the results. No CUDA or XLA header here.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define JAXCOMM_HD __host__ __device__ inline
#else
#define JAXCOMM_HD inline
#endif

namespace jaxcomm {

JAXCOMM_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

JAXCOMM_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

// Products and sums rounded once each: nvcc would otherwise contract a*x + y into a fused
// multiply-add, which rounds once where the host code rounds twice.
JAXCOMM_HD float MulRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

JAXCOMM_HD float AddRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

JAXCOMM_HD float DivRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

JAXCOMM_HD float Bf16ToF32(uint16_t h) { return BitsToFloat(uint32_t{h} << 16); }

JAXCOMM_HD uint16_t F32ToBf16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

JAXCOMM_HD float F16ToF32(uint16_t h) {
  const uint32_t sign = uint32_t{static_cast<uint16_t>(h & 0x8000u)} << 16;
  const uint32_t em = h & 0x7FFFu;
  const uint32_t normal = (em << 13) + (112u << 23);  // exponent rebiased 15 -> 127
  // Subnormals: em * 2^-24, exact in float32.
  const uint32_t subnormal = FloatBits(MulRn(static_cast<float>(static_cast<int32_t>(em)), 5.9604644775390625e-8f));
  const uint32_t inf_nan = (em << 13) | 0x7F800000u;
  const uint32_t mag = em >= 0x7C00u ? inf_nan : (em < 0x0400u ? subnormal : normal);
  return BitsToFloat(mag | sign);
}

JAXCOMM_HD uint16_t F32ToF16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Normal range: rebias 127 -> 15 and round at bit 13 (a carry into the exponent is right).
  const uint32_t normal = (a - (112u << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
  // Below 2^-14: adding 0.5 makes the FPU round |f| to a multiple of 2^-24 (0.5's ulp).
  const uint32_t subnormal = FloatBits(AddRn(BitsToFloat(a), 0.5f)) - 0x3F000000u;
  uint32_t o = a < (113u << 23) ? subnormal : normal;
  o = a >= 0x477FF000u ? 0x7C00u : o;  // rounds to infinity from 65520 up
  o = a > 0x7F800000u ? 0x7E00u : o;   // NaN
  return static_cast<uint16_t>(o | sign);
}

// float8_e4m3fn: bias 7, no infinities, 0x7F/0xFF NaN, largest finite 448 (0x7E).
constexpr float kE4M3Max = 448.0f;
// The scale is amax times this (float32 1/448): a product, which XLA's jax.numpy version
// (jaxcomm/_src/moe/fp8.py) computes bit for bit, where XLA rewrites a division by a
// constant into a multiplication by its reciprocal.
constexpr float kE4M3InvMax = 1.0f / 448.0f;

// Returns the code in the low 8 bits of a 32-bit word: narrowed at the store, which lets
// GCC vectorise the row loops (a uint8_t result here kept them scalar).
JAXCOMM_HD uint32_t F32ToE4M3(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // From 2^-6 up: rebias 127 -> 7 and round at bit 20.
  const uint32_t normal = (a - (120u << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  // Below: adding 2^14 makes the FPU round |f| to a multiple of 2^-9 (2^14's ulp); 8 (2^-6)
  // is the smallest normal's encoding, so rounding up into it needs no special case.
  const uint32_t subnormal = FloatBits(AddRn(BitsToFloat(a), 16384.0f)) - (141u << 23);
  uint32_t o = a < (121u << 23) ? subnormal : normal;
  o = o > 0x7Eu ? 0x7Eu : o;        // saturate at 448 (infinities too)
  o = a > 0x7F800000u ? 0x7Fu : o;  // NaN
  return o | sign;
}

JAXCOMM_HD float E4M3ToF32(uint8_t b) {
  const uint32_t sign = uint32_t{static_cast<uint8_t>(b & 0x80u)} << 24;
  const uint32_t em = b & 0x7Fu;
  const uint32_t normal = ((em >> 3) + 120u) << 23 | (em & 7u) << 20;
  const uint32_t subnormal = FloatBits(MulRn(static_cast<float>(static_cast<int32_t>(em)), 0.001953125f));  // * 2^-9
  const uint32_t mag = em == 0x7Fu ? 0x7FC00000u : (em < 8u ? subnormal : normal);
  return BitsToFloat(mag | sign);
}

// Per-type load (to float32) and store (from float32) of one element, for kernels written
// as templates over the element type.
struct F32T {
  using Storage = float;
  JAXCOMM_HD static float Load(float v) { return v; }
  JAXCOMM_HD static float Store(float v) { return v; }
};
struct BF16T {
  using Storage = uint16_t;
  JAXCOMM_HD static float Load(uint16_t v) { return Bf16ToF32(v); }
  JAXCOMM_HD static uint16_t Store(float v) { return F32ToBf16(v); }
};
struct F16T {
  using Storage = uint16_t;
  JAXCOMM_HD static float Load(uint16_t v) { return F16ToF32(v); }
  JAXCOMM_HD static uint16_t Store(float v) { return F32ToF16(v); }
};
struct E4M3T {
  using Storage = uint8_t;
  JAXCOMM_HD static float Load(uint8_t v) { return E4M3ToF32(v); }
  JAXCOMM_HD static uint32_t Store(float v) { return F32ToE4M3(v); }
};

// ----------------------------------------------------------------- the FP8 token format
//
// Per token, one float32 scale per block of kFp8Block channels (the last block may be
// shorter). With amax = max(max |x| over the block, kFp8MinAmax), in float32 and in this
// order: q = e4m3(x * (448 / amax)), scale = amax * float32(1/448); value ~= q * scale.
// (The NumPy reference in tests/moe_reference.py repeats it bit for bit.)
constexpr int64_t kFp8Block = 128;
// The smallest block maximum a scale is computed from (an all-zero block keeps a finite
// scale).
constexpr float kFp8MinAmax = 1e-4f;

JAXCOMM_HD int64_t Fp8Blocks(int64_t H) { return (H + kFp8Block - 1) / kFp8Block; }

// |x| as an ordered integer: the largest |x| of a block is the integer maximum of these
// (which vectorises on the host and reduces across a warp on the device), and a NaN
// wins, as in NumPy's max.
JAXCOMM_HD uint32_t MagnitudeBits(float x) { return FloatBits(x) & 0x7FFFFFFFu; }

// A block's multiplier (448 / amax) and scale, from the integer maximum of its
// MagnitudeBits.
struct Fp8BlockScale {
  float multiplier, scale;
};
JAXCOMM_HD Fp8BlockScale Fp8ScaleOf(uint32_t amax_bits) {
  float amax = BitsToFloat(amax_bits);
  amax = amax < kFp8MinAmax ? kFp8MinAmax : amax;
  return Fp8BlockScale{DivRn(kE4M3Max, amax), MulRn(amax, kE4M3InvMax)};
}

// One channel: its FP8 code, and back (the code times its block's scale).
JAXCOMM_HD uint32_t Fp8Encode(float x, float multiplier) { return F32ToE4M3(MulRn(multiplier, x)); }
JAXCOMM_HD float Fp8Decode(uint8_t code, float scale) { return MulRn(scale, E4M3ToF32(code)); }

}  // namespace jaxcomm
