// The process-peers route (routes.h): one rank per process, all processes on one host,
// each reading the others' buffers in place through CUDA IPC. Every call exchanges, over
// the host backend's shared-memory links (process_exchange.h), one record per rank: its
// buffers as (IPC handle of the allocation, offset) and its two events' IPC handles.
// A process opens each peer allocation and event once and keeps the mapping (XLA's
// allocator keeps its large regions for the life of the process), so after the first
// calls an exchange costs two small shared-memory rounds and no driver call but the
// address lookup of each buffer.
//
// Ranks on the same GPU (several processes sharing one device) need no peer access:
// CUDA IPC maps the same device's memory into the other process.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/cross_process.h"
#include "cuda/peers.h"

namespace jaxcomm::cuda {

// One buffer as a peer process can open it.
struct IpcBuffer {
  cudaIpcMemHandle_t handle;
  uint64_t offset;  // of the buffer in its allocation
  uint8_t present;  // 0: no buffer (nullptr)
};

// What a rank sends its peers for one call (plain bytes: it crosses processes).
struct IpcRecord {
  std::array<IpcBuffer, 6> buffers;
  cudaIpcEventHandle_t ready, done;
};

// This process's exported allocations and its mappings of the peers'. Thread-safe.
class IpcRegistry {
 public:
  // `ptr` (device memory of `device`) as a handle of its allocation and an offset.
  std::string Export(const void* ptr, int device, IpcBuffer* out);
  // This process's address of a peer's buffer, mapped on `device` on first use.
  std::string Import(const IpcBuffer& b, int device, const void** out);
  // A peer's event, opened on first use.
  std::string ImportEvent(const cudaIpcEventHandle_t& h, int device, cudaEvent_t* out);

 private:
  std::mutex mu_;
  // Exported allocations by base address: (size, handle). A region freed and
  // reallocated at the same address with another size gets a new handle.
  std::map<uintptr_t, std::pair<size_t, cudaIpcMemHandle_t>> exported_;
  // Mapped peer allocations and opened peer events, by handle bytes and device.
  std::map<std::pair<std::string, int>, void*> mapped_;
  std::map<std::pair<std::string, int>, cudaEvent_t> events_;
};

// One device's rank in a group of the process-peers route.
class ProcessPeerRoute : public PeerRendezvous {
 public:
  // `processes[r]`: the process of rank r, `partitions[r]` its partition; `key`: the
  // (instruction, group) key shared by every process (core/call_attrs.h's InstructionKey
  // mixed with the group index).
  ProcessPeerRoute(uint64_t key, int rank, std::vector<int64_t> processes, const std::vector<int64_t>& partitions,
                   int device, std::unique_ptr<DeviceEvents> events);
  // Exports this rank's events; "" or why not.
  std::string Init();
  cudaEvent_t ready() const override { return events_->ready(); }
  cudaEvent_t done() const override { return events_->done(); }
  ffi::ErrorOr<std::vector<PeerInfo>> Exchange(const PeerCallKey& key, int rank, int size,
                                               const PeerInfo& mine, std::chrono::milliseconds timeout,
                                               const CallContext& ctx) override;
  ffi::Error Finish(const PeerCallKey& key, int rank, std::chrono::milliseconds timeout,
                    const CallContext& ctx) override;

 private:
  ffi::Error Failed(const CallContext& ctx, const std::string& phase, const std::string& error,
                    bool timed_out) const;

  int rank_;
  std::vector<int64_t> processes_;
  int device_;
  std::unique_ptr<DeviceEvents> events_;
  cudaIpcEventHandle_t ready_handle_{}, done_handle_{};
  std::shared_ptr<const ExchangePlan> records_, finished_;
  std::vector<int> rank_of_peer_;  // plan order -> rank
};

}  // namespace jaxcomm::cuda
