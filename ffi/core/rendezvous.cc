#include "core/rendezvous.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>
#include <type_traits>

#include "core/cpu_affinity.h"
#include "core/cross_process.h"
#include "core/deadline_message.h"
#include "core/registry.h"
#include "core/round.h"

namespace jaxcomm {

ffi::TypeId InstructionState::id = {};

namespace {

constexpr size_t kMaxTombstones = 4096;

// Below this many bytes of traffic one thread finishes sooner than waking others.
constexpr size_t kSplitBytes = 512 * 1024;

// Large data movement is shared by at most one thread per core this process may use:
// one thread per rank (8 on 2 cores) made 16 MiB reduce_scatter 2x slower, and with several
// processes on one host each gets its share of the cores (two processes on two cores
// that each woke a second thread took a 1 MiB all_reduce from 0.2 to 1 ms).
int MaxThreads() {
  static const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, Registry::Get().host_processes()));
}

std::string Prefix(const Round& round, int rank) {
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

void Settle(ffi::Promise& promise, const std::string& prefix, const std::string& error,
            ffi::ErrorCode code) {
  if (error.empty()) {
    promise.SetAvailable();
  } else {
    promise.SetError(ffi::Error(code, prefix + ": " + error));
  }
}

}  // namespace

void CompleteAll(Round& round, int inline_rank, ffi::ErrorCode code) {
  std::string error;
  {
    std::lock_guard<std::mutex> lock(round.error_mu);
    error = round.error;
  }
  if (round.after_work) round.after_work();
  auto& registry = Registry::Get();
  registry.recorder().Finish(round.peers, error, code == ffi::ErrorCode::kDeadlineExceeded ||
                                                     code == ffi::ErrorCode::kUnavailable ||
                                                     code == ffi::ErrorCode::kAborted);
  (error.empty() ? registry.rounds_completed : registry.rounds_failed).fetch_add(1, std::memory_order_relaxed);
  std::vector<std::function<void()>> completions;
  for (size_t r = 0; r < round.promises.size(); ++r) {
    if (!round.promises[r] || static_cast<int>(r) == inline_rank) continue;
    std::string prefix = error.empty() ? std::string() : Prefix(round, static_cast<int>(r));
    completions.push_back([promise = *round.promises[r], prefix, error, code]() mutable {
      Settle(promise, prefix, error, code);
    });
  }
  registry.pool().PostAll(std::move(completions));
  if (inline_rank >= 0 && round.promises[inline_rank]) {
    Settle(*round.promises[inline_rank], error.empty() ? std::string() : Prefix(round, inline_rank),
           error, code);
  }
}

void RecordError(Round& round, std::string err) {
  if (err.empty()) return;
  std::lock_guard<std::mutex> lock(round.error_mu);
  if (round.error.empty()) round.error = std::move(err);
}

namespace {

// The smallest span that holds what each of `ranks` reads.
ElementRange ReadHull(const ReadsFn& reads, const std::vector<int>& ranks) {
  ElementRange hull{SIZE_MAX, 0};
  for (int r : ranks) {
    const ElementRange read = reads(r);
    hull = {std::min(hull.first, read.first), std::max(hull.second, read.second)};
  }
  return hull.first < hull.second ? hull : ElementRange{0, 0};
}

// Claims parts of the work until none are left; true on the thread that finished the
// last part, which then completes every rank's future. Parts are claimed, not dealt: a
// thread the scheduler delays then leaves its parts to the others instead of holding up
// the round.
bool RunParts(Round& round, const WorkFn& work) {
  for (;;) {
    const int part = round.next_part.fetch_add(1, std::memory_order_relaxed);
    if (part >= round.parts) return false;
    RecordError(round, work(round.peers, part, round.parts));
    if (round.parts_left.fetch_sub(1, std::memory_order_acq_rel) == 1) return true;
  }
}

}  // namespace

void ExchangeThen(CrossProcess& world, ExchangeSpec spec, std::shared_ptr<Round> round, int me,
                  std::function<void(const std::vector<const char*>& blobs, int me)> next) {
  const auto caller = std::this_thread::get_id();
  world.Exchange(std::move(spec), [round = std::move(round), me, caller, next = std::move(next)](
                                      const std::string& error, bool timed_out,
                                      const std::vector<const char*>& blobs) {
    const bool here = std::this_thread::get_id() == caller;
    if (!error.empty()) {
      RecordError(*round, error);
      // Never continue a rank's program on the transport's progress thread.
      CompleteAll(*round, here ? me : -1,
                  timed_out ? ffi::ErrorCode::kDeadlineExceeded : ffi::ErrorCode::kUnavailable);
      return;
    }
    if (here) {
      next(blobs, me);
    } else {
      Registry::Get().pool().Post([next, blobs, me] { next(blobs, me); });
    }
  });
}

