// Which CPU-specific builds the host kernels get. With GCC on x86-64, a loop marked
// JAXCOMM_ROW_KERNEL is built twice, for the baseline (SSE2: an 8-lane float vector is two
// registers) and for AVX2 (one register), and the build the CPU can run is chosen when the
// module loads (an ifunc). AVX2 only, not FMA: contracting a * x + y would change the
// rounding, which both backends keep alike. JAXCOMM_F16C_KERNELS also turns on the MoE
// combine's F16C build (cpu/moe_convert.h).
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include <immintrin.h>
#define JAXCOMM_F16C_KERNELS 1
#define JAXCOMM_ROW_KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define JAXCOMM_F16C_KERNELS 0
#define JAXCOMM_ROW_KERNEL
#endif
