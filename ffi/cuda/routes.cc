#include "cuda/routes.h"

#include <set>

namespace jaxcomm::cuda {

const char* RouteName(Route route) {
  switch (route) {
    case Route::kCopy: return "cuda copy";
    case Route::kNccl: return "nccl";
    case Route::kLocalPeers: return "cuda peers in process";
    case Route::kProcessPeers: return "cuda ipc across processes";
  }
  return "unknown";
}

// The MoE transport and its split halves (moe_transport_send, moe_recv) take one route.
bool IsMoeTransport(std::string_view op) {
  return op == "moe_transport" || op == "moe_transport_send" || op == "moe_recv";
}

// The halves of a one-sided put (jaxcomm.tp) take one route too: the copy engine's.
static bool IsPut(std::string_view op) { return op == "put_start" || op == "put_done"; }

bool UsesOwnKernels(std::string_view op) { return op == "ppermute" || IsMoeTransport(op) || IsPut(op); }

RouteChoice ChooseRoute(std::string_view op, const std::vector<Member>& group, int64_t me,
                        bool one_rank_nccl) {
  if (group.size() <= 1) {
    // NCCL for a lone rank only where NCCL implements the op (JAXCOMM_CUDA_ONE_RANK=nccl
    // exercises NCCL on one GPU); the MoE and ragged kernels have no NCCL form.
    const bool nccl_op = !IsMoeTransport(op) && !IsPut(op) && op != "ragged_all_to_all";
    return {one_rank_nccl && nccl_op ? Route::kNccl : Route::kCopy, ""};
  }
  bool local = true, same_host = true, one_per_process = true, shared_device = false;
  std::set<int64_t> processes;
  std::set<std::string> devices;
  std::string shared;
  for (const Member& m : group) {
    local = local && m.process == me;
    same_host = same_host && !m.host.empty() && m.host == group[0].host;
    one_per_process = processes.insert(m.process).second && one_per_process;
    if (!m.device.empty() && !devices.insert(m.device).second) {
      shared_device = true;
      shared = m.device;
    }
  }
  if (local) return {UsesOwnKernels(op) ? Route::kLocalPeers : Route::kNccl, ""};
  const bool ipc = same_host && one_per_process;
  if (shared_device) {
    if (ipc) return {Route::kProcessPeers, ""};
    return {Route::kNccl,
            "two ranks of the group run on one GPU (" + shared +
                "), which NCCL refuses, and jaxcomm's own transport between them needs one rank "
                "per process, all on one host"};
  }
  if (UsesOwnKernels(op) && ipc) return {Route::kProcessPeers, ""};
  if (IsMoeTransport(op)) {
    return {Route::kNccl,
            "the CUDA MoE transport reads its peers' buffers in place, which needs the group's "
            "processes on one host, one rank each (other layouts take the composed transport, "
            "chosen when the program is traced)"};
  }
  return {Route::kNccl, ""};
}

void ProcessTable::Set(int64_t process, std::string host, std::vector<std::string> devices) {
  std::lock_guard<std::mutex> lock(mu_);
  table_[process] = {std::move(host), std::move(devices)};
}

Member ProcessTable::Describe(int64_t process, int64_t ordinal) const {
  Member m;
  m.process = process;
  m.ordinal = ordinal;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = table_.find(process);
  if (it == table_.end()) return m;
  m.host = it->second.first;
  if (ordinal >= 0 && ordinal < static_cast<int64_t>(it->second.second.size())) {
    m.device = it->second.second[ordinal];
  }
  return m;
}

}  // namespace jaxcomm::cuda
