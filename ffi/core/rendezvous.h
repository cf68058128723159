// Matching collective calls across the ranks of a group, and completing them.
//
// XLA:CPU runs independent custom calls in different orders on different devices and
// keeps several in flight, so a call is identified by its instruction (one RoundTable per
// custom-call instruction per executable, created in the FFI instantiate stage) and its
// execution (the FFI RunId), never by arrival order. The last rank to arrive runs the
// data movement for the whole group (split over XLA's intra-op thread pool when it is
// large) and completes every rank's ffi::Future, so no device thread sits blocked.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/call_context.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// One rank's buffers for one call. The peers' buffers are read and written in place.
struct Peer {
  const void* in = nullptr;
  void* out = nullptr;
};

// The data movement of one op, given every rank's buffers. The work is cut into
// `num_parts` disjoint parts that may run concurrently; returns "" or an error message.
using WorkFn = std::function<std::string(const std::vector<Peer>& peers, int part, int num_parts)>;

// One execution of one instruction by one group.
struct Round {
  explicit Round(int size) : peers(size), promises(size), partitions(size, -1) {}
  std::vector<Peer> peers;
  std::vector<std::optional<ffi::Promise>> promises;  // engaged once that rank arrived
  std::vector<int64_t> partitions;                     // who arrived, for messages
  std::shared_ptr<const std::vector<int64_t>> group;   // partition ids of the members
  int64_t group_index = 0;
  int arrived = 0;
  int64_t execution = 0;
  uint64_t watchdog_id = 0;
  // Copied from the first arrival: the executable's attributes are not ours to keep.
  std::string op, axis, call_site;
  std::atomic<int> parts_left{0};
  std::mutex error_mu;
  std::string error;
};

struct CollectiveCall {
  CallContext ctx;               // execution is filled in here
  int64_t run_id = 0;
  Peer mine;
  std::chrono::milliseconds timeout{300000};
  size_t work_bytes = 0;         // bytes the whole op reads and writes: decides the split
};

// The state of one custom-call instruction: its groups and its rounds in flight.
class RoundTable : public std::enable_shared_from_this<RoundTable> {
 public:
  RoundTable(std::vector<std::vector<int64_t>> groups, int64_t num_partitions);
  RoundTable(const RoundTable&) = delete;
  RoundTable& operator=(const RoundTable&) = delete;

  // (group index, rank in group) of a partition, or nullopt when it is in no group.
  std::optional<std::pair<int, int>> Locate(int64_t partition) const;
  const std::vector<int64_t>& group(int index) const { return *groups_[index]; }

  // Registers this rank's buffers; returns the future XLA waits on.
  ffi::Future Arrive(const CollectiveCall& call, std::shared_ptr<const WorkFn> work,
                     ffi::ThreadPool* pool);

 private:
  using Key = std::pair<int64_t, int64_t>;  // (run id, group index)
  void Expire(const Key& key, const std::weak_ptr<Round>& expected,
              std::chrono::milliseconds timeout);
  void Tombstone(const Key& key);

  std::vector<std::shared_ptr<const std::vector<int64_t>>> groups_;
  std::vector<std::pair<int, int>> where_;  // by partition: (group, rank), (-1,-1) if none

  std::mutex mu_;
  std::map<Key, std::shared_ptr<Round>> rounds_;
  std::vector<int64_t> executions_;  // per group
  // Calls that failed (timed out): a rank that arrives late fails at once instead of
  // waiting a whole timeout for peers that already gave up. Bounded.
  std::set<Key> failed_;
  std::deque<Key> failed_order_;
};

// The FFI state type: one per custom-call instruction per executable.
struct InstructionState {
  static ffi::TypeId id;
  explicit InstructionState(std::shared_ptr<RoundTable> t) : table(std::move(t)) {}
  std::shared_ptr<RoundTable> table;
};

// Runs the work of a round whose ranks all arrived, then completes their futures.
void ExecuteRound(std::shared_ptr<Round> round, std::shared_ptr<const WorkFn> work,
                  size_t work_bytes, ffi::ThreadPool* pool);

}  // namespace jaxcomm
