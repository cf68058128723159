// Which transport each group of a CUDA instruction takes, decided once per group from
// where its ranks live. Pure host logic (no CUDA calls): the tests call it on CPU.
//
//   copy           one rank: a copy on the stream (or nothing)
//   nccl           NCCL, on XLA's stream
//   local peers    GPUs of this process reading each other's buffers (peer access)
//   process peers  one rank per process, all on one host: CUDA IPC handles and events
//                  exchanged through the host backend's shared-memory links (ipc.h)
//
// ppermute and the MoE transport take the peer routes wherever they exist (own kernels,
// the copy engine). The other ops take NCCL, except where NCCL cannot serve: a group with
// two ranks on one GPU (several processes sharing a device; NCCL refuses it with
// "Duplicate GPU detected") takes the process peers, whatever the op.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace jaxcomm::cuda {

enum class Route { kCopy, kNccl, kLocalPeers, kProcessPeers };
const char* RouteName(Route route);

// One rank of a group: its process and local device, and what that process published
// (jaxcomm/_src/cuda_runtime.py): its host key and the device's UUID ("" when unknown).
struct Member {
  int64_t process = 0;
  int64_t ordinal = -1;
  std::string host;
  std::string device;
};

struct RouteChoice {
  Route route = Route::kNccl;
  std::string error;  // set: no route serves the group, and why
};

// Whether `op` runs jaxcomm's own kernels (or copies) on groups of several GPUs.
bool UsesOwnKernels(std::string_view op);

// The route of `group` (members in rank order) as seen from process `me`.
// `one_rank_nccl`: JAXCOMM_CUDA_ONE_RANK=nccl (one-rank groups through NCCL, for tests).
RouteChoice ChooseRoute(std::string_view op, const std::vector<Member>& group, int64_t me,
                        bool one_rank_nccl);

// What every process of the job published about itself: its host key and the UUID of
// each of its local devices (by ordinal). Thread-safe.
class ProcessTable {
 public:
  void Set(int64_t process, std::string host, std::vector<std::string> devices);
  // The member at (process, ordinal), with host and device filled in where known.
  Member Describe(int64_t process, int64_t ordinal) const;

 private:
  mutable std::mutex mu_;
  std::map<int64_t, std::pair<std::string, std::vector<std::string>>> table_;
};

}  // namespace jaxcomm::cuda
