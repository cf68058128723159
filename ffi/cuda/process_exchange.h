// A blocking exchange of small per-call records between the processes of a group, over
// the host backend's cross-process transport (core/cross_process.h: shared memory between
// the processes of one host). The CUDA IPC route (ipc.h) sends its handles through it.
// Host logic only: the tests run it across CPU processes.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/cross_process.h"

namespace jaxcomm::cuda {

// The plan of an exchange in which this process sends `bytes` and every one of `peers`
// (other processes, any order) sends as many; `key` names it in every process alike.
std::shared_ptr<const ExchangePlan> MakePlan(uint64_t key, std::vector<int64_t> peers, size_t bytes,
                                             const std::vector<std::string>& peer_desc);

// Sends `mine` to the plan's peers and returns theirs (plan order), for round `seq`
// (from 1, one more each round); "" or why not. `timed_out` tells a deadline from other
// failures. The peers' records are copied out and released before returning.
std::string ExchangeRecords(const std::shared_ptr<const ExchangePlan>& plan, int64_t seq,
                            const std::string& mine, std::chrono::steady_clock::time_point deadline,
                            std::vector<std::string>* theirs, bool* timed_out);

}  // namespace jaxcomm::cuda
