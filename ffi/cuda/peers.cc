#include "cuda/peers.h"

#include <sstream>
#include <string>

#include "core/deadline_message.h"
#include "cuda/device_guard.h"

namespace jaxcomm::cuda {

DeviceEvents::~DeviceEvents() {
  if (ready_ != nullptr) cudaEventDestroy(ready_);
  if (done_ != nullptr) cudaEventDestroy(done_);
}

std::string DeviceEvents::Create(int device, bool interprocess) {
  DeviceGuard guard(device);
  if (!guard.ok()) return guard.error();
  const unsigned flags = cudaEventDisableTiming | (interprocess ? cudaEventInterprocess : 0u);
  cudaError_t e = cudaSuccess;
  if (ready_ == nullptr) e = cudaEventCreateWithFlags(&ready_, flags);
  if (e == cudaSuccess && done_ == nullptr) e = cudaEventCreateWithFlags(&done_, flags);
  return e == cudaSuccess ? "" : std::string("creating events on device ") + std::to_string(device) +
                                     ": " + cudaGetErrorString(e);
}

std::string EnablePeerAccess(int device, const std::vector<int>& peers) {
  DeviceGuard guard(device);
  if (!guard.ok()) return guard.error();
  for (int p : peers) {
    if (p == device) continue;  // its own memory: no peer access (enabling it fails)
    int can = 0;
    cudaError_t e = cudaDeviceCanAccessPeer(&can, device, p);
    if (e == cudaSuccess && !can) {
      return "device " + std::to_string(device) + " cannot access device " + std::to_string(p) +
             " directly (no P2P)";
    }
    if (e == cudaSuccess) e = cudaDeviceEnablePeerAccess(p, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // not an error here; clear it
      e = cudaSuccess;
    }
    if (e != cudaSuccess) {
      return std::string("enabling peer access from device ") + std::to_string(device) + " to " +
             std::to_string(p) + ": " + cudaGetErrorString(e);
    }
  }
  return "";
}

ffi::Error LocalPeers::Wait(std::unique_lock<std::mutex>& lock, const std::shared_ptr<Round>& round, bool phase2,
                            std::chrono::milliseconds timeout, const CallContext& ctx) {
  const int size = static_cast<int>(round->infos.size());
  if (!phase2) {
    auto over = [&] { return round->n_published == size || !round->expired.empty(); };
    if (!cv_.wait_until(lock, round->deadline, over)) {
      // The first rank to see the deadline pass says which ranks never came, for all.
      std::vector<int> missing;
      for (int r = 0; r < size; ++r) {
        if (!round->published[r]) missing.push_back(r);
      }
      static const std::vector<int64_t> kNoGroup;
      round->expired = NeverArrivedMessage(timeout, missing, ctx.group != nullptr ? *ctx.group : kNoGroup,
                                           static_cast<size_t>(round->n_published));
      cv_.notify_all();
    }
    if (round->expired.empty()) return ffi::Error::Success();
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, ctx.Describe() + ": " + round->expired);
  }
  // Phase 2: every rank arrived; one that does not finish enqueueing its reads in time
  // is stuck in its handler (rare: phase 2 is joined even when the reads fail).
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (cv_.wait_until(lock, deadline, [&] { return round->n_finished == size; })) return ffi::Error::Success();
  std::ostringstream msg;
  msg << ctx.Describe() << ": timed out after " << timeout.count() / 1000.0
      << " s (timeout_s / JAXCOMM_TIMEOUT_S) waiting for ranks [";
  bool first = true;
  for (int r = 0; r < size; ++r) {
    if (round->finished[r]) continue;
    msg << (first ? "" : ", ") << r;
    first = false;
  }
  msg << "], which arrived at this call, to finish enqueueing their reads; " << round->n_finished << " of "
      << size << " ranks did";
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg.str());
}

void LocalPeers::Leave(const PeerCallKey& key) {
  auto it = rounds_.find(key);
  if (it != rounds_.end() && --it->second->n_left == 0) rounds_.erase(it);
}

ffi::ErrorOr<std::vector<PeerInfo>> LocalPeers::Exchange(const PeerCallKey& key, int rank, int size,
                                                         const PeerInfo& mine,
                                                         std::chrono::milliseconds timeout,
                                                         const CallContext& ctx) {
  std::unique_lock<std::mutex> lock(mu_);
  auto& slot = rounds_[key];
  if (!slot) {
    slot = std::make_shared<Round>(size, std::chrono::steady_clock::now() + timeout);
    slot->n_left = size;
  }
  std::shared_ptr<Round> round = slot;
  if (!round->expired.empty()) {
    // The others gave up on this call already: the host backend's words for it.
    Leave(key);
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                      ctx.Describe() + ": " + std::string(kArrivedTooLate)));
  }
  if (round->published[rank]) {
    return ffi::Unexpected(ffi::Error::Internal(ctx.Describe() + ": rank joined the same call twice"));
  }
  round->infos[rank] = mine;
  round->published[rank] = true;
  ++round->n_published;
  cv_.notify_all();
  ffi::Error e = Wait(lock, round, false, timeout, ctx);
  if (e.failure()) {
    Leave(key);
    return ffi::Unexpected(e);
  }
  return round->infos;
}

ffi::Error LocalPeers::Finish(const PeerCallKey& key, int rank, std::chrono::milliseconds timeout,
                              const CallContext& ctx) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = rounds_.find(key);
  if (it == rounds_.end()) return ffi::Error::Internal(ctx.Describe() + ": call not found");
  std::shared_ptr<Round> round = it->second;
  round->finished[rank] = true;
  ++round->n_finished;
  cv_.notify_all();
  ffi::Error e = Wait(lock, round, true, timeout, ctx);
  Leave(key);
  return e;
}

}  // namespace jaxcomm::cuda
