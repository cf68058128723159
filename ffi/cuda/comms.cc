#include "cuda/comms.h"

#include <future>
#include <sstream>
#include <thread>

namespace jaxcomm::cuda {

ffi::TypeId CudaState::id = {};

Communicator::~Communicator() {
  if (comm_ != nullptr) api_->CommDestroy(comm_);
}

CommRegistry& CommRegistry::Get() {
  // Leaked on purpose: destroying communicators during interpreter shutdown races with
  // the CUDA driver's own teardown (NCCL's proxy threads would touch a dead context).
  static CommRegistry* registry = new CommRegistry();
  return *registry;
}

void CommRegistry::SetUniqueId(const std::string& key, const ncclUniqueId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  ids_[key] = id;
}

std::vector<CommRegistry::Stats> CommRegistry::List() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Stats> out;
  for (const auto& [k, c] : comms_) {
    out.push_back({c->key(), c->rank(), c->size(), c->create_ms(), c->memory_bytes()});
  }
  return out;
}

namespace {

struct InitResult {
  ncclResult_t result = ncclSuccess;
  ncclComm_t comm = nullptr;
  std::string cuda_error;
  double ms = 0;
  int64_t memory = 0;
};

}  // namespace

ffi::ErrorOr<std::shared_ptr<Communicator>> CommRegistry::Acquire(
    const std::string& key, int rank, int size, int ordinal, bool spans_processes,
    std::chrono::milliseconds timeout, const std::string& where) {
  std::string load_error;
  const NcclApi* api = NcclApi::Get(&load_error);
  if (api == nullptr) return ffi::Unexpected(ffi::Error::Internal(where + ": " + load_error));
  std::shared_ptr<std::timed_mutex> creating;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = comms_.find({key, rank});
    if (found != comms_.end()) return found->second;
    auto& slot = creating_[{key, rank}];
    if (!slot) slot = std::make_shared<std::timed_mutex>();
    creating = slot;
  }
  std::unique_lock<std::timed_mutex> one_at_a_time(*creating, std::defer_lock);
  if (!one_at_a_time.try_lock_for(timeout)) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                                      where + ": another creation of the NCCL communicator of group " +
                                          key + " for rank " + std::to_string(rank) +
                                          " did not finish within " + std::to_string(timeout.count()) + " ms"));
  }
  ncclUniqueId id{};
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = comms_.find({key, rank});
    if (found != comms_.end()) return found->second;
    auto known = ids_.find(key);
    if (known != ids_.end()) {
      id = known->second;
    } else if (spans_processes) {
      return ffi::Unexpected(ffi::Error::Internal(
          where + ": no NCCL unique id for group " + key +
          " (a group spanning processes gets it from the jax.distributed key-value store when "
          "the program is lowered; was jax.distributed.initialize() called?)"));
    } else {
      // All ranks live in this process: whichever rank comes first makes the id.
      const ncclResult_t r = api->GetUniqueId(&id);
      if (r != ncclSuccess) {
        return ffi::Unexpected(ffi::Error::Internal(
            where + ": ncclGetUniqueId failed: " + api->Describe(r, nullptr)));
      }
      ids_[key] = id;
    }
  }
  // ncclCommInitRank blocks until every rank joined and has no deadline of its own, so it
  // runs on a helper thread that this one waits for with the call's deadline. A rank that
  // never comes leaves that thread blocked inside NCCL; the caller gets the error.
  auto result = std::make_shared<std::promise<InitResult>>();
  std::future<InitResult> done = result->get_future();
  std::thread([api, id, rank, size, ordinal, result] {
    InitResult out;
    const cudaError_t set = cudaSetDevice(ordinal);
    if (set != cudaSuccess) {
      out.cuda_error = std::string("cudaSetDevice: ") + cudaGetErrorString(set);
      result->set_value(out);
      return;
    }
    size_t free_before = 0, free_after = 0, total = 0;
    cudaMemGetInfo(&free_before, &total);
    const auto t0 = std::chrono::steady_clock::now();
    out.result = api->CommInitRank(&out.comm, size, id, rank);
    out.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    cudaMemGetInfo(&free_after, &total);
    out.memory = static_cast<int64_t>(free_before) - static_cast<int64_t>(free_after);
    result->set_value(out);
  }).detach();
  if (done.wait_for(timeout) != std::future_status::ready) {
    std::ostringstream msg;
    msg << where << ": creating the NCCL communicator of group " << key << " (rank " << rank
        << " of " << size << ") did not finish within " << timeout.count()
        << " ms: some rank of the group never joined";
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg.str()));
  }
  InitResult r = done.get();
  if (!r.cuda_error.empty()) {
    return ffi::Unexpected(ffi::Error::Internal(where + ": creating the NCCL communicator of group " +
                                                key + ": " + r.cuda_error));
  }
  if (r.result != ncclSuccess) {
    return ffi::Unexpected(ffi::Error::Internal(
        where + ": ncclCommInitRank (group " + key + ", rank " + std::to_string(rank) + " of " +
        std::to_string(size) + ") failed: " + api->Describe(r.result, r.comm)));
  }
  auto comm = std::make_shared<Communicator>(api, r.comm, key, rank, size, r.ms, r.memory);
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = comms_.emplace(std::make_pair(key, rank), comm);
  return it->second;
}