void AppendOperands(const Peer& p, ElementRange span, std::vector<std::pair<const void*, size_t>>& out) {
  const size_t item = p.item_bytes();
  out.emplace_back(static_cast<const char*>(p.in) + span.first * item, (span.second - span.first) * item);
  for (int k = 0; k < 4; ++k) {
    if (p.aux_bytes[k] > 0) out.emplace_back(p.aux[k], p.aux_bytes[k]);
  }
}

void PlaceRemoteOperands(std::vector<Peer>& peers, const std::vector<std::vector<int>>& remote, const Peer& shape,
                         const std::vector<const char*>& blobs, const std::vector<ElementRange>* spans) {
  const size_t item = shape.item_bytes();
  for (size_t i = 0; i < remote.size(); ++i) {
    const char* at = blobs[i];
    const auto [first, last] = spans ? (*spans)[i] : ElementRange{0, static_cast<size_t>(shape.elements)};
    for (int r : remote[i]) {
      Peer& p = peers[r];
      p = Peer{};
      if (at == nullptr) continue;  // left out of a fault-tolerant call
      // Only elements [first, last) arrived: `in` is where element 0 would be, so the
      // work, which reads only those, finds them at their usual offsets. (Address
      // arithmetic in integers: the pointer may lie before the blob.)
      p.in = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(at) - first * item);
      p.in_bytes = shape.in_bytes;
      at += (last - first) * item;
      for (int k = 0; k < 4; ++k) {
        p.aux[k] = shape.aux_bytes[k] ? at : nullptr;
        p.aux_bytes[k] = shape.aux_bytes[k];
        at += shape.aux_bytes[k];
      }
    }
  }
}

void Execute(const std::shared_ptr<Round>& round, const std::shared_ptr<const WorkFn>& work, int me) {
  Registry::Get().recorder().Start(round->peers);
  if (round->threads == 1) {
    RecordError(*round, (*work)(round->peers, 0, 1));
    CompleteAll(*round, me, ffi::ErrorCode::kInternal);
    return;
  }
  round->parts_left.store(round->parts, std::memory_order_relaxed);
  round->next_part.store(0, std::memory_order_relaxed);
  const int mine = me % round->threads;
  const int my_cpu = CurrentCore();
  for (int t = 0; t < round->threads; ++t) {
    if (t == mine) continue;
    Registry::Get().pool().Post([round, work, t, my_cpu] {
      if (CurrentCore() == my_cpu) LeaveCore(my_cpu);  // see core/cpu_affinity.h
      // A pool thread that finishes last may as well continue some rank: rank t's.
      if (RunParts(*round, *work)) CompleteAll(*round, t, ffi::ErrorCode::kInternal);
    });
  }
  if (RunParts(*round, *work)) CompleteAll(*round, me, ffi::ErrorCode::kInternal);
}

RoundTable::RoundTable(std::vector<std::vector<int64_t>> groups,
                       const std::vector<std::pair<int64_t, int64_t>>& partition_devices,
                       int64_t process_index, uint64_t instruction_key)
    : instruction_key_(instruction_key), where_(partition_devices.size(), {-1, -1}),
      executions_(groups.size()), inline_(groups.size()) {
  const int64_t num_partitions = static_cast<int64_t>(partition_devices.size());
  for (int64_t p = 0; p < num_partitions; ++p) {
    auto [process, ordinal] = partition_devices[p];
    if (process != process_index || ordinal < 0) continue;
    ordinal_to_partition_.emplace_back(ordinal, p);
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t r = 0; r < groups[g].size(); ++r) {
      int64_t p = groups[g][r];
      if (p >= 0 && p < num_partitions) where_[p] = {static_cast<int>(g), static_cast<int>(r)};
    }
    Layout layout;
    std::map<int64_t, std::vector<int>> by_process;
    for (size_t r = 0; r < groups[g].size(); ++r) {
      const int64_t p = groups[g][r];
      const int64_t process = p >= 0 && p < num_partitions ? partition_devices[p].first : process_index;
      if (process == process_index) {
        layout.local.push_back(static_cast<int>(r));
      } else {
        by_process[process].push_back(static_cast<int>(r));
      }
    }
    for (auto& [process, ranks] : by_process) {
      layout.processes.push_back(process);
      layout.remote.push_back(std::move(ranks));
    }
    layouts_.push_back(std::move(layout));
    groups_.push_back(std::make_shared<const std::vector<int64_t>>(std::move(groups[g])));
  }
}

