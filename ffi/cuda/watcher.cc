#include "cuda/watcher.h"

#include <cstdio>
#include <sstream>

#include "core/deadline_message.h"
#include "core/registry.h"
#include "core/rendezvous.h"
#include "core/thread_name.h"
#include "cuda/device_guard.h"
#include "cuda/event_query.h"

namespace jaxcomm::cuda {
namespace {

// How often the thread looks at the events while calls are watched. A flight recorder
// entry's start and end times are this coarse; NCCL deadlines are seconds.
constexpr auto kPollPeriod = std::chrono::microseconds(100);

// One rank's entry as FlightRecorder::Finish takes it. Its operand is marked present:
// Finish reads a rank without buffers as left out of a fault-tolerant call (every CUDA
// call's dump said rank 0 was, and the analyzer called that a dead process).
std::vector<Peer> Traced(uint64_t handle) {
  static const char kPresent = 0;
  std::vector<Peer> one(1);
  one[0].trace = handle;
  one[0].in = &kPresent;
  return one;
}

// Each local rank's entry finishes on its own here, where the host backend finishes a
// round's entries together: the round enters jaxcomm.stats() once, with the group's first
// rank in this process (its time, from its own arrival).
bool CountsTheRound(const Watch& w) {
  return w.info->local_ranks.empty() || w.rank == w.info->local_ranks.front();
}

}  // namespace

CompletionWatcher::~CompletionWatcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

cudaEvent_t CompletionWatcher::Take(int device) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& pool = free_[device];
    if (!pool.empty()) {
      cudaEvent_t e = pool.back();
      pool.pop_back();
      return e;
    }
  }
  DeviceGuard guard(device);
  cudaEvent_t e = nullptr;
  if (!guard.ok() || cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) return nullptr;
  return e;
}

