// Matching collective calls across the ranks of a group, and completing them.
//
// XLA:CPU runs independent custom calls in different orders on different devices and
// keeps several in flight, so a call is identified by its instruction (one RoundTable per
// custom-call instruction per executable, created in the FFI instantiate stage) and its
// execution (the FFI RunId), never by arrival order.
//
// Handlers never block: each rank publishes its buffers and returns an ffi::Future (or
// "done", when its round completed on its own thread: core/call_result.h). The last rank to arrive runs the data movement (split over pool threads, one part per
// core, when large) and the futures are completed on pool threads (core/completion_pool.h
// says why). A watchdog fails a round that some rank never joins, at its deadline.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/call_context.h"
#include "core/call_result.h"
#include "core/cross_process.h"
#include "core/mismatch.h"
#include "core/small_function.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;
using Clock = std::chrono::steady_clock;

// One rank's buffers for one call. The peers' buffers are read and written in place.
// A rank of another process has `out == nullptr`: its inputs are a copy (shared memory
// or received), and its results are that process's to write.
struct Peer {
  const void* in = nullptr;
  void* out = nullptr;
  // Further per-rank operands of ops that take several (e.g. offsets and sizes).
  std::array<const void*, 4> aux{};
  // A second result, where an op has one (ft all_reduce's contributor mask).
  void* out_aux = nullptr;
  // Sizes of `in` and `aux`: what crosses to other processes. The same on every rank.
  size_t in_bytes = 0;
  std::array<size_t, 4> aux_bytes{};
  // This rank's flight recorder entry (0: none) and what it records of `in`.
  uint64_t trace = 0;
  uint8_t dtype = 0;  // XLA_FFI_DataType
  int64_t elements = 0;
  size_t item_bytes() const { return elements > 0 ? in_bytes / static_cast<size_t>(elements) : 0; }
};

// The data movement of one op, given every rank's buffers. The work is cut into
// `num_parts` disjoint parts that may run concurrently on different threads; returns ""
// or an error message.
using WorkFn = SmallFunction<std::string(const std::vector<Peer>& peers, int part, int num_parts)>;

// The same data movement for ops that split by element ranges of the inputs: for
// elements [lo, hi) of every rank's input, where peers[r].in points at element lo of
// rank r's, writes every result element that depends only on that range. With it, a
// large cross-process round streams through shared memory (core/cross_process.h).
using RangeFn = SmallFunction<std::string(const std::vector<Peer>& peers, size_t lo, size_t hi)>;

// From this many bytes of input per rank, a cross-process round of an op with a RangeFn
// streams through shared memory (CrossProcess::Stream) instead of being copied whole.
constexpr size_t kStreamBytes = 1 << 20;
// Whether a call's rounds stream when all the processes of its group share a host.
inline bool Streamable(const Peer& mine, bool has_range, bool tolerant) {
  for (size_t b : mine.aux_bytes) {
    if (b != 0) return false;
  }
  return has_range && !tolerant && mine.in_bytes >= kStreamBytes;
}

// Reductions (all_reduce): out = op over in[0], in[1], ... elementwise, `elements` each.
// With it, a round over processes on several hosts reduces within each host first
// (core/hierarchical.cc).
using CombineFn = SmallFunction<std::string(const std::vector<const void*>& in, void* out, size_t elements)>;

// Which operands a rank's result depends on: whether rank `dst`'s result reads rank
// `src`'s operand (ppermute: its source's; broadcast: the root's). Without it, every
// rank's. Over TCP a process then sends each peer only the operands that peer reads.
using NeedsFn = SmallFunction<bool(int src, int dst)>;

// Elements [first, last) of an operand.
using ElementRange = std::pair<size_t, size_t>;

// For ops whose results each read only part of every input: the elements of every input
// that rank `reader`'s result reads (all_to_all, reduce_scatter: its own block of each).
// Without it, all of them. A streamed round then copies into shared memory only the
// chunks some other process's rank reads, and over TCP a process sends each peer only
// the span of its operands that the peer's ranks read.
using ReadsFn = SmallFunction<ElementRange(int reader)>;

// Whether a round over `processes` (this one included) runs hierarchically (if its call
// MayRunInPhases): they span several hosts and some host holds several of them.
bool SpansHostsHierarchically(const CrossProcess& world, const std::vector<int64_t>& processes);
// Fault-tolerant calls never run in phases; nor, from kDirectBytes per rank, do ops that
// send each peer directly only what its ranks read (`direct`: a ReadsFn, or every
// operand read by one rank at most): across H hosts that moves H times fewer bytes than
// relaying whole operands through the hosts' leaders. (4 processes as 2 hosts: 16 MiB
// all_to_all 25-28 -> 12-13 ms, reduce_scatter at 256 KiB 1.7 -> 0.4 ms; below, the
// relay's fewer TCP messages won: 64 KiB all_to_all 0.2 ms relayed, 0.6 ms direct.)
constexpr size_t kDirectBytes = 256 << 10;
inline bool MayRunInPhases(bool tolerant, bool direct, size_t in_bytes) {
  return !tolerant && !(direct && in_bytes >= kDirectBytes);
}

