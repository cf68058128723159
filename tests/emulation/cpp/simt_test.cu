// Cases for the SIMT layer (ffi/cuda_emu/simt/), one per argv[1]; run by
// tests/emulation/test_cuda_emu_runtime.py, which rewrites this file with host_cu.py (as
// the build does kernels.cu) and compiles it with the host compiler.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "cuda_emu/runtime/emu.h"
#include "expect.h"

namespace emu = jaxcomm::cuda_emu;


namespace {

// Each thread writes its global index; a barrier makes thread 0 see every thread's write.
__global__ void IndexKernel(int* out, int* seen) {
  extern __shared__ int tile[];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  tile[threadIdx.x] = i;
  __syncthreads();
  if (threadIdx.x == 0) {
    int sum = 0;
    for (unsigned t = 0; t < blockDim.x; ++t) sum += tile[t];
    seen[blockIdx.x] = sum;
  }
  out[i] = i;
}

__global__ void WarpKernel(int* out) {
  const int lane = threadIdx.x & 31;
  int v = lane;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  int x = lane;
  for (int o = 16; o > 0; o >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
  const unsigned ballot = __ballot_sync(0xffffffffu, lane % 3 == 0);
  const unsigned match = __match_any_sync(0xffffffffu, lane / 8);
  const int count = __syncthreads_count(lane < 4);
  const int all = __syncthreads_and(threadIdx.x < 1000);
  if (threadIdx.x == 0) {
    out[0] = v;
    out[1] = x;
    out[2] = static_cast<int>(ballot);
    out[4] = count;
    out[5] = all;
  }
  if (threadIdx.x == 9) out[3] = static_cast<int>(match);
  atomicAdd(&out[6], 1);
}

// Half the block waits at a barrier the other half never reaches.
__global__ void DivergentKernel(int* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1;
}

// Threads 0-15 wait at the block's barrier, 16-31 at the warp's, which needs 0-15 too.
__global__ void DeadlockKernel(int* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncwarp();
  }
  out[threadIdx.x] = 1;
}

void Launches() {
  int *out = nullptr, *seen = nullptr;
  OK(cudaMalloc(reinterpret_cast<void**>(&out), 4 * 4 * 64));
  OK(cudaMalloc(reinterpret_cast<void**>(&seen), 4 * 4));
  IndexKernel<<<dim3(4), dim3(64), 64 * sizeof(int), nullptr>>>(out, seen);
  OK(cudaGetLastError());
  std::vector<int> host(256), sums(4);
  OK(cudaMemcpy(host.data(), out, 4 * 256, cudaMemcpyDeviceToHost));
  OK(cudaMemcpy(sums.data(), seen, 16, cudaMemcpyDeviceToHost));
  for (int i = 0; i < 256; ++i) EXPECT_EQ(host[i], i);
  for (int b = 0; b < 4; ++b) EXPECT_EQ(sums[b], 64 * 64 * b + 64 * 63 / 2);
  // A configuration the device refuses: dropped, the error is the thread's last one.
  IndexKernel<<<dim3(1), dim3(2048), 0, nullptr>>>(out, seen);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  IndexKernel<<<dim3(1), dim3(64), 64 * 1024, nullptr>>>(out, seen);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  OK(cudaDeviceSynchronize());
  OK(cudaFree(out));
  OK(cudaFree(seen));
}

void Warps() {
  int* out = nullptr;
  OK(cudaMalloc(reinterpret_cast<void**>(&out), 4 * 8));
  OK(cudaMemset(out, 0, 4 * 8));
  WarpKernel<<<dim3(1), dim3(64), 0, nullptr>>>(out);
  std::vector<int> host(8);
  OK(cudaMemcpy(host.data(), out, 4 * 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(host[0], 31 * 32 / 2);   // the warp's sum of lanes
  EXPECT_EQ(host[1], 31);            // its maximum
  EXPECT_EQ(static_cast<unsigned>(host[2]), 0x49249249u);  // lanes 0, 3, 6, ...
  EXPECT_EQ(static_cast<unsigned>(host[3]), 0x0000ff00u);  // lanes 8..15 share lane/8 == 1
  EXPECT_EQ(host[4], 8);             // lanes 0..3 of both warps
  EXPECT_EQ(host[5], 1);
  EXPECT_EQ(host[6], 64);
  OK(cudaFree(out));
}

void Deadlock() {
  int* out = nullptr;
  OK(cudaMalloc(reinterpret_cast<void**>(&out), 4 * 32));
  DivergentKernel<<<dim3(1), dim3(32), 0, nullptr>>>(out);
  OK(cudaGetLastError());  // the launch itself was fine
  // Threads that returned count as arrived (as on the GPU): no deadlock here.
  OK(cudaDeviceSynchronize());
  // A real deadlock: reported as a sticky launch failure instead of a hang.
  DeadlockKernel<<<dim3(1), dim3(32), 0, nullptr>>>(out);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorLaunchFailure);
  if (emu::StickyErrorWhy().find("deadlocked") == std::string::npos) std::exit(1);
  emu::ResetStickyErrorForTests();
  OK(cudaFree(out));
}

}  // namespace

int main(int argc, char** argv) {
  const std::map<std::string, std::function<void()>> cases = {
      {"launches", Launches}, {"warps", Warps}, {"barriers", Deadlock}};
  if (argc == 2 && std::string(argv[1]) == "--list") {
    for (auto& [name, f] : cases) std::printf("%s\n", name.c_str());
    return 0;
  }
  if (argc != 2 || !cases.count(argv[1])) return 2;
  cases.at(argv[1])();
  return emu::TakeStrictViolations().empty() ? 0 : 1;
}
