#include "core/rendezvous.h"

#include <sched.h>

#include <algorithm>
#include <sstream>
#include <thread>

#include "core/registry.h"

namespace jaxcomm {

ffi::TypeId InstructionState::id = {};

// One execution of one instruction by one group.
struct Round {
  enum Phase : int { kGathering = 0, kWorking = 1, kDone = 2, kFailed = 3 };

  Round(int size, Clock::time_point d) : peers(size), arrived_flag(size, 0), partitions(size, -1), deadline(d) {}

  // Written under the table's lock until the last rank arrives, read-only afterwards.
  std::vector<Peer> peers;
  std::vector<char> arrived_flag;
  std::vector<int64_t> partitions;
  int arrived = 0;
  int parts = 1;
  int64_t execution = 0;
  int64_t group_index = 0;
  std::shared_ptr<const std::vector<int64_t>> group;
  const Clock::time_point deadline;

  std::atomic<int> phase{kGathering};
  std::atomic<int> parts_left{0};
  std::mutex mu;  // guards `error` and the sleep/wake handshake
  std::condition_variable cv;
  std::string error;
};

namespace {

constexpr size_t kMaxTombstones = 4096;

// Below this many bytes of traffic one thread finishes sooner than waking the others.
constexpr size_t kSplitBytes = 512 * 1024;

void Wake(Round& round) {
  std::lock_guard<std::mutex> lock(round.mu);
  round.cv.notify_all();
}

// Waits until `done(phase)`; spins a little first (yielding, so that on an oversubscribed
// machine the ranks we wait for get the core), then sleeps. False on deadline.
template <typename Pred>
bool WaitFor(Round& round, Pred done) {
  const auto spin = Registry::Get().spin();
  if (spin.count() > 0) {
    const auto spin_until = Clock::now() + spin;
    while (!done(round.phase.load(std::memory_order_acquire))) {
      if (Clock::now() >= spin_until) break;
      sched_yield();
    }
  }
  if (done(round.phase.load(std::memory_order_acquire))) return true;
  std::unique_lock<std::mutex> lock(round.mu);
  return round.cv.wait_until(lock, round.deadline,
                             [&] { return done(round.phase.load(std::memory_order_acquire)); });
}

bool Settled(int phase) { return phase == Round::kDone || phase == Round::kFailed; }

std::string Prefix(const Round& round, const CallContext& base) {
  CallContext ctx = base;
  ctx.group = round.group.get();
  ctx.group_index = round.group_index;
  ctx.execution = round.execution;
  return ctx.Describe();
}

ffi::Error Result(const Round& round, const CallContext& ctx, ffi::ErrorCode code) {
  std::string error;
  {
    std::lock_guard<std::mutex> lock(const_cast<Round&>(round).mu);
    error = round.error;
  }
  if (error.empty()) return ffi::Error::Success();
  return ffi::Error(code, Prefix(round, ctx) + ": " + error);
}

}  // namespace

RoundTable::RoundTable(std::vector<std::vector<int64_t>> groups,
                       const std::vector<std::pair<int64_t, int64_t>>& partition_devices,
                       int64_t process_index)
    : where_(partition_devices.size(), {-1, -1}), executions_(groups.size(), 0) {
  const int64_t num_partitions = static_cast<int64_t>(partition_devices.size());
  for (int64_t p = 0; p < num_partitions; ++p) {
    auto [process, ordinal] = partition_devices[p];
    if (process != process_index || ordinal < 0) continue;
    if (ordinal >= static_cast<int64_t>(ordinal_to_partition_.size())) {
      ordinal_to_partition_.resize(ordinal + 1, -1);
    }
    ordinal_to_partition_[ordinal] = p;
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t r = 0; r < groups[g].size(); ++r) {
      int64_t p = groups[g][r];
      if (p >= 0 && p < num_partitions) where_[p] = {static_cast<int>(g), static_cast<int>(r)};
    }
    groups_.push_back(std::make_shared<const std::vector<int64_t>>(std::move(groups[g])));
  }
}

std::optional<std::pair<int, int>> RoundTable::Locate(int64_t partition) const {
  if (partition < 0 || partition >= static_cast<int64_t>(where_.size())) return std::nullopt;
  auto w = where_[partition];
  if (w.first < 0) return std::nullopt;
  return w;
}

void RoundTable::Tombstone(const Key& key) {
  if (failed_.insert(key).second) failed_order_.push_back(key);
  while (failed_order_.size() > kMaxTombstones) {
    failed_.erase(failed_order_.front());
    failed_order_.pop_front();
  }
}