void CompletionWatcher::Give(int device, cudaEvent_t e) {
  if (e == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  free_[device].push_back(e);
}

Watch CompletionWatcher::Begin(std::shared_ptr<const GroupInfo> info, std::shared_ptr<Communicator> comm,
                               int device, int rank, int64_t partition, int64_t execution,
                               std::chrono::milliseconds timeout, int64_t run_id, uint8_t dtype,
                               int64_t elements, int64_t bytes, cudaStream_t stream) {
  Watch w;
  w.info = std::move(info);
  w.comm = std::move(comm);
  w.device = device;
  w.rank = rank;
  w.partition = partition;
  w.execution = execution;
  w.timeout = timeout;
  if (w.comm != nullptr) w.finished = std::make_shared<std::atomic<bool>>(false);
  FlightRecorder& rec = Registry::Get().recorder();
  if (rec.enabled() && w.info->site != nullptr) {
    w.trace = rec.Enqueue(partition, w.info->site, rank, run_id, dtype, elements, bytes);
    rec.Arrived(w.trace, execution);
  }
  if (w.trace != 0 || w.comm != nullptr) {
    w.start = Take(device);
    if (w.start != nullptr && cudaEventRecord(w.start, stream) != cudaSuccess) {
      Give(device, w.start);
      w.start = nullptr;
    }
  }
  return w;
}

void CompletionWatcher::End(Watch w, cudaStream_t stream) {
  if (w.start == nullptr) {
    // Not recorded and no deadline to keep (or no event to keep it with): done here.
    Finish(w, "");
    return;
  }
  w.end = Take(w.device);
  if (w.end == nullptr || cudaEventRecord(w.end, stream) != cudaSuccess) {
    Give(w.device, w.end);
    Give(w.device, w.start);
    Finish(w, "");
    return;
  }
  std::call_once(started_, [this] { thread_ = std::thread([this] { Loop(); }); });
  {
    std::lock_guard<std::mutex> lock(mu_);
    watched_.push_back(std::move(w));
  }
  cv_.notify_one();
}

void CompletionWatcher::Abandon(Watch w, const std::string& error, bool dump) {
  Give(w.device, w.start);
  // A failed round counts in jaxcomm.stats() as the host backend's do (calls, failed).
  if (w.trace != 0) Registry::Get().recorder().Finish(Traced(w.trace), error, dump, CountsTheRound(w));
}

size_t CompletionWatcher::pending() {
  std::lock_guard<std::mutex> lock(mu_);
  return watched_.size();
}

void CompletionWatcher::Finish(const Watch& w, const std::string& error) {
  if (w.trace != 0) {
    Registry::Get().recorder().Finish(Traced(w.trace), error, /*dump=*/!error.empty(), CountsTheRound(w));
  }
  if (w.finished) w.finished->store(true, std::memory_order_release);
}

bool CompletionWatcher::Check(Watch& w, Clock::time_point now) {
  if (w.started == Clock::time_point{}) {
    const cudaError_t s = QueryEvent(w.start);
    if (s == cudaSuccess) {
      w.started = now;
      if (w.trace != 0) Registry::Get().recorder().Start(Traced(w.trace));
    } else if (s != cudaErrorNotReady) {
      Finish(w, std::string("the device failed before this call: ") + cudaGetErrorString(s));
      return true;
    }
  }
  const cudaError_t e = QueryEvent(w.end);
  if (e != cudaSuccess && e != cudaErrorNotReady) {
    Finish(w, std::string("the device failed in this call: ") + cudaGetErrorString(e));
    return true;
  }
  const bool ended = e == cudaSuccess;
  if (w.comm == nullptr) {
    if (ended) Finish(w, "");
    return ended;
  }
  const ncclResult_t async = w.comm->AsyncError();
  bool failed = async != ncclSuccess && async != ncclInProgress;
  bool late = !ended && w.started != Clock::time_point{} && now - w.started > w.timeout;
  // This watcher aborted a peer's communicator of this call at the deadline, and NCCL
  // failed this rank's wait with a remote error (its kernel then ended: the stream moved
  // on): the same deadline, not a second fault, and not a success.
  if (failed && TimedOut(w.info.get(), w.execution)) {
    failed = false;
    late = true;
  } else if (ended && !failed) {
    Finish(w, "");
    return true;
  }
  // (Ended with the communicator in error: NCCL let the stream move on past a failed
  // call, e.g. a rank later than its peers, whose wait a peer's abort ended. The error may
  // be a later call's already, if the watcher polled after that one ran: both then fail.)
  if (!failed && !late) return false;
  const CallContext ctx = w.info->Context(w.rank, w.partition, w.execution);
  std::ostringstream msg;  // recorded as the host backend records errors: without ctx
  const std::vector<int> behind = w.info->LocalRanksBehind(w.execution);
  if (failed) {
    msg << "NCCL reported an error while the call ran on the device: "
        << w.comm->api().Describe(async, nullptr) << ".";
  } else if (!behind.empty() && w.info->AllLocal()) {
    // Every rank lives here: who never came is known, in the host backend's words.
    msg << NeverArrivedMessage(w.timeout, behind, w.info->group, w.info->group.size() - behind.size());
  } else {
    msg << "timed out after " << w.timeout.count() / 1000.0
        << " s (timeout_s / JAXCOMM_TIMEOUT_S) running on the device: ";
    if (!behind.empty()) {
      msg << "ranks [";
      for (size_t i = 0; i < behind.size(); ++i) msg << (i ? ", " : "") << behind[i];
      msg << "] (partitions [";
      for (size_t i = 0; i < behind.size(); ++i) msg << (i ? ", " : "") << w.info->group[behind[i]];
      msg << "]) of this process never enqueued this call; ";
    }
    msg << "the ranks of other processes that did not arrive are not known here (NCCL does not "
           "say; python -m jaxcomm.trace analyze on every process's dump names them). Ranks that "
           "skip a collective (e.g. under a lax.cond whose predicate differs by rank) or run "
           "different programs cause this.";
  }
  msg << " The NCCL communicator of group " << w.comm->key()
      << " was aborted: this call's result is undefined, and every later call on it fails.";
  if (!failed) MarkTimedOut(w.info.get(), w.execution);
  const std::string error = ctx.Describe() + ": " + msg.str();
  // A call holding the communicator right now has its own deadline: try again later.
  if (!w.comm->TryAbort(error)) return false;
  std::fprintf(stderr, "jaxcomm: %s\n", error.c_str());
  Finish(w, msg.str());
  return true;
}

void CompletionWatcher::MarkTimedOut(const GroupInfo* info, int64_t execution) {
  int64_t seen = info->deadline_aborted.load(std::memory_order_relaxed);
  while (seen < execution && !info->deadline_aborted.compare_exchange_weak(seen, execution)) {
  }
}

bool CompletionWatcher::TimedOut(const GroupInfo* info, int64_t execution) {
  return info->deadline_aborted.load() == execution;
}

void CompletionWatcher::Loop() {
  NameThisThread("jaxcomm-cuda-w");
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (watched_.empty()) {
      cv_.wait(lock, [this] { return stop_ || !watched_.empty(); });
      continue;
    }
    std::deque<Watch> batch;
    batch.swap(watched_);
    lock.unlock();
    const auto now = Clock::now();
    std::deque<Watch> keep;
    for (Watch& w : batch) {
      if (Check(w, now)) {
        Give(w.device, w.start);
        Give(w.device, w.end);
      } else {
        keep.push_back(std::move(w));
      }
    }
    lock.lock();
    // Calls that arrived meanwhile go after the ones kept (stream order).
    for (auto it = keep.rbegin(); it != keep.rend(); ++it) watched_.push_front(std::move(*it));
    if (!watched_.empty()) cv_.wait_for(lock, kPollPeriod, [this] { return stop_; });
  }
}

}  // namespace jaxcomm::cuda
