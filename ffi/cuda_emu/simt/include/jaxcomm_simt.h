// The SIMT layer: what device code compiled for the host needs (ffi/cuda/kernels.cu,
// rewritten by ffi/cuda_emu/simt/host_cu.py: `K<<<grid, block, shared, stream>>>(args)`
// becomes `::jaxcomm::simt::Launch("K", grid, block, shared, stream, K, args)`, `__shared__`
// variables become per-worker-thread statics, `extern __shared__` arrays the block's
// dynamic shared memory).
//
// A launch is stream work (ffi/cuda_emu/runtime/): the grid's blocks run one after the
// other on the stream's worker thread; a block's threads are fibers (ucontext) that run
// until they reach a barrier: __syncthreads (and _and/_or/_count), __syncwarp and the
// warp collectives (__shfl_*_sync, __ballot_sync, __match_any_sync) wait for every live
// thread of the block or warp, as on the GPU. A barrier some threads never reach is
// reported as a sticky launch failure instead of hanging. Atomics are real atomics
// (blocks of different streams run concurrently). Threads of a warp do not run in lock
// step: code that relies on implicit warp synchrony (without __syncwarp) is wrong on
// Volta and later GPUs too, and may pass or fail here.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_emu/runtime/emu.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict

struct uint3 {
  unsigned int x, y, z;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

namespace jaxcomm::simt {

// The calling fiber's coordinates (valid inside a kernel only).
const uint3& ThreadIdx();
const uint3& BlockIdx();
const dim3& BlockDim();
const dim3& GridDim();
void* DynamicSharedBytes();

template <typename T>
T* DynamicShared() {
  return static_cast<T*>(DynamicSharedBytes());
}

// Barriers and collectives (every live thread of the block / warp takes part).
void SyncThreads();
int SyncThreadsCount(int predicate);  // the number of threads whose predicate was non-zero
void SyncWarp();
uint64_t WarpExchange(uint64_t mine, int src_lane);  // src_lane's value (own if out of range)
unsigned WarpBallot(int predicate);
unsigned WarpMatchAny(uint64_t value);
int LaneId();

// Runs `body` for every thread of `grid` x `block` (on the stream's worker thread).
void RunGrid(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()>& body, const char* name);

template <typename... P, typename... A>
void Launch(const char* name, dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, void (*kernel)(P...), A&&... args) {
  const cudaError_t bad = ::jaxcomm::cuda_emu::CheckLaunch(grid, block, shared_bytes);
  if (bad != cudaSuccess) {
    ::jaxcomm::cuda_emu::SetLastError(bad);  // as a launch: dropped, not sticky
    return;
  }
  // Arguments are copied at launch, as the GPU's parameter buffer is.
  auto params = std::make_shared<std::tuple<std::decay_t<P>...>>(std::forward<A>(args)...);
  const cudaError_t e = ::jaxcomm::cuda_emu::Enqueue(
      stream,
      [name, grid, block, shared_bytes, kernel, params] {
        RunGrid(grid, block, shared_bytes, [&] { std::apply(kernel, *params); }, name);
      },
      "a kernel launch");
  if (e != cudaSuccess) ::jaxcomm::cuda_emu::SetLastError(e);
}

template <typename T>
T Shuffle(T v, int src_lane) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move up to 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = WarpExchange(bits, src_lane);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

}  // namespace jaxcomm::simt

#define threadIdx (::jaxcomm::simt::ThreadIdx())
#define blockIdx (::jaxcomm::simt::BlockIdx())
#define blockDim (::jaxcomm::simt::BlockDim())
#define gridDim (::jaxcomm::simt::GridDim())
constexpr int warpSize = 32;

inline void __syncthreads() { ::jaxcomm::simt::SyncThreads(); }
inline int __syncthreads_count(int p) { return ::jaxcomm::simt::SyncThreadsCount(p); }
inline int __syncthreads_and(int p) {
  const int n = static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
  return ::jaxcomm::simt::SyncThreadsCount(p != 0) == n;
}
inline int __syncthreads_or(int p) { return ::jaxcomm::simt::SyncThreadsCount(p != 0) > 0; }
inline void __syncwarp(unsigned = 0xffffffffu) { ::jaxcomm::simt::SyncWarp(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <typename T>
T __shfl_sync(unsigned, T v, int src, int width = 32) {
  const int lane = ::jaxcomm::simt::LaneId();
  return ::jaxcomm::simt::Shuffle(v, (lane / width) * width + (src % width));
}
template <typename T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
  const int lane = ::jaxcomm::simt::LaneId();
  const int src = lane + static_cast<int>(delta);
  return ::jaxcomm::simt::Shuffle(v, src / width == lane / width ? src : lane);
}
template <typename T>
T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
  const int lane = ::jaxcomm::simt::LaneId();
  const int src = lane - static_cast<int>(delta);
  return ::jaxcomm::simt::Shuffle(v, src >= (lane / width) * width ? src : lane);
}
template <typename T>
T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
  const int lane = ::jaxcomm::simt::LaneId();
  const int src = lane ^ mask;
  return ::jaxcomm::simt::Shuffle(v, src / width == lane / width ? src : lane);
}
inline unsigned __ballot_sync(unsigned, int p) { return ::jaxcomm::simt::WarpBallot(p); }
inline int __all_sync(unsigned m, int p) { return __ballot_sync(m, !p) == 0; }
inline int __any_sync(unsigned m, int p) { return __ballot_sync(m, p) != 0; }
template <typename T>
unsigned __match_any_sync(unsigned, T v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return ::jaxcomm::simt::WarpMatchAny(bits);
}
inline unsigned __activemask() { return __ballot_sync(0xffffffffu, 1); }

// CUDA's global min/max overloads.
inline int max(int a, int b) { return a < b ? b : a; }
inline int min(int a, int b) { return b < a ? b : a; }
inline unsigned max(unsigned a, unsigned b) { return a < b ? b : a; }
inline unsigned min(unsigned a, unsigned b) { return b < a ? b : a; }
inline long long max(long long a, long long b) { return a < b ? b : a; }
inline long long min(long long a, long long b) { return b < a ? b : a; }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }

// Rounded once each (the build compiles device code with -ffp-contract=off).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}

template <typename T>
T atomicAdd(T* p, T v) {
  if constexpr (std::is_integral_v<T>) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
  } else {
    T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (!__atomic_compare_exchange_n(p, &old, static_cast<T>(old + v), true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
  }
}
template <typename T>
T atomicSub(T* p, T v) {
  return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST);
}
template <typename T>
T atomicExch(T* p, T v) {
  return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
template <typename T>
T atomicCAS(T* p, T expected, T desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;
}
template <typename T>
T atomicMax(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
template <typename T>
T atomicMin(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (v < old && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
