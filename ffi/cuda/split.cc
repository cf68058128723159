#include "cuda/split.h"

#include <string>

#include "cuda/device_guard.h"
#include "cuda/state.h"

namespace jaxcomm::cuda {

namespace ffi = xla::ffi;

ffi::ErrorOr<cudaStream_t> SplitSends::Stream(int device, const CallContext& ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(device);
  if (it != streams_.end()) return it->second;
  auto make = [&](cudaStream_t* s) -> ffi::Error {
    DeviceGuard guard(device);
    if (!guard.ok()) return ffi::Error::Internal(ctx.Describe() + ": " + guard.error());
    int least = 0, greatest = 0;
    JAXCOMM_CUDA_CHECK(ctx, cudaDeviceGetStreamPriorityRange(&least, &greatest));
    JAXCOMM_CUDA_CHECK(ctx, cudaStreamCreateWithPriority(s, cudaStreamNonBlocking, greatest));
    return ffi::Error::Success();
  };
  cudaStream_t s = nullptr;
  if (ffi::Error e = make(&s); e.failure()) return ffi::Unexpected(e);
  streams_[device] = s;
  return s;
}

void SplitSends::Put(int device, const void* data, PendingSend pending) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_[{device, data}] = std::move(pending);
}

bool SplitSends::Take(int device, const void* data, PendingSend* out) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find({device, data});
  if (it == pending_.end()) return false;
  *out = std::move(it->second);
  pending_.erase(it);
  return true;
}

ffi::Error MakeCallEvents(int device, const CallContext& ctx, OwnedEvent* ready, OwnedEvent* done) {
  DeviceGuard guard(device);
  if (!guard.ok()) return ffi::Error::Internal(ctx.Describe() + ": " + guard.error());
  cudaEvent_t a = nullptr, b = nullptr;
  JAXCOMM_CUDA_CHECK(ctx, cudaEventCreateWithFlags(&a, cudaEventDisableTiming));
  ready->reset(a);
  JAXCOMM_CUDA_CHECK(ctx, cudaEventCreateWithFlags(&b, cudaEventDisableTiming));
  done->reset(b);
  return ffi::Error::Success();
}

}  // namespace jaxcomm::cuda
