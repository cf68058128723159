// Row kernels of the host MoE transports over half precision and FP8 (float8_e4m3fn)
// rows: loops the compiler vectorises around the element conversions of
// core/number_formats.h (shared with the CUDA kernels, so both backends round alike).
// XLA:CPU converts half precision one element at a time: the MoE combine of bfloat16 rows
// took 4.3x as long as float32's through XLA's conversions.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/number_formats.h"

namespace jaxcomm::cpu {

// Element types of the transports' float operands and results.
enum class Real : uint8_t { kF32, kBF16, kF16, kE4M3 };

inline int RealBytes(Real t) { return t == Real::kF32 ? 4 : t == Real::kE4M3 ? 1 : 2; }

// The element tags (F32T, BF16T, F16T, E4M3T) are core/number_formats.h's: the row kernels
// below are templates over them, so that each instantiation is one straight loop the
// compiler vectorises.

// The combine's row kernels (SumSlots, StoreRow) are built twice on x86-64 with GCC, for
// the baseline (SSE2: an 8-lane vector is two registers) and for AVX2 (one register), the
// one the CPU runs chosen when the module loads (an ifunc). AVX2 only, not FMA:
// contracting a * x + y would change the rounding (the build also passes
// -ffp-contract=off).
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

// One 64-byte cache line of a row of In's type, as float32 lanes. The lanes are in column
// order, except half precision's: each 16 columns are loaded as eight 32-bit words, whose
// low halves are the even columns and whose high halves the odd ones, converted lane by
// lane with integer operations (bfloat16: two per 16 columns) in place of widening
// shuffles. Sums never mix lanes, so the order only matters when a line is stored
// (StoreLine).
template <typename In>
struct RowLine {
  using Storage = typename In::Storage;
  static constexpr int kColumns = 64 / static_cast<int>(sizeof(Storage));
  static constexpr int kVecs = kColumns / 8;
  static constexpr bool kEvenOdd = std::is_same_v<In, BF16T> || std::is_same_v<In, F16T>;

