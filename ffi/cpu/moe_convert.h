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

// The row kernels of the combine are built twice on x86-64 with GCC, for the baseline
// (SSE2: 4 floats a vector, no 32->16-bit pack, so a bfloat16 store takes six shuffles per
// eight elements) and for AVX2 (8 floats, vpmovzxwd/vpackusdw), the one the CPU runs
// chosen when the module loads (an ifunc). AVX2 only, not FMA: contracting a * x + y
// would change the rounding (the build also passes -ffp-contract=off).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define JAXCOMM_ROW_KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define JAXCOMM_ROW_KERNEL
#endif

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

// How SumRows combines acc[h] with its rows' terms a_j * x_j[h] (j = 0..M-1, added left to
// right, every product and sum rounded once, so that a sum split over several passes
// rounds as one pass would):
//   kSet:       acc = a_0 x_0 + ... + a_{M-1} x_{M-1}
//   kChain:     acc = acc + a_0 x_0 + ... (continues a partial sum)
//   kMerge:     acc = acc + (a_0 x_0 + ...)
//   kMergeFrom: acc = acc + (part + a_0 x_0 + ...) (finishes the partial sum `part`, adds it)
enum class Sum { kSet, kChain, kMerge, kMergeFrom };

// One pass over columns [h0, h0 + n) of M rows (In's type), acc[0, n) and part[0, n) in
// float32: each row is read once and each sum stays in a register, where one pass per row
// would read and write acc M times.
template <typename In, int M, Sum kHow>
JAXCOMM_ROW_KERNEL void SumRows(float* acc, const float* part, const void* const* rows, const float* a,
                                int64_t h0, int64_t n) {
  const typename In::Storage* x[M];
  float w[M];
  for (int j = 0; j < M; ++j) {
    x[j] = static_cast<const typename In::Storage*>(rows[j]) + h0;
    w[j] = a[j];
  }
  // acc, part and the rows never overlap (a result and its operands).
#pragma GCC ivdep
  for (int64_t h = 0; h < n; ++h) {
    float s = w[0] * In::Load(x[0][h]);
    if constexpr (kHow == Sum::kChain) s = acc[h] + s;
    if constexpr (kHow == Sum::kMergeFrom) s = part[h] + s;
    for (int j = 1; j < M; ++j) s = s + w[j] * In::Load(x[j][h]);
    if constexpr (kHow == Sum::kMerge || kHow == Sum::kMergeFrom) s = acc[h] + s;
    acc[h] = s;
  }
}

// SumRows over m rows, 1 <= m <= kSumRowsMax.
constexpr int kSumRowsMax = 4;
template <typename In, Sum kHow>
void SumRowsOf(int m, float* acc, const float* part, const void* const* rows, const float* a, int64_t h0,
               int64_t n) {
  switch (m) {
    case 1:
      return SumRows<In, 1, kHow>(acc, part, rows, a, h0, n);
    case 2:
      return SumRows<In, 2, kHow>(acc, part, rows, a, h0, n);
    case 3:
      return SumRows<In, 3, kHow>(acc, part, rows, a, h0, n);
    default:
      return SumRows<In, 4, kHow>(acc, part, rows, a, h0, n);
  }
}

// dst = acc in Out's type.
template <typename Out>
JAXCOMM_ROW_KERNEL void StoreRow(void* dst, const float* __restrict acc, int64_t n) {
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