std::optional<std::pair<int, int>> RoundTable::Locate(int64_t partition) const {
  if (partition < 0 || partition >= static_cast<int64_t>(where_.size())) return std::nullopt;
  auto w = where_[partition];
  if (w.first < 0) return std::nullopt;
  return w;
}

void RoundTable::Tombstone(const Key& key, int64_t execution, bool mismatch) {
  if (failed_.emplace(key, Failed{execution, mismatch}).second) failed_order_.push_back(key);
  while (failed_order_.size() > kMaxTombstones) {
    failed_.erase(failed_order_.front());
    failed_order_.pop_front();
  }
}

CallResult RoundTable::Arrive(const CollectiveCall& call, WorkFn work_fn) {
  const int64_t g = call.ctx.group_index;
  if (InlineExchange* exchange = inline_[g].load(std::memory_order_acquire)) {
    return ArriveInline(*exchange, call, work_fn);
  }
  auto work = std::make_shared<const WorkFn>(std::move(work_fn));
  const int rank = call.ctx.rank;
  // Ranks of other processes never arrive here; they meet this process in the exchange.
  const int local = static_cast<int>(layouts_[g].local.size());
  const Key key{call.run_id, g};

  ffi::Promise promise;
  ffi::Future future(promise);
  std::shared_ptr<Round> ready;
  uint64_t watchdog_id = 0;
  std::string refused;
  CallContext ctx = call.ctx;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto failed = failed_.find(key); failed != failed_.end()) {
      ctx.execution = failed->second.execution;
      refused = failed->second.mismatch
                    ? "the other ranks of this call already failed it: they waited in it while "
                      "other ranks waited in another collective (MISMATCH); this rank arrived too late"
                    : std::string(kArrivedTooLate);
    } else {
      std::shared_ptr<Round>& round = rounds_[key];
      if (!round) {
        round = NewRound(call, g, executions_[g].fetch_add(1, std::memory_order_relaxed) + 1);
        // Only a round that waits for other local ranks needs the watchdog (a lone local
        // rank is ready at once; the exchange with other processes has its own deadline).
        // One entry, at the grace period if any (then rescheduled for the deadline), so
        // that the check for a mismatch costs a completing round nothing.
        if (local > 1) {
          round->since = Clock::now();
          round->grace = MismatchGrace(call.timeout);
          Watch(key, round, round->since + (round->grace.count() > 0 ? round->grace : round->timeout));
        }
      }
      if (round->promises[rank]) {
        refused = "rank arrived twice at one call (instruction state shared by two programs?)";
      } else {
        round->peers[rank] = call.mine;
        round->promises[rank].emplace(promise);
        round->partitions[rank] = call.ctx.partition;
        Registry::Get().recorder().Arrived(call.mine.trace, round->execution);
        if (++round->arrived == local) {
          ready = round;
          watchdog_id = round->watchdog_id;
          rounds_.erase(key);
        }
      }
    }
  }
  if (!refused.empty()) {
    Registry::Get().recorder().Fail(call.mine.trace, ctx.execution, refused);
    promise.SetError(ffi::Error(ffi::ErrorCode::kFailedPrecondition, ctx.Describe() + ": " + refused));
    return future;
  }
  if (ready) {
    // A false return means the watchdog is firing right now; Overdue then finds the round
    // gone from the table and does nothing.
    if (watchdog_id != 0) Registry::Get().watchdog().Cancel(watchdog_id);
    if (layouts_[g].cross_process()) {
      StartCrossProcess(ready, std::move(work), rank);
    } else {
      Execute(ready, work, rank);
    }
  }
  return future;
}

