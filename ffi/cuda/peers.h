// The peer routes (routes.h): the ranks of a group read each other's buffers in place, in
// stream order, without NCCL. Within one process through peer access (LocalPeers, here);
// across the processes of one host through CUDA IPC (ProcessPeers, ipc.h). Both meet
// through this interface.
//
// Per call: each rank records `ready` on its stream and publishes its pointers (phase 1);
// once all have, every rank makes its stream wait for the peers' `ready` that it reads,
// enqueues its reads, records `done` and says so (phase 2); once all have, every rank's
// stream waits for the `done` of the peers that read it, so no rank reuses a buffer a
// peer still reads. The host waits only for the peers' handlers to enqueue, never for the
// device, and with a deadline. A call is known by the instruction, its group and the
// execution count of that instruction on this device (the same on every rank: each runs
// the instruction once per execution), so the iterations of a loop never meet each other.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/call_context.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {

namespace ffi = xla::ffi;

// What one rank publishes for one call; buffers as the handler lists them (nullptr:
// unused), events recorded on the rank's stream.
struct PeerInfo {
  std::array<const void*, 6> ptr{};
  cudaEvent_t ready = nullptr;
  cudaEvent_t done = nullptr;
};

// Which call of a group: (run id, execution of the instruction on this device, group).
struct PeerCallKey {
  int64_t run_id = 0;
  int64_t execution = 0;
  int group = 0;
  bool operator<(const PeerCallKey& o) const {
    return std::tie(run_id, execution, group) < std::tie(o.run_id, o.execution, o.group);
  }
};

class PeerRendezvous {
 public:
  virtual ~PeerRendezvous() = default;
  // This rank's two events, recorded by the caller: `ready` before phase 1, `done` after
  // its reads. Created on the rank's device when the route is set up.
  virtual cudaEvent_t ready() const = 0;
  virtual cudaEvent_t done() const = 0;
  // Phase 1: publishes `mine` and returns every rank's info, usable by this rank (a peer
  // process's pointers mapped into this one, its events opened), once all published.
  virtual ffi::ErrorOr<std::vector<PeerInfo>> Exchange(const PeerCallKey& key, int rank, int size,
                                                       const PeerInfo& mine,
                                                       std::chrono::milliseconds timeout,
                                                       const CallContext& ctx) = 0;
  // Phase 2: this rank's reads are enqueued (its `done` recorded); returns once every
  // rank's are.
  virtual ffi::Error Finish(const PeerCallKey& key, int rank, std::chrono::milliseconds timeout,
                            const CallContext& ctx) = 0;
};

// Two events one device reuses for every call of one instruction (reuse is safe: a peer's
// wait is enqueued before the event can be recorded again). `interprocess`: exportable
// through CUDA IPC (ipc.h).
class DeviceEvents {
 public:
  DeviceEvents() = default;
  ~DeviceEvents();
  DeviceEvents(const DeviceEvents&) = delete;
  DeviceEvents& operator=(const DeviceEvents&) = delete;
  // Creates both events on `device`; "" or the failed call.
  std::string Create(int device, bool interprocess);
  cudaEvent_t ready() const { return ready_; }
  cudaEvent_t done() const { return done_; }

 private:
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t done_ = nullptr;
};

// The in-process meeting point of one instruction's ranks (all GPUs of this process).
class LocalPeers {
 public:
  ffi::ErrorOr<std::vector<PeerInfo>> Exchange(const PeerCallKey& key, int rank, int size,
                                               const PeerInfo& mine, std::chrono::milliseconds timeout,
                                               const CallContext& ctx);
  ffi::Error Finish(const PeerCallKey& key, int rank, std::chrono::milliseconds timeout,
                    const CallContext& ctx);

 private:
  // One call. Phase 1 has one deadline for all its ranks, from the first arrival, as a
  // round of the host backend (core/rendezvous.cc): when it passes, every rank waiting
  // fails with the same message, and a rank that comes later is told it arrived too late.
  struct Round {
    Round(int size, std::chrono::steady_clock::time_point deadline)
        : infos(size), published(size, false), finished(size, false), deadline(deadline) {}
    std::vector<PeerInfo> infos;
    std::vector<bool> published, finished;
    int n_published = 0, n_finished = 0, n_left = 0;
    std::chrono::steady_clock::time_point deadline;  // phase 1's
    std::string expired;  // phase 1's deadline passed: why (core/deadline_message.h)
  };
  ffi::Error Wait(std::unique_lock<std::mutex>& lock, const std::shared_ptr<Round>& round, bool phase2,
                  std::chrono::milliseconds timeout, const CallContext& ctx);
  void Leave(const PeerCallKey& key);

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<PeerCallKey, std::shared_ptr<Round>> rounds_;
};

// One device's view of LocalPeers: its events and the shared meeting point.
class LocalPeerRoute : public PeerRendezvous {
 public:
  LocalPeerRoute(std::shared_ptr<LocalPeers> peers, std::unique_ptr<DeviceEvents> events)
      : peers_(std::move(peers)), events_(std::move(events)) {}
  cudaEvent_t ready() const override { return events_->ready(); }
  cudaEvent_t done() const override { return events_->done(); }
  ffi::ErrorOr<std::vector<PeerInfo>> Exchange(const PeerCallKey& key, int rank, int size,
                                               const PeerInfo& mine, std::chrono::milliseconds timeout,
                                               const CallContext& ctx) override {
    return peers_->Exchange(key, rank, size, mine, timeout, ctx);
  }
  ffi::Error Finish(const PeerCallKey& key, int rank, std::chrono::milliseconds timeout,
                    const CallContext& ctx) override {
    return peers_->Finish(key, rank, timeout, ctx);
  }

 private:
  std::shared_ptr<LocalPeers> peers_;
  std::unique_ptr<DeviceEvents> events_;
};

// Enables peer access from `device` to every other device in `peers` (a device never
// needs access to itself); "" or why it cannot.
std::string EnablePeerAccess(int device, const std::vector<int>& peers);

}  // namespace jaxcomm::cuda
