#include "cuda/state.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "core/flight_recorder.h"
#include "core/registry.h"
#include "core/round.h"  // Mix
#include "cuda/backend.h"
#include "cuda/ipc.h"

namespace jaxcomm::cuda {

ffi::TypeId CudaState::id = {};

CudaState::CudaState(std::string op, std::string call_site, std::string axis, GroupAttrs groups,
                     int64_t process_index, std::chrono::milliseconds timeout, OpAttrs attrs,
                     bool one_rank_nccl, uint64_t instruction_key)
    : op_(std::move(op)), call_site_(std::move(call_site)), axis_(std::move(axis)),
      groups_(std::move(groups)), process_index_(process_index), timeout_(timeout),
      attrs_(std::move(attrs)), one_rank_nccl_(one_rank_nccl), instruction_key_(instruction_key) {}

Placement CudaState::Locate(int64_t ordinal) const {
  Placement p;
  const auto& pd = groups_.partition_devices;
  for (size_t i = 0; i < pd.size(); ++i) {
    if (pd[i].first == process_index_ && pd[i].second == ordinal) {
      p.partition = static_cast<int64_t>(i);
      break;
    }
  }
  if (p.partition < 0) return p;
  for (size_t g = 0; g < groups_.groups.size(); ++g) {
    for (size_t r = 0; r < groups_.groups[g].size(); ++r) {
      if (groups_.groups[g][r] == p.partition) {
        p.group_index = static_cast<int>(g);
        p.rank = static_cast<int>(r);
        return p;
      }
    }
  }
  return p;
}

std::string CudaState::GroupKey(int group_index) const {
  // Must equal jaxcomm/_src/cuda_runtime.py's group_key().
  std::ostringstream s;
  s << "nccl:";
  const auto& g = groups_.groups[group_index];
  for (size_t i = 0; i < g.size(); ++i) {
    const auto& [proc, ordinal] = groups_.partition_devices[g[i]];
    s << (i ? "," : "") << proc << "/" << ordinal;
  }
  return s.str();
}

bool CudaState::SpansProcesses(int group_index) const {
  for (int64_t partition : groups_.groups[group_index]) {
    if (groups_.partition_devices[partition].first != process_index_) return true;
  }
  return false;
}

CallContext CudaState::Context(const Placement& p, int64_t execution) const {
  CallContext ctx;
  ctx.op = op_;
  ctx.call_site = call_site_;
  ctx.axis = axis_;
  ctx.group = p.group_index >= 0 ? &groups_.groups[p.group_index] : nullptr;
  ctx.group_index = p.group_index;
  ctx.rank = p.rank;
  ctx.partition = p.partition;
  ctx.execution = execution;
  return ctx;
}

std::string CudaState::Summary() const {
  std::ostringstream s;
  s << "op=" << op_ << " axis=" << axis_ << " call_site=" << call_site_
    << " timeout_ms=" << timeout_.count() << " groups=";
  for (const auto& g : groups_.groups) {
    s << "[";
    for (size_t i = 0; i < g.size(); ++i) s << (i ? " " : "") << g[i];
    s << "]";
  }
  s << DescribeAttrs(attrs_);
  return s.str();
}

ffi::ErrorOr<std::shared_ptr<GroupInfo>> CudaState::Describe(int g) {
  if (auto it = infos_.find(g); it != infos_.end()) return it->second;
  const auto& members = groups_.groups[g];
  std::vector<Member> described;
  for (int64_t partition : members) {
    const auto& [process, ordinal] = groups_.partition_devices[partition];
    described.push_back(Backend::Get().processes().Describe(process, ordinal));
  }
  const RouteChoice choice = ChooseRoute(op_, described, process_index_, one_rank_nccl_);
  if (!choice.error.empty()) {
    Placement p;
    p.group_index = g;
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kUnimplemented,
                                      Context(p).Describe() + ": " + choice.error));
  }
  auto info = std::make_shared<GroupInfo>();
  info->op = op_;
  info->axis = axis_;
  info->call_site = call_site_;
  info->group = members;
  info->group_index = g;
  info->instruction_key = instruction_key_;
  info->route = choice.route;
  std::set<int64_t> processes;
  for (size_t r = 0; r < described.size(); ++r) {
    processes.insert(described[r].process);
    if (described[r].process == process_index_) info->local_ranks.push_back(static_cast<int>(r));
  }
  info->enqueued.reset(new std::atomic<int64_t>[members.size()]);
  for (size_t r = 0; r < members.size(); ++r) info->enqueued[r].store(0);
  FlightRecorder& rec = Registry::Get().recorder();
  if (rec.enabled()) {
    auto site = std::make_unique<TraceSite>();
    site->table = this;
    site->instruction = instruction_key_;
    site->group_index = g;
    site->op = op_;
    site->axis = axis_;
    site->call_site = call_site_;
    site->group = members;
    site->processes.assign(processes.begin(), processes.end());
    site->algorithm = RouteName(choice.route);
    info->site = rec.AddSite(std::move(site));
  }
  infos_[g] = info;
  return info;
}