std::shared_ptr<Round> RoundTable::NewRound(const CollectiveCall& call, int64_t g, int64_t execution) {
  const int size = static_cast<int>(groups_[g]->size());
  const int local = static_cast<int>(layouts_[g].local.size());
  auto round = std::make_shared<Round>(size);
  round->execution = execution;
  round->group = groups_[g];
  round->group_index = g;
  // This process does its own ranks' share of the work.
  const size_t my_bytes = call.work_bytes / size * local;
  round->threads = my_bytes < kSplitBytes ? 1 : std::min(call.split_by_rank ? local : size, MaxThreads());
  // Split by rank, one part per local rank, so that the threads even out uneven ranks.
  round->parts = round->threads > 1 && call.split_by_rank ? local : round->threads;
  round->timeout = call.timeout;
  round->tolerant = call.tolerant;
  const auto share = [](const auto& fn) {
    using Fn = std::decay_t<decltype(fn)>;
    return fn ? std::make_shared<const Fn>(fn) : nullptr;
  };
  round->range = share(call.range);
  round->combine = share(call.combine);
  round->combine_partials = call.combine_partials;
  round->needs = share(call.needs);
  round->reads = share(call.reads);
  round->direct = call.direct();
  round->op = std::string(call.ctx.op);
  round->axis = std::string(call.ctx.axis);
  round->call_site = std::string(call.ctx.call_site);
  return round;
}

namespace {

// Whether the inline path is on (JAXCOMM_INLINE, default 1; 0 turns it off, e.g. to
// measure what it saves). Read once, at start.
bool InlineEnabled() { return Registry::Get().settings().inline_rounds; }

// Whether the rounds of a group may run inline (RoundTable::ArriveInline): one rank in
// this process, operands small enough that the work is never split, and a plain
// exchange (not fault tolerant, not streamed, not in phases, no partial operands).
bool InlineCandidate(const Round& round, size_t local, const Peer& shape, bool subsets) {
  if (!InlineEnabled() || local != 1 || round.tolerant || round.threads != 1 || subsets) return false;
  size_t bytes = shape.in_bytes;
  for (size_t b : shape.aux_bytes) bytes += b;
  return bytes <= kInlineBytes;
}

}  // namespace

CallResult RoundTable::ArriveInline(InlineExchange& exchange, const CollectiveCall& call, WorkFn& work) {
  const int64_t g = call.ctx.group_index;
  const int rank = call.ctx.rank;
  const int64_t execution = executions_[g].fetch_add(1, std::memory_order_relaxed) + 1;
  Registry& registry = Registry::Get();
  registry.recorder().Arrived(call.mine.trace, execution);
  // Set before inline_ was published, read-only since.
  const Layout& layout = layouts_[g];
  // Per thread, reused: a call allocates nothing here.
  struct Scratch {
    std::vector<std::pair<const void*, size_t>> mine;
    std::vector<const char*> theirs;
    std::vector<Peer> peers;
  };
  thread_local Scratch scratch;
  auto& [mine, theirs, peers] = scratch;
  mine.clear();
  AppendOperands(call.mine, {0, static_cast<size_t>(layout.shape.elements)}, mine);
  const auto now = Clock::now();
  const auto until = std::min(now + call.timeout, now + registry.spin());
  const InlineExchange::Status status = exchange.Run(execution, mine, until, theirs);
  if (status != InlineExchange::Status::kDone) {
    // The peers are late: this rank's call continues as any other round, from where the
    // inline exchange left it, and the device thread returns.
    std::shared_ptr<Round> round = NewRound(call, g, execution);
    ffi::Promise promise;
    ffi::Future future(promise);
    round->peers[rank] = call.mine;
    round->promises[rank].emplace(promise);
    round->partitions[rank] = call.ctx.partition;
    round->arrived = 1;
    StartFlat(round, std::make_shared<const WorkFn>(std::move(work)), rank, layout.plan, layout.shape,
              status == InlineExchange::Status::kPublished);
    return future;
  }
  peers.assign(groups_[g]->size(), Peer{});
  peers[rank] = call.mine;
  PlaceRemoteOperands(peers, layout.received, layout.shape, theirs, &layout.received_span);
  registry.recorder().Start(peers);
  const std::string error = work(peers, 0, 1);
  exchange.Release(execution);
  registry.recorder().Finish(peers, error, false);
  (error.empty() ? registry.rounds_completed : registry.rounds_failed).fetch_add(1, std::memory_order_relaxed);
  registry.inline_rounds.fetch_add(1, std::memory_order_relaxed);
  if (error.empty()) return CallResult::Done();
  CallContext ctx = call.ctx;
  ctx.execution = execution;
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(ffi::Error(ffi::ErrorCode::kInternal, ctx.Describe() + ": " + error));
  return future;
}