  static void Load(const Storage* x, F32x8* v) {
    if constexpr (std::is_same_v<In, BF16T>) {
      for (int i = 0; i < kVecs / 2; ++i) {
        U32x8 w;
        std::memcpy(&w, x + 16 * i, sizeof w);
        const U32x8 even = w << 16, odd = w & 0xFFFF0000u;
        std::memcpy(&v[2 * i], &even, sizeof even);
        std::memcpy(&v[2 * i + 1], &odd, sizeof odd);
      }
    } else if constexpr (std::is_same_v<In, F16T>) {
      for (int i = 0; i < kVecs / 2; ++i) {
        U32x8 w;
        std::memcpy(&w, x + 16 * i, sizeof w);
        const U32x8 even = w & 0xFFFFu, odd = w >> 16;
        F16Lanes(even, v[2 * i]);
        F16Lanes(odd, v[2 * i + 1]);
      }
    } else if constexpr (std::is_same_v<In, F32T>) {
      // One copy per vector: a single 64-byte copy went through the stack in 16-byte
      // pieces, and the vector reads of them stalled on store forwarding.
      for (int i = 0; i < kVecs; ++i) std::memcpy(&v[i], x + 8 * i, sizeof v[i]);
    } else {
      for (int i = 0; i < kVecs; ++i) {
        for (int l = 0; l < 8; ++l) v[i][l] = In::Load(x[8 * i + l]);
      }
    }
  }
};

// Whether a combine from In's rows writes its Out-typed result straight from the lanes
// (float32, or half precision rows to the same type); otherwise SumSlots leaves float32
// sums in column order for StoreRow.
template <typename In, typename Out>
constexpr bool kStoresDirect =
    std::is_same_v<Out, F32T> || (std::is_same_v<In, Out> && RowLine<In>::kEvenOdd);

// Stores a line's sums (RowLine<In>'s lane order) at column h: into `out` (Out's type)
// where kStoresDirect, else into y32 in column order.
template <typename In, typename Out>
inline void StoreLine(void* out, float* y32, int64_t h, const F32x8* v) {
  using Line = RowLine<In>;
  if constexpr (Line::kEvenOdd && std::is_same_v<In, Out>) {
    // Even columns in the low half of each word, odd in the high: little-endian 16-bit
    // pairs, in column order.
    for (int i = 0; i < Line::kVecs / 2; ++i) {
      U32x8 even, odd;
      if constexpr (std::is_same_v<Out, BF16T>) {
        RoundToBf16(v[2 * i], even);
        RoundToBf16(v[2 * i + 1], odd);
      } else {
        RoundToF16(v[2 * i], even);
        RoundToF16(v[2 * i + 1], odd);
      }
      const U32x8 pairs = even | (odd << 16);
      std::memcpy(static_cast<uint16_t*>(out) + h + 16 * i, &pairs, sizeof pairs);
    }
  } else {
    float* y = std::is_same_v<Out, F32T> ? static_cast<float*>(out) : y32;
    if constexpr (Line::kEvenOdd) {
      for (int i = 0; i < Line::kVecs / 2; ++i) {
        for (int l = 0; l < 8; ++l) {
          y[h + 16 * i + 2 * l] = v[2 * i][l];
          y[h + 16 * i + 2 * l + 1] = v[2 * i + 1][l];
        }
      }
    } else {
      for (int i = 0; i < Line::kVecs; ++i) std::memcpy(y + h + 8 * i, &v[i], sizeof v[i]);
    }
  }
}

// How far ahead in each row the combine asks for lines (bytes): the loop takes one line
// of each of a token's rows in turn, and bfloat16's conversions leave the out-of-order
// window room for fewer lines in flight than its reads need. Measured on the 2-core
// development VM (one thread per core, 8 ranks): 4 lines ahead took the bfloat16
// combine from 42 to 37 ms at T=4096, H=1024 and from 7.9 to 5.8 ms at T=128, H=7168,
// float32's within noise; 8 lines ahead, or the next token's first lines, did no better.
constexpr int kSumPrefetchBytes = 256;

// The combine of one token: y[h] = g_0[h] + g_1[h] + ... in float32, left to right, for
// h in [0, H), where group g_i is the sum, left to right, of its slots' a_j * x_j[h] (In's
// type), and `opens[j]` marks the slots that start a group (opens[0] is true). Every
// product and sum is rounded once, so the bits do not depend on how the columns are
// blocked. The running sums live in registers, a cache line of columns at a time: each
// row is read once and each result written once. Starting from -0.0 (x + -0.0 == x for
// every x, signed zeros included) lets the first group be added like the rest. The result
// goes to `out` (Out's type) or, where not kStoresDirect, to y32[H] in float32. n >= 1.
template <typename In, typename Out>
JAXCOMM_ROW_KERNEL void SumSlots(void* out, float* y32, const void* const* rows, const float* a,
                                 const bool* opens, int n, int64_t H) {
  using Line = RowLine<In>;
  using S = typename In::Storage;
  constexpr int kVecs = Line::kVecs;
  int64_t h = 0;
  for (; h + Line::kColumns <= H; h += Line::kColumns) {
    F32x8 s[kVecs], g[kVecs], t[kVecs];
    for (int v = 0; v < kVecs; ++v) s[v] = g[v] = F32x8{-0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f};
    for (int j = 0; j < n; ++j) {
      const S* x = static_cast<const S*>(rows[j]) + h;
      __builtin_prefetch(reinterpret_cast<const char*>(x) + kSumPrefetchBytes);
      Line::Load(x, t);
      if (opens[j]) {
        for (int v = 0; v < kVecs; ++v) {
          s[v] = s[v] + g[v];
          g[v] = a[j] * t[v];
        }
      } else {
        for (int v = 0; v < kVecs; ++v) g[v] = g[v] + a[j] * t[v];
      }
    }
    for (int v = 0; v < kVecs; ++v) s[v] = s[v] + g[v];
    StoreLine<In, Out>(out, y32, h, s);
  }
  for (; h < H; ++h) {
    float s = -0.f, g = -0.f;
    for (int j = 0; j < n; ++j) {
      const float t = a[j] * In::Load(static_cast<const S*>(rows[j])[h]);
      if (opens[j]) {
        s = s + g;
        g = t;
      } else {
        g = g + t;
      }
    }
    s = s + g;
    if constexpr (kStoresDirect<In, Out>) {
      static_cast<typename Out::Storage*>(out)[h] = Out::Store(s);
    } else {
      y32[h] = s;
    }
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
