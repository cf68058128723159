#include "cuda/ipc.h"

#include <cuda.h>

#include <cstring>
#include <sstream>

#include "core/registry.h"
#include "core/round.h"  // Mix
#include "cuda/backend.h"
#include "cuda/device_guard.h"
#include "cuda/process_exchange.h"

namespace jaxcomm::cuda {
namespace {

std::string Bytes(const void* p, size_t n) { return std::string(static_cast<const char*>(p), n); }

// cuMemGetAddressRange, the one driver call jaxcomm needs (the runtime has no equivalent),
// found through the runtime so that nothing links libcuda directly.
using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
GetAddressRangeFn AddressRange(std::string* error) {
  static GetAddressRangeFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault,
                                                           &status);
#else
    // CUDA 12.0-12.4 have no ...ByVersion; this one gives the runtime's version of the call.
    const cudaError_t e = cudaGetDriverEntryPoint("cuMemGetAddressRange", &p, cudaEnableDefault, &status);
#endif
    if (e != cudaSuccess || status != cudaDriverEntryPointSuccess) {
      return static_cast<GetAddressRangeFn>(nullptr);
    }
    return reinterpret_cast<GetAddressRangeFn>(p);
  }();
  if (fn == nullptr) *error = "the CUDA driver has no cuMemGetAddressRange";
  return fn;
}

}  // namespace

std::string IpcRegistry::Export(const void* ptr, int device, IpcBuffer* out) {
  std::memset(out, 0, sizeof(*out));
  if (ptr == nullptr) return "";
  std::string error;
  GetAddressRangeFn range = AddressRange(&error);
  if (range == nullptr) return error;
  CUdeviceptr base = 0;
  size_t size = 0;
  if (range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
    return "cuMemGetAddressRange failed for a buffer of device " + std::to_string(device);
  }
  out->present = 1;
  out->offset = reinterpret_cast<uintptr_t>(ptr) - static_cast<uintptr_t>(base);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = exported_.find(static_cast<uintptr_t>(base));
  if (it != exported_.end() && it->second.first == size) {
    out->handle = it->second.second;
    return "";
  }
  DeviceGuard guard(device);
  if (!guard.ok()) return guard.error();
  const cudaError_t e = cudaIpcGetMemHandle(&out->handle, reinterpret_cast<void*>(base));
  if (e != cudaSuccess) {
    return std::string("cudaIpcGetMemHandle: ") + cudaGetErrorString(e) +
           " (XLA's allocator must hand out cudaMalloc'ed memory; with "
           "XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async or platform-specific pools CUDA IPC "
           "cannot export it)";
  }
  exported_[static_cast<uintptr_t>(base)] = {size, out->handle};
  return "";
}

std::string IpcRegistry::Import(const IpcBuffer& b, int device, const void** out) {
  *out = nullptr;
  if (!b.present) return "";
  const auto key = std::make_pair(Bytes(&b.handle, sizeof(b.handle)), device);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = mapped_.find(key);
  if (it == mapped_.end()) {
    DeviceGuard guard(device);
    if (!guard.ok()) return guard.error();
    void* base = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&base, b.handle, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      return std::string("cudaIpcOpenMemHandle of a peer process's buffer: ") + cudaGetErrorString(e);
    }
    it = mapped_.emplace(key, base).first;
  }
  *out = static_cast<const char*>(it->second) + b.offset;
  return "";
}

std::string IpcRegistry::ImportEvent(const cudaIpcEventHandle_t& h, int device, cudaEvent_t* out) {
  const auto key = std::make_pair(Bytes(&h, sizeof(h)), device);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = events_.find(key);
  if (it == events_.end()) {
    DeviceGuard guard(device);
    if (!guard.ok()) return guard.error();
    cudaEvent_t e = nullptr;
    const cudaError_t r = cudaIpcOpenEventHandle(&e, h);
    if (r != cudaSuccess) return std::string("cudaIpcOpenEventHandle: ") + cudaGetErrorString(r);
    it = events_.emplace(key, e).first;
  }
  *out = it->second;
  return "";
}