uint64_t Mix(uint64_t h, uint64_t v) {
  uint64_t z = h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::string RankList(const std::vector<int>& ranks, const std::vector<int64_t>& group) {
  std::ostringstream s;
  s << "ranks [";
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? " " : "") << ranks[i];
  s << "] (partitions [";
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? " " : "") << group[ranks[i]];
  s << "])";
  return s.str();
}

void RoundTable::StartCrossProcess(const std::shared_ptr<Round>& round, std::shared_ptr<const WorkFn> work,
                                   int me) {
  CrossProcess* world = Registry::Get().cross_process();
  if (world == nullptr) {
    RecordError(*round, "this group spans processes, and jaxcomm's cross-process transport is not "
                        "available in this build");
    CompleteAll(*round, me, ffi::ErrorCode::kUnimplemented);
    return;
  }
  std::shared_ptr<const ExchangePlan> plan;
  std::shared_ptr<const Hierarchy> hierarchy;
  std::shared_ptr<const ScatterGather> scatter_gather;
  Peer shape;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Layout& l = layouts_[round->group_index];
    if (!l.plan) {
      // Every rank's operands have one layout (SPMD); this process's first rank shows it.
      l.shape = round->peers[l.local.front()];
      size_t per_rank = l.shape.in_bytes;
      uint64_t fingerprint = Mix(std::hash<std::string>()(round->op), l.shape.in_bytes);
      for (size_t b : l.shape.aux_bytes) {
        per_rank += b;
        fingerprint = Mix(fingerprint, b);
      }
      auto p = std::make_shared<ExchangePlan>();
      p->key = Mix(instruction_key_, static_cast<uint64_t>(round->group_index));
      if (p->key == 0) p->key = 1;  // 0 marks a free shared slot
      p->fingerprint = fingerprint;
      p->peers = l.processes;
      p->op = round->op;
      p->call_site = round->call_site;
      p->ranks = RankList(l.local, *round->group);
      for (const auto& ranks : l.remote) {
        p->peer_bytes.push_back(per_rank * ranks.size());
        p->peer_desc.push_back(RankList(ranks, *round->group));
      }
      if (round->tolerant) {
        auto agreement = std::make_shared<ExchangePlan>(*p);
        agreement->key = Mix(p->key, 0x61677265656d656eull);  // "agreemen"
        agreement->fingerprint = Mix(p->fingerprint, 1);
        // Per process of the group: heard-from byte + rejoin generation seen (World::Agree).
        agreement->peer_bytes.assign(l.processes.size(), (l.processes.size() + 1) * (1 + sizeof(uint64_t)));
        p->agreement = std::move(agreement);
      }
      const bool no_aux = std::all_of(l.shape.aux_bytes.begin(), l.shape.aux_bytes.end(),
                                      [](size_t b) { return b == 0; });
      if (MayRunInPhases(round->tolerant, round->direct, l.shape.in_bytes)) {
        l.hierarchy = PlanHierarchy(*world, *p, Registry::Get().process_index(), per_rank, l.local.size(), l.remote,
                                    /*relay=*/!(round->combine && round->combine_partials && no_aux));
      }
      if (!l.hierarchy && MayScatterGather(round->tolerant, round->combine != nullptr, l.shape) &&
          ScattersAndGathers(*world, l.processes)) {
        l.scatter_gather = PlanScatterGather(*p, Registry::Get().process_index(), l.shape, l.remote);
      }
      l.received = l.remote;
      const ElementRange whole{0, static_cast<size_t>(l.shape.elements)};
      l.sent_span.assign(l.remote.size(), whole);
      l.received_span.assign(l.remote.size(), whole);
      for (size_t i = 0; i < l.remote.size(); ++i) {
        std::vector<size_t> all(l.local.size());
        for (size_t k = 0; k < all.size(); ++k) all[k] = k;
        l.sent.push_back(std::move(all));
        const LinkCapabilities* link = world->LinkOf(l.processes[i]);
        const bool own_copy = !round->tolerant && !l.hierarchy && link != nullptr && link->per_peer_sends;
        if (own_copy && round->reads && no_aux && whole.second > 0) {
          // The same rule in both processes: each sends the span the other's ranks read.
          l.sent_span[i] = ReadHull(*round->reads, l.remote[i]);
          l.received_span[i] = ReadHull(*round->reads, l.local);
          l.subsets |= l.sent_span[i] != whole;
          p->peer_bytes[i] = l.remote[i].size() * (l.received_span[i].second - l.received_span[i].first) *
                             l.shape.item_bytes();
        }
        if (!round->needs || !own_copy) continue;
        // The same rule in both processes: each sends what the other's ranks read.
        const NeedsFn& needs = *round->needs;
        std::vector<int> received;
        for (int s : l.remote[i]) {
          if (std::any_of(l.local.begin(), l.local.end(), [&](int d) { return needs(s, d); })) received.push_back(s);
        }
        std::vector<size_t> sent;
        for (size_t k = 0; k < l.local.size(); ++k) {
          if (std::any_of(l.remote[i].begin(), l.remote[i].end(), [&](int d) { return needs(l.local[k], d); })) {
            sent.push_back(k);
          }
        }
        l.subsets |= sent.size() != l.local.size();
        p->peer_bytes[i] = p->peer_bytes[i] / l.remote[i].size() * received.size();
        l.received[i] = std::move(received);
        l.sent[i] = std::move(sent);
      }
      // Links do not change kind, so whether the rounds stream is decided once.
      if (Streamable(l.shape, round->range != nullptr, round->tolerant) && world->CanStream(l.processes)) {
        auto arrival = std::make_shared<ExchangePlan>(*p);
        arrival->key = Mix(p->key, 0x6172726976616c00ull);  // "arrival"
        arrival->fingerprint = Mix(p->fingerprint, 2);
        // Each process's offer (StartStream): whether it reads single-copy, then where
        // its ranks' inputs are.
        for (size_t i = 0; i < l.processes.size(); ++i) {
          arrival->peer_bytes[i] = sizeof(uint64_t) * (1 + l.remote[i].size());
        }
        p->arrival = std::move(arrival);
      }
      l.plan = std::move(p);
      if (!l.hierarchy && !l.scatter_gather && !l.plan->arrival &&
          InlineCandidate(*round, l.local.size(), l.shape, l.subsets)) {
        l.inline_exchange = world->OpenInline(l.plan, per_rank);
        inline_[round->group_index].store(l.inline_exchange.get(), std::memory_order_release);
      }
    }
    plan = l.plan;
    hierarchy = l.hierarchy;
    scatter_gather = l.scatter_gather;
    shape = l.shape;
  }
  if (hierarchy) {
    StartHierarchical(round, std::move(work), me, std::move(hierarchy), shape);
    return;
  }
  if (scatter_gather) {
    StartScatterGather(round, me, std::move(scatter_gather), shape);
    return;
  }
  if (plan->arrival) {
    StartStream(round, me, plan, shape);
    return;
  }
  StartFlat(round, std::move(work), me, std::move(plan), shape, /*published=*/false);
}

