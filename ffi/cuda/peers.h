// Direct peer access between the GPUs of one process: ranks of a group whose devices all
// live in this process exchange buffer pointers and CUDA events on the host, then read
// each other's memory (copy engine or kernels) in stream order, without NCCL.
//
// Per call: each rank records `ready` on its stream and publishes its pointers (phase 1);
// once all have, every rank makes its stream wait for the peers' `ready`, enqueues its
// reads, records `done` and publishes that (phase 2); once all have, every rank's stream
// waits for the others' `done`, so no rank reuses a buffer a peer still reads. The host
// waits only for the peers' handlers to enqueue, never for the device, and with a deadline.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "core/call_context.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {

namespace ffi = xla::ffi;

// Two events one device reuses for every call of one instruction (see above why reuse
// is safe: a peer's wait is enqueued before the event can be recorded again).
class DeviceEvents {
 public:
  DeviceEvents() = default;
  ~DeviceEvents();
  DeviceEvents(const DeviceEvents&) = delete;
  DeviceEvents& operator=(const DeviceEvents&) = delete;
  // Creates both events on `device`; "" or the failed call.
  std::string Create(int device);
  cudaEvent_t ready() const { return ready_; }
  cudaEvent_t done() const { return done_; }

 private:
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t done_ = nullptr;
};

// What one rank publishes for one call.
struct PeerInfo {
  std::array<const void*, 6> ptr{};  // op-specific buffers (see the handler)
  cudaEvent_t ready = nullptr;
  cudaEvent_t done = nullptr;
};

class PeerExchange {
 public:
  // Phase 1: publishes `mine` and returns every rank's info once all published.
  ffi::ErrorOr<std::vector<PeerInfo>> Exchange(int64_t run_id, int group, int rank, int size,
                                               const PeerInfo& mine, std::chrono::milliseconds timeout,
                                               const CallContext& ctx);
  // Phase 2: this rank's reads are enqueued (its `done` recorded); returns once every rank's are.
  ffi::Error Finish(int64_t run_id, int group, int rank, std::chrono::milliseconds timeout,
                    const CallContext& ctx);

 private:
  struct Round {
    explicit Round(int size) : infos(size), published(size, false), finished(size, false) {}
    std::vector<PeerInfo> infos;
    std::vector<bool> published, finished;
    int n_published = 0, n_finished = 0, n_left = 0;
  };
  using Key = std::pair<int64_t, int>;  // (run id, group index)
  ffi::Error Wait(std::unique_lock<std::mutex>& lock, const Key& key, bool phase2,
                  std::chrono::milliseconds timeout, const CallContext& ctx);
  void Leave(const Key& key);

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, std::shared_ptr<Round>> rounds_;
};

// Enables peer access from `device` to every device in `peers`; "" or why it cannot.
std::string EnablePeerAccess(int device, const std::vector<int>& peers);

}  // namespace jaxcomm::cuda