CudaState::CudaState(std::string op, std::string call_site, std::string axis,
                     std::vector<std::vector<int64_t>> groups,
                     std::vector<std::pair<int64_t, int64_t>> partition_devices,
                     int64_t process_index, std::chrono::milliseconds timeout, OpAttrs attrs,
                     bool one_rank_nccl)
    : op_(std::move(op)), call_site_(std::move(call_site)), axis_(std::move(axis)),
      groups_(std::move(groups)), partition_devices_(std::move(partition_devices)),
      process_index_(process_index), timeout_(timeout), attrs_(std::move(attrs)),
      one_rank_nccl_(one_rank_nccl) {}

Placement CudaState::Locate(int64_t ordinal) const {
  Placement p;
  for (size_t i = 0; i < partition_devices_.size(); ++i) {
    if (partition_devices_[i].first == process_index_ && partition_devices_[i].second == ordinal) {
      p.partition = static_cast<int64_t>(i);
      break;
    }
  }
  if (p.partition < 0) return p;
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (size_t r = 0; r < groups_[g].size(); ++r) {
      if (groups_[g][r] == p.partition) {
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
  const auto& g = groups_[group_index];
  for (size_t i = 0; i < g.size(); ++i) {
    const auto& [proc, ordinal] = partition_devices_[g[i]];
    s << (i ? "," : "") << proc << "/" << ordinal;
  }
  return s.str();
}

bool CudaState::SpansProcesses(int group_index) const {
  for (int64_t partition : groups_[group_index]) {
    if (partition_devices_[partition].first != process_index_) return true;
  }
  return false;
}

CallContext CudaState::Context(const Placement& p, int64_t execution) const {
  CallContext ctx;
  ctx.op = op_;
  ctx.call_site = call_site_;
  ctx.axis = axis_;
  ctx.group = p.group_index >= 0 ? &groups_[p.group_index] : nullptr;
  ctx.group_index = p.group_index;
  ctx.rank = p.rank;
  ctx.partition = p.partition;
  ctx.execution = execution;
  return ctx;
}

bool CudaState::UsesPeers(int group_index) const {
  return (op_ == "ppermute" || op_ == "moe_transport") && groups_[group_index].size() > 1 &&
         !SpansProcesses(group_index) && !one_rank_nccl_;
}

std::vector<int> CudaState::LocalDevices(int group_index) const {
  std::vector<int> out;
  for (int64_t partition : groups_[group_index]) {
    out.push_back(static_cast<int>(partition_devices_[partition].second));
  }
  return out;
}

ffi::Error CudaState::Initialize(int64_t ordinal) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (initialized_[ordinal]) return ffi::Error::Success();
  }
  const Placement p = Locate(ordinal);
  const CallContext ctx = Context(p);
  if (p.rank < 0) {
    return ffi::Error::Internal(ctx.Describe() + ": this device (ordinal " + std::to_string(ordinal) +
                                ") is in none of the instruction's replica groups");
  }
  const int size = static_cast<int>(groups_[p.group_index].size());
  DeviceSlot slot;
  if (UsesPeers(p.group_index)) {
    std::string why = EnablePeerAccess(static_cast<int>(ordinal), LocalDevices(p.group_index));
    auto events = std::make_shared<DeviceEvents>();
    if (why.empty()) why = events->Create(static_cast<int>(ordinal));
    if (!why.empty()) return ffi::Error::Internal(ctx.Describe() + ": " + why);
    slot.events = std::move(events);
  } else if (size > 1 || one_rank_nccl_) {
    auto comm = CommRegistry::Get().Acquire(GroupKey(p.group_index), p.rank, size,
                                            static_cast<int>(ordinal), SpansProcesses(p.group_index),
                                            timeout_, ctx.Describe());
    if (comm.has_error()) return comm.error();
    slot.comm = *comm;
  }  // else: a one-rank group, served by copies on the stream
  std::lock_guard<std::mutex> lock(mu_);
  slots_[ordinal] = std::move(slot);
  initialized_[ordinal] = true;
  return ffi::Error::Success();
}

DeviceSlot CudaState::Lookup(int64_t ordinal) {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceSlot& slot = slots_[ordinal];
  DeviceSlot out = slot;
  ++slot.execution;
  return out;
}

std::string Where(const CallContext& ctx, const char* what, const char* file, int line) {
  std::ostringstream s;
  s << ctx.Describe() << ": " << what << " failed at " << file << ":" << line << ": ";
  return s.str();
}

}  // namespace jaxcomm::cuda
