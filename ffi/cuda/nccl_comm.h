// NCCL communicators, one per (group, rank) actually used, shared by every executable of
// the process.
//
// Every communicator is created non-blocking (ncclConfig_t::blocking = 0): NCCL then never
// waits inside a call; a call that is not finished returns ncclInProgress, and jaxcomm
// polls it (ncclCommGetAsyncError) against the call's deadline. So no thread is ever stuck
// in NCCL: a creation or an enqueue that runs past its deadline aborts the communicator
// (ncclCommAbort) and fails with a message naming the call. Collectives that hang on the
// device (a rank that never launched its part) are caught by the completion watcher
// (watcher.h), which aborts the communicator too; a communicator aborted for any reason
// fails every later call with the reason.
//
// Unique ids: a group inside this process makes its own; a group spanning processes gets
// it from the jax.distributed key-value store when the program is lowered
// (jaxcomm/_src/cuda_runtime.py) and SetUniqueId.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/call_context.h"
#include "cuda/nccl.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {

namespace ffi = xla::ffi;
using Clock = std::chrono::steady_clock;

// One NCCL communicator; destroyed with it unless aborted (RAII).
class Communicator {
 public:
  Communicator(const NcclApi* api, ncclComm_t comm, std::string key, int rank, int size,
               double create_ms, int64_t memory_bytes)
      : api_(api), comm_(comm), key_(std::move(key)), rank_(rank), size_(size),
        create_ms_(create_ms), memory_bytes_(memory_bytes) {}
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  const NcclApi& api() const { return *api_; }
  const std::string& key() const { return key_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  double create_ms() const { return create_ms_; }
  // Device memory that went away while NCCL set the communicator up (free-memory delta).
  int64_t memory_bytes() const { return memory_bytes_; }

  // Runs `call` (one NCCL call, or a group from ncclGroupStart to ncclGroupEnd) with the
  // communicator, then polls while NCCL reports it in progress, until `deadline`. On an
  // error or the deadline it aborts the communicator; the error names `ctx` and `what`.
  ffi::Error Run(const CallContext& ctx, const char* what,
                 const std::function<ncclResult_t(ncclComm_t)>& call, Clock::time_point deadline);
  // NCCL's asynchronous error state (ncclSuccess, ncclInProgress or an error); ncclSuccess
  // once aborted.
  ncclResult_t AsyncError();
  // Aborts (deadline passed on the device, or an asynchronous error) unless a call holds
  // the communicator right now (then false: that call has a deadline of its own). Every
  // later call fails with `why`.
  bool TryAbort(const std::string& why);
  // Why the communicator was aborted, or "".
  std::string failure() const;

 private:
  // Under mu_.
  void AbortLocked(const std::string& why);

  const NcclApi* api_;
  ncclComm_t comm_;
  std::string key_;
  int rank_, size_;
  double create_ms_;
  int64_t memory_bytes_;
  mutable std::mutex mu_;  // held by a call for its whole enqueue, and by an abort
  std::string failure_;
};

// The process's communicators and the unique ids of groups that span processes.
class CommRegistry {
 public:
  // The communicator of group `key` for `rank` on local device `ordinal`, created on first
  // use: returns once every rank joined, or fails at `timeout` (the half-made communicator
  // aborted). Thread-safe: the ranks of one process call it concurrently.
  ffi::ErrorOr<std::shared_ptr<Communicator>> Acquire(const std::string& key, int rank, int size,
                                                      int ordinal, bool spans_processes,
                                                      std::chrono::milliseconds timeout,
                                                      const std::string& where);
  // Sets the unique id of a group that spans processes (from the key-value store).
  void SetUniqueId(const std::string& key, const ncclUniqueId& id);

  struct Stats {
    std::string key;
    int rank, size;
    double create_ms;
    int64_t memory_bytes;
    std::string failure;
  };
  std::vector<Stats> List();

 private:
  std::mutex mu_;
  std::map<std::pair<std::string, int>, std::shared_ptr<Communicator>> comms_;
  std::map<std::string, ncclUniqueId> ids_;
  // One creation at a time per (group, rank): two instructions initializing on one device
  // at once must not both join NCCL with the same id for the same rank.
  std::map<std::pair<std::string, int>, std::shared_ptr<std::timed_mutex>> creating_;
};

}  // namespace jaxcomm::cuda
