// Row kernels of the host MoE transports over half precision and FP8 (float8_e4m3fn)
// rows: loops the compiler vectorises around the element conversions of
// core/number_formats.h (shared with the CUDA kernels, so both backends round alike).
// XLA:CPU converts half precision one element at a time: the MoE combine of bfloat16 rows
// took 4.3x as long as float32's through XLA's conversions.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/number_formats.h"
#include "cpu/cpu_clones.h"
#include "cpu/result_stores.h"

namespace jaxcomm::cpu {

// Element types of the transports' float operands and results.
enum class Real : uint8_t { kF32, kBF16, kF16, kE4M3 };

inline int RealBytes(Real t) { return t == Real::kF32 ? 4 : t == Real::kE4M3 ? 1 : 2; }

// The element tags (F32T, BF16T, F16T, E4M3T) are core/number_formats.h's: the row kernels
// below are templates over them, so that each instantiation is one straight loop the
// compiler vectorises.

// The combine's portable row kernels (portable::SumSlots, StoreRow) and the conversion
// rows below are JAXCOMM_ROW_KERNELs (cpu/cpu_clones.h): built for the baseline and for
// AVX2 (this file's users are also built with -ffp-contract=off).

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

// Eight float32 lanes as one value (GCC/Clang vector extensions): the combine's sums stay
// in registers across all of a token's rows, where an array would go through L1 on every
// row. On the AVX2 clone one ymm register; on the baseline two xmm.
typedef float F32x8 __attribute__((vector_size(32)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));
typedef int32_t I32x8 __attribute__((vector_size(32)));

// The element conversions of core/number_formats.h on eight lanes at once, the same bits:
// 16-bit codes in the low half of each word. A comparison gives a lane mask (all bits or
// none): (a & m) | (b & ~m) is m ? a : b. Vectors pass by reference and are reinterpreted
// by copies: passed or returned by value, GCC warns that their ABI differs between the
// AVX2 clone and the baseline.
inline void F16Lanes(const U32x8& h, F32x8& out) {  // F16ToF32
  const U32x8 sign = (h & 0x8000u) << 16, em = h & 0x7FFFu;
  const U32x8 normal = (em << 13) + (112u << 23);
  const F32x8 sub_value = __builtin_convertvector((I32x8)em, F32x8) * 5.9604644775390625e-8f;
  U32x8 subnormal;
  std::memcpy(&subnormal, &sub_value, sizeof subnormal);
  const U32x8 inf_nan = (em << 13) | 0x7F800000u;
  const U32x8 is_inf_nan = (U32x8)(em >= 0x7C00u), is_sub = (U32x8)(em < 0x0400u);
  const U32x8 finite = (subnormal & is_sub) | (normal & ~is_sub);
  const U32x8 bits = ((inf_nan & is_inf_nan) | (finite & ~is_inf_nan)) | sign;
  std::memcpy(&out, &bits, sizeof out);
}
inline void RoundToBf16(const F32x8& f, U32x8& out) {  // F32ToBf16
  U32x8 u;
  std::memcpy(&u, &f, sizeof u);
  const U32x8 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const U32x8 is_nan = (U32x8)((u & 0x7FFFFFFFu) > 0x7F800000u);
  out = (((u >> 16) | 0x40u) & is_nan) | (rounded & ~is_nan);
}
inline void RoundToF16(const F32x8& f, U32x8& out) {  // F32ToF16
  U32x8 u;
  std::memcpy(&u, &f, sizeof u);
  const U32x8 sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  const U32x8 normal = (a - (112u << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
  F32x8 abs_value;
  std::memcpy(&abs_value, &a, sizeof abs_value);
  const F32x8 sub_value = abs_value + 0.5f;
  U32x8 subnormal;
  std::memcpy(&subnormal, &sub_value, sizeof subnormal);
  subnormal -= 0x3F000000u;
  const U32x8 is_sub = (U32x8)(a < (113u << 23)), is_inf = (U32x8)(a >= 0x477FF000u),
              is_nan = (U32x8)(a > 0x7F800000u);
  U32x8 o = (subnormal & is_sub) | (normal & ~is_sub);
  o = (0x7C00u & is_inf) | (o & ~is_inf);
  o = (0x7E00u & is_nan) | (o & ~is_nan);
  out = o | sign;
}

// Whether a combine from In's rows writes its Out-typed result straight from the lanes
// (float32, or half precision rows to the same type); otherwise SumSlots leaves float32
// sums in column order for StoreRow.
template <typename In, typename Out>
constexpr bool kStoresDirect =
    std::is_same_v<Out, F32T> ||
    (std::is_same_v<In, Out> && (std::is_same_v<In, BF16T> || std::is_same_v<In, F16T>));

// How far ahead in each row the combine asks for lines (bytes): the loop takes one line
// of each of a token's rows in turn, and bfloat16's conversions leave the out-of-order
// window room for fewer lines in flight than its reads need. Measured on the 2-core
// development VM (one thread per core, 8 ranks): 4 lines ahead took the bfloat16
// combine from 42 to 37 ms at T=4096, H=1024 and from 7.9 to 5.8 ms at T=128, H=7168,
// float32's within noise; 8 lines ahead, or the next token's first lines, did no better.
constexpr int kSumPrefetchBytes = 256;

// Copies kBytes (a multiple of 16) of a line's sums into the result; with kStream, whose
// caller has checked that dst is 16-byte aligned, in streaming stores, which it fences
// when the result is complete (cpu/result_stores.h says when results are written so, and
// why). SSE2 only, so that both builds of the kernels inline it. A template parameter,
// not an argument: the loop that does not stream is then the very instructions of one
// that never could, where a run-time flag made GCC build a longer loop (276 instructions
// against 235 for bfloat16's AVX2 clone).
template <size_t kBytes, bool kStream>
inline void StoreLineBytes(void* dst, const void* src) {
  static_assert(kBytes % 16 == 0);
#ifdef JAXCOMM_STREAMING_STORES
  if constexpr (kStream) return StreamAligned(dst, src, kBytes);
#endif
  std::memcpy(dst, src, kBytes);
}

// The combine's row kernels (RowLine, StoreLine, SumSlots: moe_sum_rows.inc), built
// twice: portable (the baseline and AVX2 clones of cpu/cpu_clones.h), and, on x86-64 with
// GCC, for CPUs with AVX2 and F16C, whose float16 lines convert in one instruction per eight
// columns (vcvtph2ps, vcvtps2ph) where the portable kernels take about twenty integer
// operations. GCC 12 converts _Float16 vectors one element at a time, and an intrinsic
// inlines only into a function built for its instructions, so the whole kernel is built a
// second time under `#pragma GCC target`, in its own namespace.
namespace portable {
#define JAXCOMM_HW_F16 0
#define JAXCOMM_SUM_KERNEL JAXCOMM_ROW_KERNEL
#include "cpu/moe_sum_rows.inc"
#undef JAXCOMM_SUM_KERNEL
#undef JAXCOMM_HW_F16
}  // namespace portable

#if JAXCOMM_F16C_KERNELS
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
namespace f16c {
#define JAXCOMM_HW_F16 1
#define JAXCOMM_SUM_KERNEL
#include "cpu/moe_sum_rows.inc"
#undef JAXCOMM_SUM_KERNEL
#undef JAXCOMM_HW_F16
}  // namespace f16c
#pragma GCC pop_options

#endif

// Whether this build has the f16c kernels and this CPU can run them (JAXCOMM_CPU_F16C
// decides whether they are used).
inline bool HasF16c() {
#if JAXCOMM_F16C_KERNELS
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
#else
  return false;
#endif
}

// The combine of one token (see moe_sum_rows.inc): the f16c kernel for float16 rows or
// results where `use_f16c` (which only HasF16c() may turn on), else the portable one.
// `stream`: the lines written straight into `out` go in streaming stores (StoreLineBytes),
// only where `out` is 16-byte aligned.
template <typename In, typename Out>
void SumSlots(void* out, float* y32, const void* const* rows, const float* a, const bool* opens, int n,
              int64_t H, bool use_f16c, bool stream) {
  const auto sum = [&](auto streams) {
    constexpr bool kStream = decltype(streams)::value;
#if JAXCOMM_F16C_KERNELS
    if constexpr (std::is_same_v<In, F16T> || std::is_same_v<Out, F16T>) {
      if (use_f16c) return f16c::SumSlots<In, Out, kStream>(out, y32, rows, a, opens, n, H);
    }
#endif
    (void)use_f16c;
    portable::SumSlots<In, Out, kStream>(out, y32, rows, a, opens, n, H);
  };
  if (stream && reinterpret_cast<uintptr_t>(out) % 16 == 0) {
    sum(std::true_type{});
  } else {
    sum(std::false_type{});
  }
}

// dst = acc in Out's type.
template <typename Out>
JAXCOMM_ROW_KERNEL void StoreRow(void* dst, const float* __restrict acc, int64_t n) {
  auto* __restrict out = static_cast<typename Out::Storage*>(dst);
  for (int64_t h = 0; h < n; ++h) out[h] = Out::Store(acc[h]);
}
// dst = a * x, converted from In's type to Out's: the loop inlined into the row kernels
// below, so that each of their CPU-specific builds vectorises it for its own instructions.
template <typename In, typename Out>
inline void ScaleConvert(void* dst, const void* x, float a, int64_t n) {
  const auto* __restrict in = static_cast<const typename In::Storage*>(x);
  auto* __restrict out = static_cast<typename Out::Storage*>(dst);
  for (int64_t h = 0; h < n; ++h) out[h] = Out::Store(a * In::Load(in[h]));
}
// A transport's scaled gather row: dst[n] = a * x[n], from In's type to Out's.
template <typename In, typename Out>
JAXCOMM_ROW_KERNEL void ConvertRow(void* dst, const void* x, float a, int64_t n) {
  ScaleConvert<In, Out>(dst, x, a, n);
}
// sum_h x[h] * y[h] in float32, with eight independent partial sums (one accumulator is a
// dependency chain the compiler may not reorder into vectors). Every build sums the same
// lanes in the same order, so the bits do not depend on the CPU.
template <typename X, typename Y>
JAXCOMM_ROW_KERNEL float DotRow(const void* xv, const void* yv, int64_t n) {
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
inline uint32_t BlockAmaxBits(const void* xv, int64_t n) {
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
// Built for AVX2 too (JAXCOMM_ROW_KERNEL): the conversions are integer and select
// operations, 2.4x as fast eight lanes wide as four (0.49 against 1.19 ns an element,
// docs/benchmarks.md, 2026-12-07).
template <typename In>
JAXCOMM_ROW_KERNEL void QuantizeRowE4M3(const void* xv, int64_t H, uint8_t* q, float* scales) {
  const auto* x = static_cast<const typename In::Storage*>(xv);
  for (int64_t b = 0, h0 = 0; h0 < H; ++b, h0 += kFp8Block) {
    const int64_t n = H - h0 < kFp8Block ? H - h0 : kFp8Block;
    const Fp8BlockScale s = Fp8ScaleOf(BlockAmaxBits<In>(x + h0, n));
    ScaleConvert<In, E4M3T>(q + h0, x + h0, s.multiplier, n);
    scales[b] = s.scale;
  }
}

// E4M3ToF32 of every code, built from it once: the dequantizing loop looks codes up (one
// gather for eight) where converting them takes a dozen vector operations: 0.33 against
// 0.55 ns an element with AVX2, and the same bits (docs/benchmarks.md, 2026-12-07).
inline const float* E4M3Values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> v{};
    for (int c = 0; c < 256; ++c) v[c] = E4M3ToF32(static_cast<uint8_t>(c));
    return v;
  }();
  return values.data();
}

// dst[H] (Out's type) = e4m3 row q * its block scales.
template <typename Out>
JAXCOMM_ROW_KERNEL void DequantizeRowE4M3(void* dst, const uint8_t* q, const float* scales, int64_t H) {
  auto* __restrict out = static_cast<typename Out::Storage*>(dst);
  const float* __restrict value = E4M3Values();
  for (int64_t b = 0, h0 = 0; h0 < H; ++b, h0 += kFp8Block) {
    const int64_t end = H - h0 < kFp8Block ? H : h0 + kFp8Block;
    const float scale = scales[b];
    for (int64_t h = h0; h < end; ++h) out[h] = Out::Store(MulRn(scale, value[q[h]]));
  }
}

}  // namespace jaxcomm::cpu
