#include "core/rendezvous.h"

#include <algorithm>
#include <sstream>

#include "core/registry.h"

namespace jaxcomm {

ffi::TypeId InstructionState::id = {};

namespace {

constexpr size_t kMaxTombstones = 4096;

// Below this many bytes of traffic one thread finishes sooner than a hand-off would.
constexpr size_t kSplitBytes = 512 * 1024;

std::string RankPrefix(const Round& round, int rank) {
  CallContext ctx;
  ctx.op = round.op;
  ctx.axis = round.axis;
  ctx.call_site = round.call_site;
  ctx.group = round.group.get();
  ctx.group_index = round.group_index;
  ctx.rank = rank;
  ctx.partition = round.partitions[rank];
  ctx.execution = round.execution;
  return ctx.Describe();
}

void Complete(Round& round, const std::string& error) {
  for (size_t r = 0; r < round.promises.size(); ++r) {
    if (!round.promises[r]) continue;
    if (error.empty()) {
      round.promises[r]->SetAvailable();
    } else {
      round.promises[r]->SetError(ffi::Error::Internal(
          RankPrefix(round, static_cast<int>(r)) + ": " + error));
    }
  }
}

}  // namespace

RoundTable::RoundTable(std::vector<std::vector<int64_t>> groups, int64_t num_partitions)
    : where_(static_cast<size_t>(std::max<int64_t>(num_partitions, 0)), {-1, -1}),
      executions_(groups.size(), 0) {
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

ffi::Future RoundTable::Arrive(const CollectiveCall& call, std::shared_ptr<const WorkFn> work,
                               ffi::ThreadPool* pool) {
  const int64_t g = call.ctx.group_index;
  const int rank = call.ctx.rank;
  const int size = static_cast<int>(groups_[g]->size());
  const Key key{call.run_id, g};

  ffi::Promise promise;
  ffi::Future future(promise);
  std::shared_ptr<Round> ready;
  std::string refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.count(key)) {
      refused = "the other ranks of this call already gave up on it (timed out); this rank "
                "arrived too late";
    } else {
      std::shared_ptr<Round>& round = rounds_[key];
      if (!round) {
        round = std::make_shared<Round>(size);
        round->execution = ++executions_[g];
        round->group = groups_[g];
        round->group_index = g;
        round->op = std::string(call.ctx.op);
        round->axis = std::string(call.ctx.axis);
        round->call_site = std::string(call.ctx.call_site);
        std::weak_ptr<RoundTable> weak_table = weak_from_this();
        std::weak_ptr<Round> weak_round = round;
        auto timeout = call.timeout;
        round->watchdog_id = Registry::Get().watchdog().Schedule(
            Clock::now() + timeout, [weak_table, key, weak_round, timeout] {
              if (auto table = weak_table.lock()) table->Expire(key, weak_round, timeout);
            });
      }
      if (round->promises[rank]) {
        refused = "rank arrived twice at one call (internal error: instruction state shared "
                  "by two programs?)";
      } else {
        round->peers[rank] = call.mine;
        round->promises[rank].emplace(std::move(promise));
        round->partitions[rank] = call.ctx.partition;
        if (++round->arrived == size) {
          ready = round;
          rounds_.erase(key);
        }
      }
    }
  }
  if (!refused.empty()) {
    CallContext ctx = call.ctx;
    promise.SetError(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                ctx.Describe() + ": " + refused));
    return future;
  }
  if (ready) {
    Registry::Get().watchdog().Cancel(ready->watchdog_id);
    ExecuteRound(std::move(ready), std::move(work), call.work_bytes, pool);
  }
  return future;
}

void RoundTable::Expire(const Key& key, const std::weak_ptr<Round>& expected,
                        std::chrono::milliseconds timeout) {
  std::shared_ptr<Round> round;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rounds_.find(key);
    if (it == rounds_.end() || it->second != expected.lock()) return;  // completed meanwhile
    round = std::move(it->second);
    rounds_.erase(it);
    Tombstone(key);
  }
  const auto& group = *round->group;
  std::vector<int> missing;
  for (size_t r = 0; r < round->promises.size(); ++r) {
    if (!round->promises[r]) missing.push_back(static_cast<int>(r));
  }
  std::ostringstream msg;
  msg << "timed out after " << timeout.count() / 1000.0 << " s (JAXCOMM_TIMEOUT_S) waiting for ranks [";
  for (size_t i = 0; i < missing.size(); ++i) msg << (i ? ", " : "") << missing[i];
  msg << "] (partitions [";
  for (size_t i = 0; i < missing.size(); ++i) msg << (i ? ", " : "") << group[missing[i]];
  msg << "]), which never arrived at this call; " << round->arrived << " of " << group.size()
      << " ranks did. Ranks that skip a collective (e.g. under a lax.cond whose predicate "
         "differs by rank) or run different programs cause this.";
  const std::string error = msg.str();
  for (size_t r = 0; r < round->promises.size(); ++r) {
    if (!round->promises[r]) continue;
    round->promises[r]->SetError(ffi::Error(
        ffi::ErrorCode::kDeadlineExceeded,
        RankPrefix(*round, static_cast<int>(r)) + ": " + error));
  }
}

void ExecuteRound(std::shared_ptr<Round> round, std::shared_ptr<const WorkFn> work,
                  size_t work_bytes, ffi::ThreadPool* pool) {
  const int size = static_cast<int>(round->peers.size());
  int parts = 1;
  if (pool != nullptr && work_bytes >= kSplitBytes) {
    int64_t threads = pool->num_threads();
    parts = static_cast<int>(std::min<int64_t>(size, std::max<int64_t>(threads, 1)));
  }
  auto finish = [](Round& r, const std::string& err) { Complete(r, err); };
  if (parts <= 1) {
    std::string err = (*work)(round->peers, 0, 1);
    finish(*round, err);
    return;
  }
  round->parts_left.store(parts, std::memory_order_relaxed);
  auto run_part = [](const std::shared_ptr<Round>& r, const std::shared_ptr<const WorkFn>& w,
                     int part, int n, decltype(finish) done) {
    std::string err = (*w)(r->peers, part, n);
    if (!err.empty()) {
      std::lock_guard<std::mutex> lock(r->error_mu);
      if (r->error.empty()) r->error = err;
    }
    if (r->parts_left.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::string e;
      {
        std::lock_guard<std::mutex> lock(r->error_mu);
        e = r->error;
      }
      done(*r, e);
    }
  };
  for (int p = 1; p < parts; ++p) {
    pool->Schedule([round, work, p, parts, run_part, finish] { run_part(round, work, p, parts, finish); });
  }
  run_part(round, work, 0, parts, finish);
}

}  // namespace jaxcomm
