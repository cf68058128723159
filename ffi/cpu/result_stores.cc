#include "cpu/result_stores.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/registry.h"

namespace jaxcomm::cpu {
namespace {

#ifdef JAXCOMM_STREAMING_STORES
// SSE2 is in every x86-64 CPU, and a copy this large is bound by memory, not by the
// width of the stores. Unaligned head and tail go through memcpy.
template <bool kZero>
void Stream(char* dst, const char* src, size_t n) {
  const size_t head = std::min(n, static_cast<size_t>((16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16));
  const size_t body = (n - head) / 16 * 16, tail = head + body;
  if (kZero) {
    std::memset(dst, 0, head);
    const __m128i zero = _mm_setzero_si128();
    for (size_t i = head; i < tail; i += 16) _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), zero);
    std::memset(dst + tail, 0, n - tail);
  } else {
    std::memcpy(dst, src, head);
    StreamAligned(dst + head, src + head, body);
    std::memcpy(dst + tail, src + tail, n - tail);
  }
  FenceStreamingStores();
}
#endif

}  // namespace

bool StreamsResult(const void* result, size_t result_bytes) {
#ifdef JAXCOMM_STREAMING_STORES
  const int64_t from = Registry::Get().nontemporal_bytes();
  if (from <= 0 || result_bytes < static_cast<size_t>(from)) return false;
  // The page in the middle of the result: the ends may share a page with other data.
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t middle = (reinterpret_cast<uintptr_t>(result) + result_bytes / 2) / page * page;
  unsigned char resident = 0;
  return mincore(reinterpret_cast<void*>(middle), page, &resident) == 0 && (resident & 1) != 0;
#else
  (void)result;
  (void)result_bytes;
  return false;
#endif
}

void StoreResult(void* dst, const void* src, size_t n, bool streaming) {
  if (n == 0 || dst == src) return;
#ifdef JAXCOMM_STREAMING_STORES
  if (streaming) return Stream<false>(static_cast<char*>(dst), static_cast<const char*>(src), n);
#endif
  (void)streaming;
  std::memcpy(dst, src, n);
}

void ZeroResult(void* dst, size_t n, bool streaming) {
  if (n == 0) return;
#ifdef JAXCOMM_STREAMING_STORES
  if (streaming) return Stream<true>(static_cast<char*>(dst), nullptr, n);
#endif
  (void)streaming;
  std::memset(dst, 0, n);
}

}  // namespace jaxcomm::cpu
