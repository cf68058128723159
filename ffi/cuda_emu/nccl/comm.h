// One rank's communicator of the mock NCCL.
//
// How ranks meet: the unique id carries a random name; every rank maps the control segment
// /jxnccl_<name>_ctl (POSIX shared memory), writes its entry (rank, device, host) and
// waits for all the others: NCCL's bootstrap, with its duplicate-GPU check. How data
// moves: each operation's part from each rank is a segment of its own, named after the
// operation (collectives by the communicator's collective count, sends by the count of
// messages from that rank to that peer, which is how NCCL pairs them), written by its
// owner and read by the ranks that need it; the owner removes the name once every reader
// opened it. All of this runs where NCCL's kernels would run: on the caller's CUDA stream,
// as a host function (cudaLaunchHostFunc), in stream order. Only the public runtime API is
// used, so it runs on the emulated runtime (ffi/cuda_emu/runtime) unchanged.
//
// Every wait has a deadline (JAXCOMM_NCCL_MOCK_TIMEOUT_S, default 300 s: where NCCL would
// wait until aborted) and ends early when this communicator, or the peer it waits for, is aborted. A
// failure on the stream becomes the communicator's asynchronous error
// (ncclCommGetAsyncError), its message the communicator's last error (ncclGetLastError).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_emu/nccl/nccl_abi.h"
#include "cuda_emu/nccl/shm_segment.h"

namespace jaxcomm::nccl_mock {

using Clock = std::chrono::steady_clock;

enum class Kind : uint32_t { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kSend, kRecv };
const char* KindName(Kind kind);

// One enqueued NCCL call.
struct Op {
  Kind kind;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;  // NCCL's count argument: per rank for all_gather and reduce_scatter
  ncclDataType_t type = ncclUint8;
  ncclRedOp_t red = ncclSum;
  int peer = 0;      // the root of a broadcast, the peer of a send or receive
  uint64_t seq = 0;  // set at launch: which collective, or which message of this pair
  cudaStream_t stream = nullptr;
};

// The unique id's contents: a name that no other communicator has.
void MakeUniqueId(ncclUniqueId* id);

class Comm : public std::enable_shared_from_this<Comm> {
 public:
  // The ranks of `id`; nothing is joined before Init.
  Comm(const ncclUniqueId& id, int nranks, int rank, bool blocking);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  // Checks the id and the calling thread's device, then joins the other ranks: here when
  // blocking (the result), else on a thread of its own (ncclInProgress, or an error found
  // before starting it).
  ncclResult_t Init();
  // ncclSuccess, ncclInProgress (joining, or finalizing with work on a stream) or the
  // communicator's error.
  ncclResult_t AsyncError() const;
  // ncclSuccess when operations may be enqueued, else the error (and *why).
  ncclResult_t CheckReady(std::string* why) const;
  // Numbers `ops` (in call order) and enqueues them on `stream` as one host function.
  ncclResult_t Launch(std::vector<Op> ops, cudaStream_t stream, std::string* why);
  // Waits (blocking) or lets AsyncError wait (non-blocking) for the enqueued work.
  ncclResult_t Finalize(std::string* why);
  // Stops everything: the joining thread, and every wait on a stream, which then returns
  // without its result; peers waiting for this rank fail with ncclRemoteError.
  void Abort();
  // Stops joining if that is still going (destroying a half-made communicator).
  void StopJoining();

  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  bool blocking() const { return blocking_; }
  // The first error's message, or "" (a stable pointer once set: it is set once).
  const char* error_message() const;

 private:
  struct Work;
  static void RunWork(void* work);

  ncclResult_t Join();
  void RunOps(const std::vector<Op>& ops);
  ncclResult_t Fail(ncclResult_t r, const std::string& why);  // records the first error
  static constexpr int kNoPeer = -1, kAnyPeer = -2;
  // Polls `done` until it is true or sets *why: deadline passed, this communicator
  // aborted, or rank `peer` (or any, or none) aborted. `done` may fail by setting its
  // argument.
  ncclResult_t Wait(const std::function<bool(std::string*)>& done, Clock::time_point deadline, int peer,
                    const std::string& waiting_for, std::string* why);
  // A rank (`peer`, or any other with kAnyPeer) that aborted, or -1.
  int AbortedPeer(int peer) const;
  std::string Name(const std::string& suffix) const;
  std::string Who() const;

  const std::string prefix_;  // of every segment name, from the unique id
  const bool id_valid_;
  const int nranks_, rank_;
  const bool blocking_;
  std::vector<std::string> config_errors_;  // a malformed JAXCOMM_NCCL_MOCK_TIMEOUT_S
  const std::chrono::milliseconds timeout_;
  int device_ = -1;
  int64_t bus_id_ = 0;
  uint64_t host_hash_ = 0;

  ShmSegment ctl_;  // the control segment, mapped for the communicator's life
  std::thread joining_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> finalizing_{false};
  std::atomic<int> state_{ncclInProgress};  // the asynchronous state
  std::atomic<int> outstanding_{0};         // host functions enqueued and not finished

  // The first error, set once: its text never changes, so error_message()'s pointer stays
  // valid (ncclGetLastError hands it out) while other threads fail the communicator too.
  std::mutex error_mu_;
  std::unique_ptr<const std::string> error_;
  std::atomic<const char*> error_text_{""};

  std::mutex launch_mu_;  // numbering and enqueueing, in one order
  uint64_t collectives_ = 0;
  std::vector<uint64_t> sent_, received_;  // per peer
};

}  // namespace jaxcomm::nccl_mock
