// Element conversions and row kernels of the host MoE transports: half precision and FP8
// (float8_e4m3fn) to and from float32, written as integer and float arithmetic without
// branches or tables so that the compiler vectorises the row loops (bfloat16 -> float32
// is a 16-bit shift of each lane; the others add a rebias, a rounding increment and a
// select per lane). XLA:CPU converts half precision one element at a time: the MoE
// combine of bfloat16 rows took 4.3x as long as float32's through XLA's conversions.
//
// Rounding is IEEE round-to-nearest-even, NaN stays NaN, as ml_dtypes (NumPy) converts;
// FP8 saturates to +-448 instead of becoming NaN (DeepEP's quantization never exceeds it).
// Subnormal inputs are converted through integer arithmetic, so XLA's flush-to-zero
// setting on its threads does not change the results.
//
// The CUDA port reads the same rules: F32ToE4M3 / E4M3ToF32 / QuantizeRowE4M3 define
// jaxcomm's FP8 format (one float32 scale per kFp8Block channels of a token).
#pragma once

#include <cstdint>
#include <cstring>

namespace jaxcomm::cpu {

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float Bf16ToF32(uint16_t h) { return BitsToFloat(uint32_t{h} << 16); }

inline uint16_t F32ToBf16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

inline float F16ToF32(uint16_t h) {
  const uint32_t sign = uint32_t{static_cast<uint16_t>(h & 0x8000u)} << 16;
  const uint32_t em = h & 0x7FFFu;
  const uint32_t normal = (em << 13) + (112u << 23);  // exponent rebiased 15 -> 127
  // Subnormals: em * 2^-24, exact in float32.
  const uint32_t subnormal = FloatBits(static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f);
  const uint32_t inf_nan = (em << 13) | 0x7F800000u;
  const uint32_t mag = em >= 0x7C00u ? inf_nan : (em < 0x0400u ? subnormal : normal);
  return BitsToFloat(mag | sign);
}

inline uint16_t F32ToF16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Normal range: rebias 127 -> 15 and round at bit 13 (a carry into the exponent is right).
  const uint32_t normal = (a - (112u << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
  // Below 2^-14: adding 0.5 makes the FPU round |f| to a multiple of 2^-24 (0.5's ulp).
  const uint32_t subnormal = FloatBits(BitsToFloat(a) + 0.5f) - 0x3F000000u;
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
inline uint32_t F32ToE4M3(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // From 2^-6 up: rebias 127 -> 7 and round at bit 20.
  const uint32_t normal = (a - (120u << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  // Below: adding 2^14 makes the FPU round |f| to a multiple of 2^-9 (2^14's ulp); 8 (2^-6)
  // is the smallest normal's encoding, so rounding up into it needs no special case.
  const uint32_t subnormal = FloatBits(BitsToFloat(a) + 16384.0f) - (141u << 23);
  uint32_t o = a < (121u << 23) ? subnormal : normal;
  o = o > 0x7Eu ? 0x7Eu : o;        // saturate at 448 (infinities too)
  o = a > 0x7F800000u ? 0x7Fu : o;  // NaN
  return o | sign;
}

inline float E4M3ToF32(uint8_t b) {
  const uint32_t sign = uint32_t{static_cast<uint8_t>(b & 0x80u)} << 24;
  const uint32_t em = b & 0x7Fu;
  const uint32_t normal = ((em >> 3) + 120u) << 23 | (em & 7u) << 20;
  const uint32_t subnormal = FloatBits(static_cast<float>(static_cast<int32_t>(em)) * 0.001953125f);  // * 2^-9
  const uint32_t mag = em == 0x7Fu ? 0x7FC00000u : (em < 8u ? subnormal : normal);
  return BitsToFloat(mag | sign);
}

// Element types of the transports' float operands and results.
enum class Real : uint8_t { kF32, kBF16, kF16, kE4M3 };

inline int RealBytes(Real t) { return t == Real::kF32 ? 4 : t == Real::kE4M3 ? 1 : 2; }

// Per-type load/store, for the row kernels below (templates over these, so that each
// instantiation is one straight loop the compiler vectorises).
struct F32T {
  using Storage = float;
  static float Load(float v) { return v; }
  static float Store(float v) { return v; }
};
struct BF16T {
  using Storage = uint16_t;
  static float Load(uint16_t v) { return Bf16ToF32(v); }
  static uint16_t Store(float v) { return F32ToBf16(v); }
};
struct F16T {
  using Storage = uint16_t;
  static float Load(uint16_t v) { return F16ToF32(v); }
  static uint16_t Store(float v) { return F32ToF16(v); }
};
struct E4M3T {
  using Storage = uint8_t;
  static float Load(uint8_t v) { return E4M3ToF32(v); }
  static uint32_t Store(float v) { return F32ToE4M3(v); }
};

// Calls f(tag) with the tag type of `t`: f(F32T{}), f(BF16T{}), ...
template <typename F>
decltype(auto) WithReal(Real t, F&& f) {
  switch (t) {
    case Real::kBF16:
      return f(BF16T{});
    case Real::kF16:
      return f(F16T{});
    case Real::kE4M3:
      return f(E4M3T{});
    default:
      return f(F32T{});
  }
}

// acc[h] = a * x[h] (set) or acc[h] += a * x[h], x in In's type.
template <typename In>
void ScaleRow(float* __restrict acc, const void* x, float a, int64_t n) {
  const auto* __restrict in = static_cast<const typename In::Storage*>(x);
  for (int64_t h = 0; h < n; ++h) acc[h] = a * In::Load(in[h]);
}
template <typename In>
void AxpyRow(float* __restrict acc, const void* x, float a, int64_t n) {
  const auto* __restrict in = static_cast<const typename In::Storage*>(x);
  for (int64_t h = 0; h < n; ++h) acc[h] += a * In::Load(in[h]);
}
// dst = acc in Out's type.
template <typename Out>
void StoreRow(void* dst, const float* __restrict acc, int64_t n) {
  auto* __restrict out = static_cast<typename Out::Storage*>(dst);
  for (int64_t h = 0; h < n; ++h) out[h] = Out::Store(acc[h]);
}
// dst = a * x, converted from In's type to Out's (a transport's scaled gather row).
template <typename In, typename Out>
void ConvertRow(void* dst, const void* x, float a, int64_t n) {
  const auto* __restrict in = static_cast<const typename In::Storage*>(x);
  auto* __restrict out = static_cast<typename Out::Storage*>(dst);
  for (int64_t h = 0; h < n; ++h) out[h] = Out::Store(a * In::Load(in[h]));
}
// sum_h x[h] * y[h] in float32, with eight independent partial sums (one accumulator is a
// dependency chain the compiler may not reorder into vectors).
template <typename X, typename Y>
float DotRow(const void* xv, const void* yv, int64_t n) {
  const auto* __restrict x = static_cast<const typename X::Storage*>(xv);
  const auto* __restrict y = static_cast<const typename Y::Storage*>(yv);
  float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t h = 0;
  for (; h + 8 <= n; h += 8) {
    for (int l = 0; l < 8; ++l) lane[l] += X::Load(x[h + l]) * Y::Load(y[h + l]);
  }
  float acc = 0.f;
  for (; h < n; ++h) acc += X::Load(x[h]) * Y::Load(y[h]);
  for (int l = 0; l < 8; ++l) acc += lane[l];
  return acc;
}

// jaxcomm's FP8 format (DeepEP's): per token, one float32 scale per block of kFp8Block
// channels (the last block may be shorter); value ~= fp8 * scale.
constexpr int64_t kFp8Block = 128;
// The smallest block maximum the scale is computed from (an all-zero block keeps a
// finite scale).
constexpr float kFp8MinAmax = 1e-4f;

inline int64_t Fp8Blocks(int64_t H) { return (H + kFp8Block - 1) / kFp8Block; }

// Quantizes one token row x[H] (In's type): per block, amax = max(|x|, kFp8MinAmax),
// q = e4m3(x * (448 / amax)), scale = amax * float32(1/448), all in float32 in this order
// (the NumPy reference in tests/ repeats it bit for bit).
template <typename In>
float BlockAmax(const void* xv, int64_t n) {
  const auto* __restrict x = static_cast<const typename In::Storage*>(xv);
  // The largest |x| as the largest magnitude bit pattern: an integer maximum, which
  // vectorises (a float one needs -ffast-math), and a NaN wins as in NumPy's max.
  uint32_t amax_bits = 0;
  for (int64_t h = 0; h < n; ++h) {
    const uint32_t m = FloatBits(In::Load(x[h])) & 0x7FFFFFFFu;
    amax_bits = m > amax_bits ? m : amax_bits;
  }
  const float amax = BitsToFloat(amax_bits);
  return amax < kFp8MinAmax ? kFp8MinAmax : amax;
}

template <typename In>
void QuantizeRowE4M3(const void* xv, int64_t H, uint8_t* q, float* scales) {
  const auto* x = static_cast<const typename In::Storage*>(xv);
  for (int64_t b = 0, h0 = 0; h0 < H; ++b, h0 += kFp8Block) {
    const int64_t n = H - h0 < kFp8Block ? H - h0 : kFp8Block;
    const float amax = BlockAmax<In>(x + h0, n);
    ConvertRow<In, E4M3T>(q + h0, x + h0, kE4M3Max / amax, n);
    scales[b] = amax * kE4M3InvMax;
  }
}

// dst[H] (Out's type) = e4m3 row q * its block scales.
template <typename Out>
void DequantizeRowE4M3(void* dst, const uint8_t* q, const float* scales, int64_t H) {
  auto* out = static_cast<typename Out::Storage*>(dst);
  for (int64_t b = 0, h0 = 0; h0 < H; ++b, h0 += kFp8Block) {
    const int64_t n = H - h0 < kFp8Block ? H - h0 : kFp8Block;
    ConvertRow<E4M3T, Out>(out + h0, q + h0, scales[b], n);
  }
}

}  // namespace jaxcomm::cpu
