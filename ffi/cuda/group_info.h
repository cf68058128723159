// What the calls of one CUDA instruction by one group share, kept alive by whoever still
// needs it (the completion watcher outlives executables that XLA frees): names for
// messages, the route, the flight recorder's site, and which executions each local rank
// has enqueued (for "ranks that did not arrive").
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/call_context.h"
#include "cuda/routes.h"

namespace jaxcomm {
struct TraceSite;
}

namespace jaxcomm::cuda {

struct GroupInfo {
  std::string op, axis, call_site;
  std::vector<int64_t> group;  // partitions, in rank order
  int group_index = 0;
  uint64_t instruction_key = 0;
  Route route = Route::kNccl;
  std::vector<int> local_ranks;             // the ranks this process runs
  const TraceSite* site = nullptr;          // flight recorder description (null: off)
  // Per rank: how many executions its handler enqueued (ranks of other processes: 0).
  std::unique_ptr<std::atomic<int64_t>[]> enqueued;
  // The latest execution whose NCCL call the completion watcher aborted at its deadline
  // (0: none): the peers' remote errors, and a rank that comes later, belong to it.
  mutable std::atomic<int64_t> deadline_aborted{0};

  CallContext Context(int rank, int64_t partition, int64_t execution) const {
    CallContext c;
    c.op = op;
    c.call_site = call_site;
    c.axis = axis;
    c.group = &group;
    c.group_index = group_index;
    c.rank = rank;
    c.partition = partition;
    c.execution = execution;
    return c;
  }
  // The ranks of this process that have not enqueued `execution`.
  std::vector<int> LocalRanksBehind(int64_t execution) const {
    std::vector<int> behind;
    for (int r : local_ranks) {
      if (enqueued[r].load(std::memory_order_relaxed) < execution) behind.push_back(r);
    }
    return behind;
  }
  // Whether every rank of the group runs in this process.
  bool AllLocal() const { return local_ranks.size() == group.size(); }
};

}  // namespace jaxcomm::cuda