// From this many bytes per rank, a reduction (a CombineFn, no aux operands, not fault
// tolerant) may run as a reduce-scatter then an all-gather (ScattersAndGathers); below,
// the single exchange's one round trip wins (4 processes over TCP on 2 cores: 256 KiB
// 1.4-1.9 ms in one exchange, 2.0-2.2 ms in two; 512 KiB even at 2.0-2.7 ms; 1 MiB
// 3.7-4.1 against 3.1-3.6 ms).
constexpr size_t kScatterGatherBytes = 512 << 10;
// Up to this many bytes of operands per rank, a round of a group with one rank in this
// process whose other processes share this host runs inline on the device thread
// (RoundTable::ArriveInline): below the size at which the work would be split over
// threads, and at which larger rounds stream instead.
constexpr size_t kInlineBytes = 256 << 10;

inline bool MayScatterGather(bool tolerant, bool has_combine, const Peer& mine) {
  for (size_t b : mine.aux_bytes) {
    if (b != 0) return false;
  }
  return has_combine && !tolerant && mine.in_bytes >= kScatterGatherBytes;
}
// Whether a call that MayScatterGather, over a group whose other processes are `remote`,
// runs as a reduce-scatter then an all-gather (core/scatter_gather.cc): when there are
// two or more of them, all linked by TCP, and the round does not run in phases across
// hosts. Each process then sends 2(P-1)/P operands instead of P-1. Not through shared
// memory: 4 processes on 2 cores took longer for a reduce_scatter plus an all_gather
// (12 + 15 ms at 16 MiB) than for the single exchange's all_reduce (20 ms).
bool ScattersAndGathers(const CrossProcess& world, const std::vector<int64_t>& remote);

struct CollectiveCall {
  CallContext ctx;               // execution is filled in by the rendezvous
  int64_t run_id = 0;
  Peer mine;
  std::chrono::milliseconds timeout{300000};
  size_t work_bytes = 0;         // bytes the whole op reads and writes: decides the split
  // Whether the work splits by destination rank (parts beyond this process's ranks would
  // idle) or by element ranges (any number of parts helps, e.g. all_reduce).
  bool split_by_rank = true;
  // Fault tolerant (ft.all_reduce): ranks of processes that die or miss the deadline are
  // left out (their Peer has no `in`) instead of failing the call.
  bool tolerant = false;
  // The op's work by element ranges, and its combining step, when it has them. Held by
  // value: a round that outlives the call shares copies (NewRound), and a call that
  // completes inline allocates none.
  RangeFn range;
  CombineFn combine;
  bool combine_partials = true;  // combine may reduce partial results (LaunchOptions)
  NeedsFn needs;
  ReadsFn reads;
  bool point_to_point = false;  // each operand is read by one rank at most (ppermute)
  // Whether this call may send its operands directly rather than in phases (see
  // MayRunInPhases).
  bool direct() const { return reads != nullptr || point_to_point; }
};

struct Round;
struct Hierarchy;
struct ScatterGather;

// The state of one custom-call instruction: its groups and its rounds in flight.
class RoundTable : public std::enable_shared_from_this<RoundTable> {
 public:
  // `partition_devices` holds (process index, device id) per partition (XLA's device
  // ordinal of a CPU device is its id, e.g. 2048 for process 1's first device);
  // `instruction_key` identifies this instruction identically in every process.
  RoundTable(std::vector<std::vector<int64_t>> groups,
             const std::vector<std::pair<int64_t, int64_t>>& partition_devices, int64_t process_index,
             uint64_t instruction_key);
  RoundTable(const RoundTable&) = delete;
  RoundTable& operator=(const RoundTable&) = delete;

  // (group index, rank in group) of a partition, or nullopt when it is in no group.
  std::optional<std::pair<int, int>> Locate(int64_t partition) const;
  // The partition this process's device `ordinal` runs, or -1.
  int64_t PartitionOfOrdinal(int64_t ordinal) const {
    for (const auto& [o, p] : ordinal_to_partition_) {
      if (o == ordinal) return p;
    }
    return -1;
  }
  const std::vector<int64_t>& group(int index) const { return *groups_[index]; }
  // What the flight recorder describes a call by: the instruction's key (the same
  // in every process) and the other processes a group spans.
  uint64_t instruction_key() const { return instruction_key_; }
  const std::vector<int64_t>& remote_processes(int index) const { return layouts_[index].processes; }

  // Joins the call with this rank's buffers; the result is done, or its future completes,
  // once this rank's result is written and no peer reads its buffers any more (or with
  // the error).
  CallResult Arrive(const CollectiveCall& call, WorkFn work);

  // The mismatch check (core/mismatch.h): appends this table's rounds that wait for
  // local ranks; fails one of them (still waiting, the same round) with `error`.
  void Waiting(std::vector<LocalWait>& out);
  void FailWaiting(const LocalWait& wait, const std::string& error);

