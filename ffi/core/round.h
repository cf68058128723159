// A round (one execution of one instruction by one group) and what the rendezvous's
// source files share to complete it: rendezvous.cc matches calls and runs their work,
// hierarchical.cc runs a cross-host round in phases, scatter_gather.cc a reduction over
// processes linked by TCP as a reduce-scatter then an all-gather.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/rendezvous.h"

namespace jaxcomm {

// One execution of one instruction by one group.
struct Round {
  explicit Round(int size) : peers(size), promises(size), partitions(size, -1) {}

  // Written under the table's lock until the last rank arrives, read-only afterwards.
  std::vector<Peer> peers;
  std::vector<std::optional<ffi::Promise>> promises;  // engaged once that rank arrived
  std::vector<int64_t> partitions;
  int arrived = 0;
  // The work's parts (WorkFn) and the threads that claim them in turn (Execute).
  int parts = 1;
  int threads = 1;
  bool tolerant = false;
  std::shared_ptr<const RangeFn> range;
  std::shared_ptr<const CombineFn> combine;
  bool combine_partials = true;
  std::shared_ptr<const NeedsFn> needs;
  std::shared_ptr<const ReadsFn> reads;
  bool direct = false;  // CollectiveCall::direct()
  int64_t execution = 0;
  int64_t group_index = 0;
  std::shared_ptr<const std::vector<int64_t>> group;
  uint64_t watchdog_id = 0;  // under the table's lock
  std::chrono::milliseconds timeout{0};
  // Rounds waiting for local ranks: when the first arrived, and after how long the
  // watchdog looks for a mismatch (core/mismatch.h; 0: never).
  Clock::time_point since;
  std::chrono::milliseconds grace{0};
  // Copied from the first arrival: attribute storage is not ours to keep.
  std::string op, axis, call_site;

  // Runs once the work is done, before the futures complete (cross-process rounds:
  // tells the peers their inputs were read).
  std::function<void()> after_work;

  std::atomic<int> next_part{0};
  std::atomic<int> parts_left{0};
  std::mutex error_mu;
  std::string error;
};

// How one process takes part in a round across hosts: the phases' exchanges (plans
// whose keys derive from the flat plan's, so they never mix with other calls).
// Reductions send results between hosts; a relay (every other op) sends operands: each
// host's bundle (its processes ascending, their ranks' operands) crosses once per other
// host, and the leader hands the other hosts' bundles to its host.
struct Hierarchy {
  bool relay = false;
  std::shared_ptr<const ExchangePlan> local;   // operands, with this host's other processes
  std::shared_ptr<const ExchangePlan> across;  // leaders: results (bundles), with the other leaders
  std::shared_ptr<const ExchangePlan> spread;  // from the leader to its host
  bool leader = false;        // the lowest process index of its host
  size_t host_index = 0;      // this host's place among the hosts (ordered by leader)
  size_t leader_index = 0;    // non-leaders: the leader's place in spread->peers
  std::vector<size_t> local_ranks;  // per peer of `local`: how many ranks it has
  // Relay: where each of the group's other processes' operands arrive (aligned with the
  // flat plan's peers): in which phase's contributions, whose, at which offset.
  struct Source {
    int phase = 0;  // 0 local, 1 across, 2 spread
    size_t index = 0;
    size_t offset = 0;
  };
  std::vector<Source> sources;
  // Relay, leaders: their host's bundle, by process: -1 for this one, else the index of
  // its contribution to `local`.
  std::vector<int> bundle;

  // The leader's buffer for its host's result, kept from one round to the next: a fresh
  // one costs a page fault per 4 KiB.
  std::vector<char> TakeBuffer(size_t bytes) const;
  void GiveBuffer(std::vector<char> buffer) const;

 private:
  mutable std::mutex mu_;
  mutable std::vector<char> spare_;
};

// The hierarchy of a round of the flat plan's peers (the group's other processes, with
// `remote_ranks` each), or nullptr when the flat exchange is as good (one host, or one
// process per host) or a host is unknown. The same answer in every process.
// `rank_bytes`: what one rank contributes (its operand and aux operands); `my_ranks`: how
// many ranks this process has; `relay`: the op has no CombineFn.
std::shared_ptr<const Hierarchy> PlanHierarchy(const CrossProcess& world, const ExchangePlan& flat,
                                               int64_t self, size_t rank_bytes, size_t my_ranks,
                                               const std::vector<std::vector<int>>& remote_ranks, bool relay);

// How one process takes part in a reduction run as a reduce-scatter then an all-gather
// (core/scatter_gather.cc): each process of the group owns one slice of the elements.
struct ScatterGather {
  std::shared_ptr<const ExchangePlan> scatter;  // the peers' ranks' operands, this process's slice
  std::shared_ptr<const ExchangePlan> gather;   // the peers' reduced slices
  ElementRange slice;                           // this process's
  std::vector<ElementRange> peer_slices;        // per peer of the flat plan
};

// The slices and phases of such a round over the flat plan's peers (the group's other
// processes, with `remote_ranks` each); `shape`: every rank's operand sizes.
std::shared_ptr<const ScatterGather> PlanScatterGather(const ExchangePlan& flat, int64_t self, const Peer& shape,
                                                       const std::vector<std::vector<int>>& remote_ranks);

// Runs exchange `spec` for `round`, then `next` with the peers' contributions, continuing
// rank `me`: on this thread if the peers were already there, else on a pool thread,
// never on the transport's progress thread. A failed exchange fails the round instead.
void ExchangeThen(CrossProcess& world, ExchangeSpec spec, std::shared_ptr<Round> round, int me,
                  std::function<void(const std::vector<const char*>& blobs, int me)> next);
// Appends what rank `p` contributes to an exchange: elements `span` of its operand, then
// its aux operands (ops that send partial spans have none).
void AppendOperands(const Peer& p, ElementRange span, std::vector<std::pair<const void*, size_t>>& out);
// Points the Peers of the ranks of other processes at their operands: blobs[i] holds
// those of remote[i]'s ranks, in rank order, each rank's `in` then its aux operands.
// `spans`: per process, the elements of each operand that arrived (default: all).
void PlaceRemoteOperands(std::vector<Peer>& peers, const std::vector<std::vector<int>>& remote, const Peer& shape,
                         const std::vector<const char*>& blobs, const std::vector<ElementRange>* spans = nullptr);
inline void PlaceRemoteOperands(Round& round, const std::vector<std::vector<int>>& remote, const Peer& shape,
                                const std::vector<const char*>& blobs, const std::vector<ElementRange>* spans = nullptr) {
  PlaceRemoteOperands(round.peers, remote, shape, blobs, spans);
}
// Runs the work of a round whose operands are all in place; `me` is the arriving rank
// (its future completes on this thread).
void Execute(const std::shared_ptr<Round>& round, const std::shared_ptr<const WorkFn>& work, int me);
// Completes every rank's future: `inline_rank`'s on this thread (it continues that
// rank's program), the others' on pool threads.
void CompleteAll(Round& round, int inline_rank, ffi::ErrorCode code);
// Keeps the round's first error.
void RecordError(Round& round, std::string err);
// Combines two 64-bit values so that any change of either changes every output bit
// with probability 1/2 (splitmix64's finalizer).
uint64_t Mix(uint64_t h, uint64_t v);
// "ranks [..] (partitions [..])", for messages.
std::string RankList(const std::vector<int>& ranks, const std::vector<int64_t>& group);

}  // namespace jaxcomm
