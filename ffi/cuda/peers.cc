#include "cuda/peers.h"

#include <sstream>
#include <string>

namespace jaxcomm::cuda {

DeviceEvents::~DeviceEvents() {
  if (ready_ != nullptr) cudaEventDestroy(ready_);
  if (done_ != nullptr) cudaEventDestroy(done_);
}

std::string DeviceEvents::Create(int device) {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess && ready_ == nullptr) e = cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming);
  if (e == cudaSuccess && done_ == nullptr) e = cudaEventCreateWithFlags(&done_, cudaEventDisableTiming);
  cudaSetDevice(previous);
  return e == cudaSuccess ? "" : std::string("creating events on device ") + std::to_string(device) +
                                     ": " + cudaGetErrorString(e);
}

std::string EnablePeerAccess(int device, const std::vector<int>& peers) {
  int previous = 0;
  cudaGetDevice(&previous);
  std::string why;
  cudaError_t e = cudaSetDevice(device);
  for (int p : peers) {
    if (e != cudaSuccess || p == device) continue;
    int can = 0;
    e = cudaDeviceCanAccessPeer(&can, device, p);
    if (e == cudaSuccess && !can) {
      why = "device " + std::to_string(device) + " cannot access device " + std::to_string(p) +
            " directly (no P2P)";
      break;
    }
    if (e == cudaSuccess) {
      e = cudaDeviceEnablePeerAccess(p, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // not an error here; clear it
        e = cudaSuccess;
      }
    }
  }
  if (why.empty() && e != cudaSuccess) {
    why = std::string("enabling peer access from device ") + std::to_string(device) + ": " +
          cudaGetErrorString(e);
  }
  cudaSetDevice(previous);
  return why;
}

ffi::Error PeerExchange::Wait(std::unique_lock<std::mutex>& lock, const Key& key, bool phase2,
                              std::chrono::milliseconds timeout, const CallContext& ctx) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto round = rounds_.at(key);
  const int size = static_cast<int>(round->infos.size());
  auto all = [&] { return (phase2 ? round->n_finished : round->n_published) == size; };
  if (cv_.wait_until(lock, deadline, all)) return ffi::Error::Success();
  std::ostringstream msg;
  msg << ctx.Describe() << ": timed out after " << timeout.count() << " ms waiting for ranks [";
  bool first = true;
  for (int r = 0; r < size; ++r) {
    if (phase2 ? round->finished[r] : round->published[r]) continue;
    msg << (first ? "" : " ") << r;
    first = false;
  }
  msg << "] to " << (phase2 ? "finish enqueueing their reads" : "arrive");
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg.str());
}

void PeerExchange::Leave(const Key& key) {
  auto it = rounds_.find(key);
  if (it != rounds_.end() && --it->second->n_left == 0) rounds_.erase(it);
}

ffi::ErrorOr<std::vector<PeerInfo>> PeerExchange::Exchange(
    int64_t run_id, int group, int rank, int size, const PeerInfo& mine,
    std::chrono::milliseconds timeout, const CallContext& ctx) {
  std::unique_lock<std::mutex> lock(mu_);
  const Key key{run_id, group};
  auto& slot = rounds_[key];
  if (!slot) {
    slot = std::make_shared<Round>(size);
    slot->n_left = size;
  }
  std::shared_ptr<Round> round = slot;
  if (round->published[rank]) {
    return ffi::Unexpected(ffi::Error::Internal(ctx.Describe() + ": rank joined the same call twice"));
  }
  round->infos[rank] = mine;
  round->published[rank] = true;
  ++round->n_published;
  cv_.notify_all();
  ffi::Error e = Wait(lock, key, false, timeout, ctx);
  if (e.failure()) {
    Leave(key);
    return ffi::Unexpected(e);
  }
  return round->infos;
}

ffi::Error PeerExchange::Finish(int64_t run_id, int group, int rank,
                                std::chrono::milliseconds timeout, const CallContext& ctx) {
  std::unique_lock<std::mutex> lock(mu_);
  const Key key{run_id, group};
  auto it = rounds_.find(key);
  if (it == rounds_.end()) return ffi::Error::Internal(ctx.Describe() + ": call not found");
  std::shared_ptr<Round> round = it->second;
  round->finished[rank] = true;
  ++round->n_finished;
  cv_.notify_all();
  ffi::Error e = Wait(lock, key, true, timeout, ctx);
  Leave(key);
  return e;
}

}  // namespace jaxcomm::cuda
