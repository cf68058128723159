// The CUDA backend's own NCCL code (ffi/cuda/nccl.cc, nccl_comm.cc: the dlopen loader, the
// registry's non-blocking creation, Communicator::Run's polling and abort) on the mock
// NCCL and the emulated runtime, in one process with a thread per rank, as the backend
// runs the GPUs of one process. Built and run by tests/emulation/test_nccl_mock.py:
//
//   backend_check all_reduce R      R ranks all-reduce and all-to-all (a group); prints OK
//   backend_check absent R          rank R-1 never comes: the others' creation fails at
//                                   its deadline with the backend's message (printed)
//
// Exit code 0 when every check held; the first failure is printed to stderr.
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/nccl_comm.h"

namespace jaxcomm::cuda {
namespace {

std::mutex out_mu;
std::atomic<bool> failed{false};

void Check(bool ok, const std::string& what) {
  if (ok) return;
  std::lock_guard<std::mutex> lock(out_mu);
  std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  failed = true;
}

CallContext Context(int rank, const std::vector<int64_t>& group) {
  CallContext ctx;
  ctx.op = "all_reduce";
  ctx.call_site = "backend_check.cc";
  ctx.axis = "x";
  ctx.group = &group;
  ctx.rank = rank;
  ctx.partition = rank;
  return ctx;
}

// Rank `rank` of `size` on device `rank`: creates its communicator, then all-reduces R
// floats and exchanges one float with every rank (ncclSend/ncclRecv in a group, as
// nccl_ops.cc's all_to_all does), checking both against the expected values.
void AllReduceRank(CommRegistry* registry, int rank, int size) {
  const std::vector<int64_t> group = [&] {
    std::vector<int64_t> g;
    for (int r = 0; r < size; ++r) g.push_back(r);
    return g;
  }();
  const CallContext ctx = Context(rank, group);
  auto comm = registry->Acquire("check", rank, size, rank, /*spans_processes=*/false, std::chrono::seconds(60),
                                "backend_check rank " + std::to_string(rank));
  if (comm.has_error()) return Check(false, std::string(comm.error().message()));
  const NcclApi& nccl = (*comm)->api();
  Check(cudaSetDevice(rank) == cudaSuccess, "cudaSetDevice");
  cudaStream_t stream;
  Check(cudaStreamCreate(&stream) == cudaSuccess, "cudaStreamCreate");
  const size_t n = static_cast<size_t>(size);
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>((rank + 1) * 100 + i);
  float *x = nullptr, *y = nullptr, *z = nullptr;
  Check(cudaMalloc(reinterpret_cast<void**>(&x), n * sizeof(float)) == cudaSuccess, "cudaMalloc");
  Check(cudaMalloc(reinterpret_cast<void**>(&y), n * sizeof(float)) == cudaSuccess, "cudaMalloc");
  Check(cudaMalloc(reinterpret_cast<void**>(&z), n * sizeof(float)) == cudaSuccess, "cudaMalloc");
  Check(cudaMemcpy(x, host.data(), n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess, "cudaMemcpy");
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  ffi::Error e = (*comm)->Run(ctx, "ncclAllReduce", [&](ncclComm_t c) {
    return nccl.AllReduce(x, y, n, ncclFloat32, ncclSum, c, stream);
  }, deadline);
  Check(e.success(), "Run(ncclAllReduce): " + std::string(e.message()));
  e = (*comm)->Run(ctx, "ncclSend/ncclRecv (all_to_all)", [&](ncclComm_t c) {
    ncclResult_t r = nccl.GroupStart();
    for (int p = 0; p < size && r == ncclSuccess; ++p) {
      r = nccl.Send(x + p, sizeof(float), ncclUint8, p, c, stream);
      if (r == ncclSuccess) r = nccl.Recv(z + p, sizeof(float), ncclUint8, p, c, stream);
    }
    const ncclResult_t end = nccl.GroupEnd();
    return r != ncclSuccess ? r : end;
  }, deadline);
  Check(e.success(), "Run(all_to_all): " + std::string(e.message()));
  std::vector<float> sum(n), exchanged(n);
  Check(cudaStreamSynchronize(stream) == cudaSuccess, "cudaStreamSynchronize");
  Check(cudaMemcpy(sum.data(), y, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess, "cudaMemcpy");
  Check(cudaMemcpy(exchanged.data(), z, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess, "cudaMemcpy");
  for (size_t i = 0; i < n; ++i) {
    // sum over ranks r of (r + 1) * 100 + i; rank p sent us its element `rank`.
    const float want = static_cast<float>(100 * size * (size + 1) / 2 + size * static_cast<int>(i));
    Check(sum[i] == want, "rank " + std::to_string(rank) + " all_reduce[" + std::to_string(i) + "] = " +
                              std::to_string(sum[i]) + ", want " + std::to_string(want));
    const float sent = static_cast<float>((static_cast<int>(i) + 1) * 100 + rank);
    Check(exchanged[i] == sent, "rank " + std::to_string(rank) + " all_to_all[" + std::to_string(i) + "] = " +
                                    std::to_string(exchanged[i]) + ", want " + std::to_string(sent));
  }
  Check((*comm)->AsyncError() == ncclSuccess, "AsyncError after the calls");
  cudaFree(x);
  cudaFree(y);
  cudaFree(z);
  cudaStreamDestroy(stream);
}

int Main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: backend_check all_reduce|absent R\n");
    return 2;
  }
  const std::string mode = argv[1];
  const int size = std::atoi(argv[2]);
  CommRegistry registry;
  std::vector<std::thread> ranks;
  if (mode == "all_reduce") {
    for (int r = 0; r < size; ++r) ranks.emplace_back(AllReduceRank, &registry, r, size);
  } else if (mode == "absent") {
    for (int r = 0; r + 1 < size; ++r) {
      ranks.emplace_back([&registry, r, size] {
        auto comm = registry.Acquire("check", r, size, r, false, std::chrono::milliseconds(1000),
                                     "backend_check rank " + std::to_string(r));
        Check(comm.has_error(), "the creation without rank " + std::to_string(size - 1) + " succeeded");
        if (!comm.has_error()) return;
        std::lock_guard<std::mutex> lock(out_mu);
        std::printf("%s\n", std::string(comm.error().message()).c_str());
      });
    }
  } else {
    std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 2;
  }
  for (auto& t : ranks) t.join();
  std::string error;
  const NcclApi* api = NcclApi::Get(&error);
  Check(api != nullptr && api->path == "libjaxcomm_nccl_mock.so", "loaded " + (api ? api->path : error));
  if (!failed) std::printf("OK\n");
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace jaxcomm::cuda

int main(int argc, char** argv) { return jaxcomm::cuda::Main(argc, argv); }