 private:
  using Key = std::pair<int64_t, int64_t>;  // (run id, group index)
  // A round of a group with one rank in this process, whose other processes all share
  // this host (see InlineCandidate): the device thread exchanges through shared memory
  // and runs the work itself, with no Round, lock, future hand-off or pool thread; a
  // round whose peers are not there within the spin budget continues as any other.
  CallResult ArriveInline(InlineExchange& exchange, const CollectiveCall& call, WorkFn& work);
  // A new round of group `g` for `call`, numbered `execution`.
  std::shared_ptr<Round> NewRound(const CollectiveCall& call, int64_t g, int64_t execution);
  void Tombstone(const Key& key, int64_t execution, bool mismatch = false);
  // The watchdog's entry for a round waiting for local ranks (`expected`): at its grace
  // period, looks for a mismatch (FailMismatched), then waits for its deadline (Expire).
  void Watch(const Key& key, const std::shared_ptr<Round>& round, Clock::time_point when);
  void Overdue(const Key& key, const std::weak_ptr<Round>& expected);
  void Expire(const Key& key, const std::weak_ptr<Round>& expected);
  // Fails the rounds of this process in a cycle of waits with `round`; false if none.
  bool FailMismatched(const std::shared_ptr<Round>& round);
  // Exchanges the inputs of a round whose local ranks all arrived with the group's other
  // processes, then runs its work (core/cross_process.h).
  void StartCrossProcess(const std::shared_ptr<Round>& round, std::shared_ptr<const WorkFn> work, int me);
  // The same for a round that streams (ExchangePlan::arrival): a handshake, then the
  // stream, with the op's RangeFn consuming the chunks.
  void StartStream(const std::shared_ptr<Round>& round, int me, std::shared_ptr<const ExchangePlan> plan,
                   const Peer& shape);
  // The same for a round that runs in phases across hosts (core/hierarchical.cc).
  void StartHierarchical(const std::shared_ptr<Round>& round, std::shared_ptr<const WorkFn> work, int me,
                         std::shared_ptr<const Hierarchy> hierarchy, const Peer& shape);
  // The same for a reduction run as a reduce-scatter then an all-gather
  // (core/scatter_gather.cc).
  void StartScatterGather(const std::shared_ptr<Round>& round, int me, std::shared_ptr<const ScatterGather> sg,
                          const Peer& shape);
  // The flat exchange of a round's operands with the group's other processes, then its
  // work (`published`: an InlineExchange already published this process's operands).
  void StartFlat(const std::shared_ptr<Round>& round, std::shared_ptr<const WorkFn> work, int me,
                 std::shared_ptr<const ExchangePlan> plan, const Peer& shape, bool published);

  // Where a group's ranks live: this process's ranks, and each other process's.
  struct Layout {
    std::vector<int> local;                        // ranks in this process, ascending
    std::vector<int64_t> processes;                // the other processes, ascending
    std::vector<std::vector<int>> remote;          // their ranks, ascending
    bool cross_process() const { return !processes.empty(); }
    // Made by the first cross-process round (it needs the operands' sizes), under mu_.
    std::shared_ptr<const ExchangePlan> plan;
    std::shared_ptr<const Hierarchy> hierarchy;  // rounds that run in phases across hosts
    std::shared_ptr<const ScatterGather> scatter_gather;  // reductions over TCP (ScattersAndGathers)
    // Per other process: the ranks whose operands arrive from it (all of its ranks but
    // over TCP with a NeedsFn), and the places in `local` of the ranks sent to it.
    std::vector<std::vector<int>> received;
    std::vector<std::vector<size_t>> sent;
    // Per other process: the elements of each operand sent to it and received from it
    // (all of them but over TCP with a ReadsFn).
    std::vector<ElementRange> sent_span, received_span;
    bool subsets = false;  // some `sent` is not all of `local`, or some span not whole
    Peer shape;  // the sizes every rank's operands have
    std::unique_ptr<InlineExchange> inline_exchange;  // rounds that run inline, see ArriveInline
  };

  uint64_t instruction_key_;
  std::vector<Layout> layouts_;  // per group
  std::vector<std::shared_ptr<const std::vector<int64_t>>> groups_;
  std::vector<std::pair<int, int>> where_;  // by partition: (group, rank), (-1,-1) if none
  std::vector<std::pair<int64_t, int64_t>> ordinal_to_partition_;  // this process's devices

  std::mutex mu_;
  std::map<Key, std::shared_ptr<Round>> rounds_;
  std::vector<std::atomic<int64_t>> executions_;  // per group: rounds numbered so far
  // Per group: its layout's inline_exchange once the first round made it (set once).
  std::vector<std::atomic<InlineExchange*>> inline_;
  // Calls that failed (timed out, or a mismatch): a rank that arrives late fails at
  // once instead of waiting a whole timeout for peers that already gave up. Bounded.
  struct Failed {
    int64_t execution = 0;
    bool mismatch = false;
  };
  std::map<Key, Failed> failed_;
  std::deque<Key> failed_order_;
};

// The FFI state type: one per custom-call instruction per executable.
struct InstructionState {
  static ffi::TypeId id;
  explicit InstructionState(std::shared_ptr<RoundTable> t) : table(std::move(t)) {}
  std::shared_ptr<RoundTable> table;
};

}  // namespace jaxcomm
