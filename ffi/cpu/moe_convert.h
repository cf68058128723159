// Row kernels of the host MoE transports over half precision and FP8 (float8_e4m3fn)
// rows: loops the compiler vectorises around the element conversions of
// core/number_formats.h (shared with the CUDA kernels, so both backends round alike).
// XLA:CPU converts half precision one element at a time: the MoE combine of bfloat16 rows
// took 4.3x as long as float32's through XLA's conversions.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/number_formats.h"

namespace jaxcomm::cpu {

// Element types of the transports' float operands and results.
enum class Real : uint8_t { kF32, kBF16, kF16, kE4M3 };

inline int RealBytes(Real t) { return t == Real::kF32 ? 4 : t == Real::kE4M3 ? 1 : 2; }

// The element tags (F32T, BF16T, F16T, E4M3T) are core/number_formats.h's: the row kernels
// below are templates over them, so that each instantiation is one straight loop the
// compiler vectorises.

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

// The integer maximum of a block's MagnitudeBits (core/number_formats.h).
template <typename In>
uint32_t BlockAmaxBits(const void* xv, int64_t n) {
  const auto* __restrict x = static_cast<const typename In::Storage*>(xv);
  uint32_t amax_bits = 0;
  for (int64_t h = 0; h < n; ++h) {
    const uint32_t m = MagnitudeBits(In::Load(x[h]));
    amax_bits = m > amax_bits ? m : amax_bits;
  }
  return amax_bits;
}

// Quantizes one token row x[H] (In's type) into jaxcomm's FP8 format
// (core/number_formats.h): q[H] codes and scales[Fp8Blocks(H)].
template <typename In>
void QuantizeRowE4M3(const void* xv, int64_t H, uint8_t* q, float* scales) {
  const auto* x = static_cast<const typename In::Storage*>(xv);
  for (int64_t b = 0, h0 = 0; h0 < H; ++b, h0 += kFp8Block) {
    const int64_t n = H - h0 < kFp8Block ? H - h0 : kFp8Block;
    const Fp8BlockScale s = Fp8ScaleOf(BlockAmaxBits<In>(x + h0, n));
    ConvertRow<In, E4M3T>(q + h0, x + h0, s.multiplier, n);
    scales[b] = s.scale;
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
