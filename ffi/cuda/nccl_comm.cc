#include "cuda/nccl_comm.h"

#include <cuda_runtime_api.h>

#include <sstream>
#include <thread>

#include "cuda/device_guard.h"

namespace jaxcomm::cuda {
namespace {

// Polls `state` while it says ncclInProgress, yielding first, then sleeping: creation can
// take seconds, an enqueue microseconds.
template <typename Poll>
ncclResult_t WaitWhileInProgress(ncclResult_t r, Clock::time_point deadline, Poll&& poll, bool* timed_out) {
  *timed_out = false;
  const auto spin_until = Clock::now() + std::chrono::microseconds(200);
  while (r == ncclInProgress) {
    const auto now = Clock::now();
    if (now >= deadline) {
      *timed_out = true;
      return r;
    }
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    r = poll();
  }
  return r;
}

// A communicator's state: its error, or ncclInProgress while a call (or its creation)
// is still going, else ncclSuccess.
ncclResult_t State(const NcclApi& api, ncclComm_t comm) {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t q = api.CommGetAsyncError(comm, &state);
  return q != ncclSuccess ? q : state;
}

std::string Millis(Clock::duration d) {
  return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(d).count()) + " ms";
}

}  // namespace

Communicator::~Communicator() {
  std::lock_guard<std::mutex> lock(mu_);
  if (comm_ != nullptr) api_->CommDestroy(comm_);
}

void Communicator::AbortLocked(const std::string& why) {
  if (comm_ == nullptr) return;
  api_->CommAbort(comm_);  // frees the communicator; a kernel waiting inside it exits
  comm_ = nullptr;
  failure_ = why;
}

ffi::Error Communicator::Run(const CallContext& ctx, const char* what,
                             const std::function<ncclResult_t(ncclComm_t)>& call,
                             Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(mu_);
  if (comm_ == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      ctx.Describe() + ": the NCCL communicator of group " + key_ +
                          " was aborted earlier: " + failure_);
  }
  const auto started = Clock::now();
  ncclResult_t r = call(comm_);
  bool timed_out = false;
  r = WaitWhileInProgress(r, deadline, [&] { return State(*api_, comm_); }, &timed_out);
  if (r == ncclSuccess) return ffi::Error::Success();
  std::ostringstream msg;
  msg << ctx.Describe() << ": " << what << " (group " << key_ << ", rank " << rank_ << " of " << size_
      << ") ";
  if (timed_out) {
    msg << "was still in progress in NCCL after " << Millis(Clock::now() - started)
        << " (timeout_s / JAXCOMM_TIMEOUT_S): some rank of the group never took part (NCCL "
           "does not say which; python -m jaxcomm.trace analyze on every process's dump does)";
  } else {
    msg << "failed: " << api_->Describe(r, comm_);
  }
  msg << "; the communicator was aborted";
  AbortLocked(msg.str());
  return ffi::Error(timed_out ? ffi::ErrorCode::kDeadlineExceeded : ffi::ErrorCode::kInternal, msg.str());
}

ncclResult_t Communicator::AsyncError() {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock() || comm_ == nullptr) return ncclSuccess;
  return State(*api_, comm_);
}

bool Communicator::TryAbort(const std::string& why) {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  AbortLocked(why);
  return true;
}

std::string Communicator::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void CommRegistry::SetUniqueId(const std::string& key, const ncclUniqueId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  ids_[key] = id;
}

std::vector<CommRegistry::Stats> CommRegistry::List() {
  std::vector<std::shared_ptr<Communicator>> comms;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [k, c] : comms_) comms.push_back(c);
  }
  std::vector<Stats> out;
  for (const auto& c : comms) {
    out.push_back({c->key(), c->rank(), c->size(), c->create_ms(), c->memory_bytes(), c->failure()});
  }
  return out;
}

ffi::ErrorOr<std::shared_ptr<Communicator>> CommRegistry::Acquire(
    const std::string& key, int rank, int size, int ordinal, bool spans_processes,
    std::chrono::milliseconds timeout, const std::string& where) {
  const auto deadline = Clock::now() + timeout;
  std::string load_error;
  const NcclApi* api = NcclApi::Get(&load_error);
  if (api == nullptr) return ffi::Unexpected(ffi::Error::Internal(where + ": " + load_error));
  std::shared_ptr<std::timed_mutex> creating;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = comms_.find({key, rank});
    if (found != comms_.end()) return found->second;
    auto& slot = creating_[{key, rank}];
    if (!slot) slot = std::make_shared<std::timed_mutex>();
    creating = slot;
  }
  std::unique_lock<std::timed_mutex> one_at_a_time(*creating, std::defer_lock);
  if (!one_at_a_time.try_lock_until(deadline)) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                                      where + ": another creation of the NCCL communicator of group " +
                                          key + " for rank " + std::to_string(rank) +
                                          " did not finish within " + std::to_string(timeout.count()) + " ms"));
  }
  ncclUniqueId id{};
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = comms_.find({key, rank});
    if (found != comms_.end()) return found->second;
    auto known = ids_.find(key);
    if (known != ids_.end()) {
      id = known->second;
    } else if (spans_processes) {
      return ffi::Unexpected(ffi::Error::Internal(
          where + ": no NCCL unique id for group " + key +
          " (a group spanning processes gets it from the jax.distributed key-value store when "
          "the program is lowered; was jax.distributed.initialize() called?)"));
    } else {
      // All ranks live in this process: whichever rank comes first makes the id.
      const ncclResult_t r = api->GetUniqueId(&id);
      if (r != ncclSuccess) {
        return ffi::Unexpected(ffi::Error::Internal(
            where + ": ncclGetUniqueId failed: " + api->Describe(r, nullptr)));
      }
      ids_[key] = id;
    }
  }
  const std::string what = where + ": creating the NCCL communicator of group " + key + " (rank " +
                           std::to_string(rank) + " of " + std::to_string(size) + ")";
  DeviceGuard device(ordinal);
  if (!device.ok()) return ffi::Unexpected(ffi::Error::Internal(what + ": " + device.error()));
  size_t free_before = 0, free_after = 0, total = 0;
  cudaMemGetInfo(&free_before, &total);
  const auto t0 = Clock::now();
  ncclConfig_t config = NcclConfig(/*blocking=*/0);
  ncclComm_t comm = nullptr;
  ncclResult_t r = api->CommInitRankConfig(&comm, size, id, rank, &config);
  bool timed_out = false;
  r = WaitWhileInProgress(r, deadline, [&] { return State(*api, comm); }, &timed_out);
  if (r != ncclSuccess) {
    const std::string why = timed_out ? "did not finish within " + std::to_string(timeout.count()) +
                                            " ms (timeout_s / JAXCOMM_TIMEOUT_S): some rank of the "
                                            "group never joined"
                                      : "failed: " + api->Describe(r, comm);
    if (comm != nullptr) api->CommAbort(comm);  // nothing of it stays behind, no thread waits
    return ffi::Unexpected(ffi::Error(timed_out ? ffi::ErrorCode::kDeadlineExceeded : ffi::ErrorCode::kInternal,
                                      what + " " + why));
  }
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  cudaMemGetInfo(&free_after, &total);
  auto made = std::make_shared<Communicator>(api, comm, key, rank, size, ms,
                                             static_cast<int64_t>(free_before) - static_cast<int64_t>(free_after));
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = comms_.emplace(std::make_pair(key, rank), made);
  return it->second;
}

}  // namespace jaxcomm::cuda