void RoundTable::StartFlat(const std::shared_ptr<Round>& round, std::shared_ptr<const WorkFn> work, int me,
                           std::shared_ptr<const ExchangePlan> plan, const Peer& shape, bool published) {
  CrossProcess* world = Registry::Get().cross_process();
  const Layout& layout = layouts_[round->group_index];
  ExchangeSpec spec;
  spec.plan = plan;
  spec.seq = round->execution;
  spec.tolerant = round->tolerant;
  spec.published = published;
  const ElementRange whole{0, static_cast<size_t>(shape.elements)};
  for (int r : layout.local) AppendOperands(round->peers[r], whole, spec.mine);
  if (layout.subsets) {
    spec.per_peer.resize(layout.sent.size());
    for (size_t i = 0; i < layout.sent.size(); ++i) {
      for (size_t k : layout.sent[i]) AppendOperands(round->peers[layout.local[k]], layout.sent_span[i], spec.per_peer[i]);
    }
  }
  spec.deadline = Clock::now() + round->timeout;  // the local ranks' wait is already over
  const int64_t seq = spec.seq;
  // `layout` lives as long as the table, which the round's instruction state keeps alive.
  ExchangeThen(*world, std::move(spec), round, me,
               [round, work, seq, world, plan, shape, &layout](const std::vector<const char*>& blobs, int me) {
                 PlaceRemoteOperands(*round, layout.received, shape, blobs, &layout.received_span);
                 round->after_work = [world, plan, seq] { world->Release(*plan, seq); };
                 Execute(round, work, me);
               });
}

