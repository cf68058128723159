// How the host kernels write results. Large results are written with non-temporal
// (streaming) stores: a result that does not stay in the caches until it is used would
// otherwise be read from memory before each line is written (read for ownership), which
// costs a third of the memory traffic of a copy. On a 2-core VM whose copies run at
// ~13 GB/s, a 16 MiB all_gather between 2 processes took 2.3-2.7 ms instead of 3.9-4.1.
#pragma once

#include <cstddef>

// Whether this CPU has streaming stores that the host kernels use (SSE2's, in every
// x86-64 CPU); elsewhere results take ordinary stores.
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define JAXCOMM_STREAMING_STORES 1
#endif

namespace jaxcomm::cpu {

// Whether a result (one rank's) is written with streaming stores: from
// JAXCOMM_NONTEMPORAL_BYTES up (Registry::nontemporal_bytes; 0: never), and only into
// memory already in place. A fresh buffer's pages are zeroed by the kernel as they fault
// in, which leaves each line in the cache for an ordinary store to hit, where a streaming
// one would have to evict it first (ppermute of 4 MiB over 8 devices: 3.3 -> 4.1-4.3 ms
// with streaming stores into fresh results). XLA's results come either from memory
// reused whole or from a fresh mapping, so one page tells which.
bool StreamsResult(const void* result, size_t result_bytes);

// memcpy(dst, src, n) into a result; with `streaming`, bypassing the caches. The stores
// are fenced before it returns, so whoever is told that the result is ready sees them.
void StoreResult(void* dst, const void* src, size_t n, bool streaming);

// memset(dst, 0, n) into a result, likewise.
void ZeroResult(void* dst, size_t n, bool streaming);

#ifdef JAXCOMM_STREAMING_STORES
// Copies n bytes (a multiple of 16) from src to dst (16-byte aligned) in streaming stores,
// unfenced (FenceStreamingStores): the body of StoreResult's copies, and the MoE combine's
// lines (StoreLineBytes in cpu/moe_convert.h), where it inlines into both builds of the
// row kernels (SSE2 only).
inline void StreamAligned(void* dst, const void* src, size_t n) {
  for (size_t i = 0; i < n; i += 16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const char*>(src) + i));
    _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<char*>(dst) + i), v);
  }
}
#endif

// Orders the streaming stores this thread has made before its later stores, as
// StoreResult does before it returns: for kernels that write a result in streaming stores
// of their own (the MoE combine's, StoreLineBytes in cpu/moe_convert.h), once the result
// is written.
inline void FenceStreamingStores() {
#ifdef JAXCOMM_STREAMING_STORES
  // Streaming stores are weakly ordered: without the fence a reader that learns of the
  // result through an atomic could still miss some of them.
  _mm_sfence();
#endif
}

}  // namespace jaxcomm::cpu