void RoundTable::FailLocked(Round& round, const Key& key) {
  const auto& group = *round.group;
  std::vector<int> missing;
  for (size_t r = 0; r < round.arrived_flag.size(); ++r) {
    if (!round.arrived_flag[r]) missing.push_back(static_cast<int>(r));
  }
  std::ostringstream msg;
  msg << "timed out (JAXCOMM_TIMEOUT_S / timeout_s) waiting for ranks [";
  for (size_t i = 0; i < missing.size(); ++i) msg << (i ? ", " : "") << missing[i];
  msg << "] (partitions [";
  for (size_t i = 0; i < missing.size(); ++i) msg << (i ? ", " : "") << group[missing[i]];
  msg << "]), which never arrived at this call; " << round.arrived << " of " << group.size()
      << " ranks did. Ranks that skip a collective (e.g. under a lax.cond whose predicate "
         "differs by rank) or run different programs cause this.";
  {
    std::lock_guard<std::mutex> lock(round.mu);
    round.error = msg.str();
  }
  round.phase.store(Round::kFailed, std::memory_order_release);
  rounds_.erase(key);
  Tombstone(key);
  Registry::Get().rounds_failed.fetch_add(1, std::memory_order_relaxed);
}

ffi::Error RoundTable::Run(CollectiveCall call, const WorkFn& work) {
  const int64_t g = call.ctx.group_index;
  const int rank = call.ctx.rank;
  const int size = static_cast<int>(groups_[g]->size());
  const Key key{call.run_id, g};

  std::shared_ptr<Round> round;
  bool last = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.count(key)) {
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                        call.ctx.Describe() +
                            ": the other ranks of this call already gave up on it (timed out); "
                            "this rank arrived too late");
    }
    std::shared_ptr<Round>& slot = rounds_[key];
    if (!slot) {
      slot = std::make_shared<Round>(size, Clock::now() + call.timeout);
      slot->execution = ++executions_[g];
      slot->group = groups_[g];
      slot->group_index = g;
      slot->parts = call.work_bytes >= kSplitBytes ? size : 1;
    }
    round = slot;
    if (round->arrived_flag[rank]) {
      return ffi::Error::Internal(call.ctx.Describe() +
                                  ": rank arrived twice at one call (instruction state shared?)");
    }
    round->peers[rank] = call.mine;
    round->arrived_flag[rank] = 1;
    round->partitions[rank] = call.ctx.partition;
    if (++round->arrived == size) {
      last = true;
      rounds_.erase(key);
    }
  }

  if (last) {
    if (round->parts == 1) {
      std::string err = work(round->peers, 0, 1);
      if (!err.empty()) {
        std::lock_guard<std::mutex> lock(round->mu);
        round->error = std::move(err);
      }
      round->phase.store(Round::kDone, std::memory_order_release);
      Wake(*round);
      Registry::Get().rounds_completed.fetch_add(1, std::memory_order_relaxed);
      return Result(*round, call.ctx, ffi::ErrorCode::kInternal);
    }
    round->parts_left.store(round->parts, std::memory_order_relaxed);
    round->phase.store(Round::kWorking, std::memory_order_release);
    Wake(*round);
  } else if (!WaitFor(*round, [](int p) { return p != Round::kGathering; })) {
    std::lock_guard<std::mutex> lock(mu_);
    // Arrivals happen under this lock: if the group is still incomplete, it never will be.
    if (round->phase.load() == Round::kGathering && round->arrived < size) FailLocked(*round, key);
  }

  if (round->phase.load(std::memory_order_acquire) == Round::kWorking) {
    if (rank < round->parts) {
      std::string err = work(round->peers, rank, round->parts);
      if (!err.empty()) {
        std::lock_guard<std::mutex> lock(round->mu);
        if (round->error.empty()) round->error = std::move(err);
      }
      if (round->parts_left.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        round->phase.store(Round::kDone, std::memory_order_release);
        Wake(*round);
        Registry::Get().rounds_completed.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
  if (!WaitFor(*round, Settled)) {
    // All ranks arrived but some never finished their share: nothing can be trusted.
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                      Prefix(*round, call.ctx) + ": peers did not finish their share of the data "
                                                 "movement before the deadline");
  }
  return Result(*round, call.ctx,
                round->phase.load() == Round::kFailed ? ffi::ErrorCode::kDeadlineExceeded
                                                      : ffi::ErrorCode::kInternal);
}

}  // namespace jaxcomm