void RoundTable::StartStream(const std::shared_ptr<Round>& round, int me, std::shared_ptr<const ExchangePlan> plan,
                             const Peer& shape) {
  CrossProcess* world = Registry::Get().cross_process();
  const Layout& layout = layouts_[round->group_index];
  const int64_t seq = round->execution;
  const auto deadline = Clock::now() + round->timeout;
  // The whole round is one stream on one thread (its chunks are consumed in order),
  // which then completes the round; `inline_rank` continues on it.
  auto stream = [world, plan, seq, shape, deadline, &layout](const std::shared_ptr<Round>& round, int inline_rank,
                                                             std::vector<uint64_t> remote_inputs) {
    Registry::Get().recorder().Start(round->peers);
    StreamSpec spec;
    spec.plan = plan;
    spec.seq = seq;
    spec.pull = !remote_inputs.empty();
    spec.remote_inputs = std::move(remote_inputs);
    if (spec.pull && round->needs) {
      for (const auto& ranks : layout.remote) {
        for (int r : ranks) {
          spec.remote_read.push_back(
              std::any_of(layout.local.begin(), layout.local.end(), [&](int d) { return (*round->needs)(r, d); }));
        }
      }
    }
    if (spec.pull && round->reads) {
      spec.read_here = [&layout, &reads = *round->reads](size_t lo, size_t hi) {
        return std::any_of(layout.local.begin(), layout.local.end(), [&](int d) {
          const ElementRange read = reads(d);
          return lo < read.second && hi > read.first;
        });
      };
    }
    for (int r : layout.local) spec.mine.push_back(static_cast<const char*>(round->peers[r].in));
    for (const auto& ranks : layout.remote) spec.peer_ranks.push_back(ranks.size());
    spec.elements = static_cast<size_t>(shape.elements);
    spec.item_bytes = shape.item_bytes();
    spec.deadline = deadline;
    if (round->reads) {
      spec.published = [&layout, &reads = *round->reads](size_t lo, size_t hi) {
        for (const auto& ranks : layout.remote) {
          for (int r : ranks) {
            const ElementRange read = reads(r);
            if (lo < read.second && hi > read.first) return true;
          }
        }
        return false;
      };
    }
    std::vector<Peer> view = round->peers;
    bool timed_out = false;
    const std::string error = world->Stream(
        spec,
        [&](const std::vector<const char*>& local, const std::vector<const char*>& remote, size_t lo, size_t hi) {
          for (size_t i = 0; i < layout.local.size(); ++i) view[layout.local[i]].in = local[i];
          size_t k = 0;
          for (const auto& ranks : layout.remote) {
            for (int r : ranks) view[r].in = remote[k++];
          }
          return (*round->range)(view, lo, hi);
        },
        &timed_out);
    RecordError(*round, error);
    CompleteAll(*round, inline_rank, timed_out ? ffi::ErrorCode::kDeadlineExceeded : ffi::ErrorCode::kUnavailable);
  };
  // First every process learns that all the others are in this round; from then on each
  // one streams, and no wait in the stream can be on a process that is still busy
  // elsewhere. Each one offers to read single-copy (it may read every peer's memory, and
  // no result of its overwrites an input the peers would read) and says where its inputs
  // are: the round is single-copy if every process offered.
  auto offer = std::make_shared<std::vector<uint64_t>>();
  bool aliased = false;
  for (int r : layout.local) {
    const Peer& p = round->peers[r];
    const auto* in = static_cast<const char*>(p.in);
    const auto* out = static_cast<const char*>(p.out);
    aliased |= in < out + p.in_bytes && out < in + p.in_bytes;
  }
  offer->push_back(!aliased && world->CanReadDirectly(layout.processes) ? 1 : 0);
  for (int r : layout.local) offer->push_back(reinterpret_cast<uint64_t>(round->peers[r].in));
  ExchangeSpec arrival;
  arrival.plan = plan->arrival;
  arrival.seq = seq;
  arrival.deadline = deadline;
  arrival.mine = {{offer->data(), offer->size() * sizeof(uint64_t)}};
  ExchangeThen(*world, std::move(arrival), round, me,
               [round, stream, seq, world, plan, offer, &layout](const std::vector<const char*>& blobs, int me) {
                 bool pull = (*offer)[0] == 1;
                 std::vector<uint64_t> remote_inputs;
                 for (size_t i = 0; i < blobs.size(); ++i) {
                   std::vector<uint64_t> theirs(1 + layout.remote[i].size());
                   std::memcpy(theirs.data(), blobs[i], theirs.size() * sizeof(uint64_t));
                   pull &= theirs[0] == 1;
                   remote_inputs.insert(remote_inputs.end(), theirs.begin() + 1, theirs.end());
                 }
                 round->after_work = [world, plan, seq] { world->Release(*plan->arrival, seq); };
                 stream(round, me, pull ? std::move(remote_inputs) : std::vector<uint64_t>{});
               });
}