ffi::Error CudaState::Initialize(int64_t ordinal) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (slots_.count(ordinal) != 0) return ffi::Error::Success();
  }
  const Placement p = Locate(ordinal);
  const CallContext ctx = Context(p);
  if (p.rank < 0) {
    return ffi::Error::Internal(ctx.Describe() + ": this device (ordinal " + std::to_string(ordinal) +
                                ") is in none of the instruction's replica groups");
  }
  const int g = p.group_index;
  const auto& members = groups_.groups[g];
  std::shared_ptr<GroupInfo> info;
  std::shared_ptr<LocalPeers> local;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto described = Describe(g);
    if (described.has_error()) return described.error();
    info = *described;
    if (info->route == Route::kLocalPeers) {
      auto& shared = local_peers_[g];
      if (!shared) shared = std::make_shared<LocalPeers>();
      local = shared;
    }
  }
  DeviceSlot slot;
  slot.info = info;
  int pitch = 0;
  if (cudaDeviceGetAttribute(&pitch, cudaDevAttrMaxPitch, static_cast<int>(ordinal)) == cudaSuccess && pitch > 0) {
    slot.max_pitch = static_cast<size_t>(pitch);
  } else {
    slot.max_pitch = (size_t{1} << 31) - 1;  // every current GPU's
  }
  const int device = static_cast<int>(ordinal);
  switch (info->route) {
    case Route::kCopy:
      break;
    case Route::kNccl: {
      auto comm = Backend::Get().comms().Acquire(GroupKey(g), p.rank, static_cast<int>(members.size()),
                                                 device, SpansProcesses(g), timeout_, ctx.Describe());
      if (comm.has_error()) return comm.error();
      slot.comm = *comm;
      break;
    }
    case Route::kLocalPeers: {
      std::vector<int> devices;
      for (int64_t partition : members) devices.push_back(static_cast<int>(groups_.partition_devices[partition].second));
      std::string why = EnablePeerAccess(device, devices);
      auto events = std::make_unique<DeviceEvents>();
      if (why.empty()) why = events->Create(device, /*interprocess=*/false);
      if (!why.empty()) return ffi::Error::Internal(ctx.Describe() + ": " + why);
      slot.peers = std::make_shared<LocalPeerRoute>(local, std::move(events));
      break;
    }
    case Route::kProcessPeers: {
      std::vector<int64_t> processes;
      for (int64_t partition : members) processes.push_back(groups_.partition_devices[partition].first);
      auto events = std::make_unique<DeviceEvents>();
      std::string why = events->Create(device, /*interprocess=*/true);
      auto route = std::make_shared<ProcessPeerRoute>(Mix(instruction_key_, static_cast<uint64_t>(g)), p.rank,
                                                      std::move(processes), members, device, std::move(events));
      if (why.empty()) why = route->Init();
      if (!why.empty()) return ffi::Error::Internal(ctx.Describe() + ": " + why);
      slot.peers = std::move(route);
      break;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  slots_.emplace(ordinal, std::move(slot));
  return ffi::Error::Success();
}

DeviceSlot CudaState::Lookup(int64_t ordinal) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(ordinal);
  if (it == slots_.end()) return DeviceSlot{};
  ++it->second.execution;
  return it->second;
}

std::string Where(const CallContext& ctx, const char* what, const char* file, int line) {
  std::ostringstream s;
  s << ctx.Describe() << ": " << what << " failed at " << file << ":" << line << ": ";
  return s.str();
}

}  // namespace jaxcomm::cuda
