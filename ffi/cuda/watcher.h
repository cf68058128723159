// Watches the calls the CUDA handlers enqueued until the device finished them: it feeds
// the flight recorder (pending when enqueued on the host, active once the stream reached
// the call, done once it passed it) and enforces NCCL calls' deadlines on the device.
//
// The handlers only enqueue, so a collective that a rank never joins hangs on the
// device, not in a handler. Each call is bracketed by two events (from a pool) on its
// stream; one thread polls them. A NCCL call still running `timeout` after its start
// event completed, or whose communicator reports an asynchronous error, has its
// communicator aborted (the kernel exits, the stream moves on with an undefined result),
// the error recorded with the call (and dumped) and logged; every later call on that
// communicator fails with it (nccl_comm.h).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/group_info.h"
#include "cuda/nccl_comm.h"

namespace jaxcomm::cuda {

// One call being watched; made by Begin, handed to End or Abandon.
struct Watch {
  std::shared_ptr<const GroupInfo> info;
  std::shared_ptr<Communicator> comm;  // NCCL calls: deadline and asynchronous errors
  int device = 0;
  int rank = 0;
  int64_t partition = -1, execution = 0;
  std::chrono::milliseconds timeout{0};
  uint64_t trace = 0;  // flight recorder handle (0: not recorded)
  cudaEvent_t start = nullptr, end = nullptr;
  // NCCL calls: set once the watcher is done with the call (its error, if any, is then
  // the communicator's failure()); the emulation's handlers wait for it (handlers.cc).
  std::shared_ptr<std::atomic<bool>> finished;
  // Set by the watcher thread.
  Clock::time_point started{};
};

class CompletionWatcher {
 public:
  CompletionWatcher() = default;
  // The backend (backend.h) is never destroyed (CUDA tears down at exit under it); a
  // watcher that is stops its thread first.
  ~CompletionWatcher();
  CompletionWatcher(const CompletionWatcher&) = delete;
  CompletionWatcher& operator=(const CompletionWatcher&) = delete;

  // Before enqueueing a call: records it with the flight recorder and, when it is
  // recorded or runs NCCL, a start event on `stream`. `execution` counts from 1.
  Watch Begin(std::shared_ptr<const GroupInfo> info, std::shared_ptr<Communicator> comm, int device,
              int rank, int64_t partition, int64_t execution, std::chrono::milliseconds timeout,
              int64_t run_id, uint8_t dtype, int64_t elements, int64_t bytes, cudaStream_t stream);
  // After enqueueing it: an end event, and the call joins the watched ones.
  void End(Watch w, cudaStream_t stream);
  // The call failed on the host (nothing, or part of it, was enqueued). `dump`: a
  // deadline or its consequence, dumped as the host backend dumps its timeouts.
  void Abandon(Watch w, const std::string& error, bool dump = false);

  // Calls watched right now (tests).
  size_t pending();
  // Whether the watcher aborted the NCCL call of `info`'s group at `execution` at its
  // deadline (GroupInfo::deadline_aborted): a rank that comes now is too late, and the
  // emulation's handlers report it as the call's own error (handlers.cc).
  static bool TimedOut(const GroupInfo* info, int64_t execution);

 private:
  cudaEvent_t Take(int device);
  void Give(int device, cudaEvent_t e);
  void Loop();
  // One pass over the watched calls; true when `w` is finished with.
  bool Check(Watch& w, Clock::time_point now);
  void Finish(const Watch& w, const std::string& error);
  static void MarkTimedOut(const GroupInfo* info, int64_t execution);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Watch> watched_;
  std::map<int, std::vector<cudaEvent_t>> free_;  // per device
  bool stop_ = false;
  std::once_flag started_;
  std::thread thread_;
};

}  // namespace jaxcomm::cuda