void RoundTable::Watch(const Key& key, const std::shared_ptr<Round>& round, Clock::time_point when) {
  std::weak_ptr<RoundTable> weak_table = weak_from_this();
  std::weak_ptr<Round> weak_round = round;
  round->watchdog_id = Registry::Get().watchdog().Schedule(when, [weak_table, key, weak_round] {
    if (auto table = weak_table.lock()) table->Overdue(key, weak_round);
  });
}

void RoundTable::Overdue(const Key& key, const std::weak_ptr<Round>& expected) {
  std::shared_ptr<Round> round = expected.lock();
  if (!round) return;
  const auto deadline = round->since + round->timeout;
  if (Clock::now() >= deadline) {
    Expire(key, expected);
    return;
  }
  if (FailMismatched(round)) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = rounds_.find(key);
  if (it == rounds_.end() || it->second != round) return;  // completed meanwhile
  Watch(key, round, deadline);
}

void RoundTable::Waiting(std::vector<LocalWait>& out) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [key, round] : rounds_) {
    if (round->arrived == 0 || round->grace.count() == 0) continue;
    LocalWait w;
    w.table = this;
    w.round = round.get();
    w.key = key;
    w.op = round->op;
    w.call_site = round->call_site;
    w.execution = round->execution;
    w.since = round->since;
    w.grace = round->grace;
    std::vector<int> arrived;
    for (int r : layouts_[key.second].local) {
      if (round->promises[r]) {
        arrived.push_back(r);
        w.arrived.push_back((*round->group)[r]);
      } else {
        w.missing.push_back((*round->group)[r]);
      }
    }
    w.who = RankList(arrived, *round->group);
    out.push_back(std::move(w));
  }
}

void RoundTable::FailWaiting(const LocalWait& wait, const std::string& error) {
  std::shared_ptr<Round> round;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rounds_.find(wait.key);
    if (it == rounds_.end() || it->second.get() != wait.round) return;  // completed meanwhile
    round = std::move(it->second);
    rounds_.erase(it);
    Tombstone(wait.key, round->execution, /*mismatch=*/true);
  }
  // False for the entry that is firing now (the round that found the mismatch).
  Registry::Get().watchdog().Cancel(round->watchdog_id);
  RecordError(*round, error);
  CompleteAll(*round, -1, ffi::ErrorCode::kAborted);
}

bool RoundTable::FailMismatched(const std::shared_ptr<Round>& round) {
  const auto now = Clock::now();
  // Each table's lock in turn, never two at once.
  const std::vector<std::shared_ptr<RoundTable>> tables = Registry::Get().Tables();
  std::vector<LocalWait> waits;
  std::vector<RoundTable*> owners;
  for (const auto& table : tables) {
    table->Waiting(waits);
    owners.resize(waits.size(), table.get());
  }
  const auto self = std::find_if(waits.begin(), waits.end(), [&](const LocalWait& w) { return w.round == round.get(); });
  if (self == waits.end()) return false;
  const std::vector<size_t> cycle = FindCycle(waits, static_cast<size_t>(self - waits.begin()), now);
  if (cycle.empty()) return false;
  for (size_t m : cycle) {
    std::vector<MismatchSide> sides;
    for (size_t k : cycle) {
      sides.push_back({waits[k].who, waits[k].op, waits[k].call_site, waits[k].execution, k == m});
    }
    owners[m]->FailWaiting(waits[m], MismatchMessage(sides, waits[m].grace, /*processes=*/false));
  }
  return true;
}

void RoundTable::Expire(const Key& key, const std::weak_ptr<Round>& expected) {
  std::shared_ptr<Round> round;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rounds_.find(key);
    if (it == rounds_.end() || it->second != expected.lock()) return;  // completed meanwhile
    round = std::move(it->second);
    rounds_.erase(it);
    Tombstone(key, round->execution);
  }
  const auto& group = *round->group;
  std::vector<int> missing;
  for (size_t r = 0; r < round->promises.size(); ++r) {
    if (!round->promises[r]) missing.push_back(static_cast<int>(r));
  }
  const std::string msg = NeverArrivedMessage(round->timeout, missing, group, static_cast<size_t>(round->arrived));
  RecordError(*round, msg);
  // No rank's continuation belongs on the watchdog thread.
  CompleteAll(*round, -1, ffi::ErrorCode::kDeadlineExceeded);
}

}  // namespace jaxcomm