ProcessPeerRoute::ProcessPeerRoute(uint64_t key, int rank, std::vector<int64_t> processes,
                                   const std::vector<int64_t>& partitions, int device,
                                   std::unique_ptr<DeviceEvents> events)
    : rank_(rank), processes_(std::move(processes)), device_(device), events_(std::move(events)) {
  std::vector<int64_t> peers;
  std::vector<std::string> desc;
  for (size_t r = 0; r < processes_.size(); ++r) {
    if (static_cast<int>(r) == rank_) continue;
    peers.push_back(processes_[r]);
    // As the host backend's rounds name a process's ranks in the transport's messages.
    desc.push_back(RankList({static_cast<int>(r)}, partitions));
  }
  records_ = MakePlan(Mix(key, 0x6970637265630000ull), peers, sizeof(IpcRecord), desc);  // "ipcrec"
  finished_ = MakePlan(Mix(key, 0x6970636669000000ull), peers, 1, desc);              // "ipcfi"
  for (int64_t p : records_->peers) {
    for (size_t r = 0; r < processes_.size(); ++r) {
      if (processes_[r] == p && static_cast<int>(r) != rank_) rank_of_peer_.push_back(static_cast<int>(r));
    }
  }
}

std::string ProcessPeerRoute::Init() {
  DeviceGuard guard(device_);
  if (!guard.ok()) return guard.error();
  cudaError_t e = cudaIpcGetEventHandle(&ready_handle_, events_->ready());
  if (e == cudaSuccess) e = cudaIpcGetEventHandle(&done_handle_, events_->done());
  return e == cudaSuccess ? "" : std::string("cudaIpcGetEventHandle: ") + cudaGetErrorString(e);
}

ffi::Error ProcessPeerRoute::Failed(const CallContext& ctx, const std::string& phase,
                                    const std::string& error, bool timed_out) const {
  return ffi::Error(timed_out ? ffi::ErrorCode::kDeadlineExceeded : ffi::ErrorCode::kInternal,
                    ctx.Describe() + ": " + phase + " (CUDA IPC with the group's other processes): " + error);
}

ffi::ErrorOr<std::vector<PeerInfo>> ProcessPeerRoute::Exchange(const PeerCallKey& key, int rank, int size,
                                                               const PeerInfo& mine,
                                                               std::chrono::milliseconds timeout,
                                                               const CallContext& ctx) {
  IpcRegistry& ipc = Backend::Get().ipc();
  IpcRecord record;
  std::memset(&record, 0, sizeof(record));
  for (size_t i = 0; i < mine.ptr.size(); ++i) {
    std::string e = ipc.Export(mine.ptr[i], device_, &record.buffers[i]);
    if (!e.empty()) return ffi::Unexpected(Failed(ctx, "exporting this rank's buffers", e, false));
  }
  record.ready = ready_handle_;
  record.done = done_handle_;
  std::vector<std::string> theirs;
  bool timed_out = false;
  const std::string error = ExchangeRecords(records_, key.execution, Bytes(&record, sizeof(record)),
                                            std::chrono::steady_clock::now() + timeout, &theirs, &timed_out);
  if (!error.empty()) {
    // Meeting the peers is the host backend's cross-process exchange: at its deadline, its
    // words as the host backend's rounds give them (which processes never came).
    if (timed_out) return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kDeadlineExceeded, ctx.Describe() + ": " + error));
    return ffi::Unexpected(Failed(ctx, "meeting the peers at this call", error, timed_out));
  }
  std::vector<PeerInfo> all(size);
  all[rank] = mine;
  for (size_t i = 0; i < theirs.size(); ++i) {
    IpcRecord peer;
    std::memcpy(&peer, theirs[i].data(), sizeof(peer));
    PeerInfo& info = all[rank_of_peer_[i]];
    std::string e = ipc.ImportEvent(peer.ready, device_, &info.ready);
    if (e.empty()) e = ipc.ImportEvent(peer.done, device_, &info.done);
    for (size_t b = 0; b < peer.buffers.size() && e.empty(); ++b) {
      e = ipc.Import(peer.buffers[b], device_, &info.ptr[b]);
    }
    if (!e.empty()) {
      return ffi::Unexpected(Failed(ctx, "mapping rank " + std::to_string(rank_of_peer_[i]) + "'s buffers", e, false));
    }
  }
  return all;
}

ffi::Error ProcessPeerRoute::Finish(const PeerCallKey& key, int, std::chrono::milliseconds timeout,
                                    const CallContext& ctx) {
  std::vector<std::string> theirs;
  bool timed_out = false;
  const std::string error = ExchangeRecords(finished_, key.execution, std::string(1, '\1'),
                                            std::chrono::steady_clock::now() + timeout, &theirs, &timed_out);
  return error.empty() ? ffi::Error::Success()
                       : Failed(ctx, "waiting for the peers to enqueue their reads", error, timed_out);
}

}  // namespace jaxcomm::cuda
