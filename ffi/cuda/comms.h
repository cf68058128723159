// NCCL communicators, one per (replica group, rank) actually used, shared by every
// executable of the process, and the per-instruction state of the CUDA handlers.
//
// A communicator is created in the FFI initialize stage, never on the execute path (which
// must stay capturable into a CUDA graph). Its NCCL unique id comes from the jax.distributed
// key-value store when the group spans processes (exchanged by Python when the program is
// lowered: jaxcomm/_src/cuda_runtime.py) and is made locally when it does not.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/call_context.h"
#include "cuda/nccl.h"
#include "cuda/peers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {

namespace ffi = xla::ffi;

// One NCCL communicator; destroyed with it (RAII).
class Communicator {
 public:
  Communicator(const NcclApi* api, ncclComm_t comm, std::string key, int rank, int size,
               double create_ms, int64_t memory_bytes)
      : api_(api), comm_(comm), key_(std::move(key)), rank_(rank), size_(size),
        create_ms_(create_ms), memory_bytes_(memory_bytes) {}
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  ncclComm_t get() const { return comm_; }
  const NcclApi& api() const { return *api_; }
  const std::string& key() const { return key_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  double create_ms() const { return create_ms_; }
  // Device memory that went away while NCCL set the communicator up (free-memory delta).
  int64_t memory_bytes() const { return memory_bytes_; }

 private:
  const NcclApi* api_;
  ncclComm_t comm_;
  std::string key_;
  int rank_, size_;
  double create_ms_;
  int64_t memory_bytes_;
};

// The process's communicators and the unique ids of groups that span processes.
class CommRegistry {
 public:
  static CommRegistry& Get();

  // The communicator of group `key` for `rank` on local device `ordinal`, created on first
  // use (blocks until every rank joined or `timeout` passed). Thread-safe: the ranks of one
  // process call it concurrently from their device threads.
  ffi::ErrorOr<std::shared_ptr<Communicator>> Acquire(const std::string& key, int rank, int size,
                                                      int ordinal, bool spans_processes,
                                                      std::chrono::milliseconds timeout,
                                                      const std::string& where);
  // Sets the unique id of a group that spans processes (from the key-value store).
  void SetUniqueId(const std::string& key, const ncclUniqueId& id);

  struct Stats {
    std::string key;
    int rank, size;
    double create_ms;
    int64_t memory_bytes;
  };
  std::vector<Stats> List();

 private:
  CommRegistry() = default;
  std::mutex mu_;
  std::map<std::pair<std::string, int>, std::shared_ptr<Communicator>> comms_;
  std::map<std::string, ncclUniqueId> ids_;
  // One creation at a time per (group, rank): two instructions initializing on one device
  // at once must not both join NCCL with the same id for the same rank.
  std::map<std::pair<std::string, int>, std::shared_ptr<std::timed_mutex>> creating_;
};

// Op-specific attributes the handlers read, parsed once at instantiation.
struct OpAttrs {
  int64_t reduce_op = 0, axis_index = 0, scatter_dimension = 0, split_axis = 0,
          concat_axis = 0, root = 0, mode = 0, src_rows = 0, dst_rows = 0;
  std::vector<int64_t> sources;
};

// Where this device sits in an instruction's groups.
struct Placement {
  int64_t partition = -1;
  int group_index = -1;
  int rank = -1;
};

// What the execute stage of one device finds ready for it.
struct DeviceSlot {
  std::shared_ptr<Communicator> comm;   // NCCL, or null (one-rank copies, peer path)
  std::shared_ptr<DeviceEvents> events; // set when the group takes the peer path
  int64_t execution = 0;                // this device's calls of the instruction so far
};

// The FFI state of one CUDA custom-call instruction.
class CudaState {
 public:
  static ffi::TypeId id;

  CudaState(std::string op, std::string call_site, std::string axis,
            std::vector<std::vector<int64_t>> groups,
            std::vector<std::pair<int64_t, int64_t>> partition_devices, int64_t process_index,
            std::chrono::milliseconds timeout, OpAttrs attrs, bool one_rank_nccl);

  const std::string& op() const { return op_; }
  const OpAttrs& attrs() const { return attrs_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  bool one_rank_nccl() const { return one_rank_nccl_; }
  const std::vector<int64_t>& group(int i) const { return groups_[i]; }

  // This device's place, from its local ordinal (-1 fields when in no group).
  Placement Locate(int64_t ordinal) const;
  // The group's identity across processes: "process/ordinal" of each member, rank order.
  std::string GroupKey(int group_index) const;
  bool SpansProcesses(int group_index) const;
  // Context for messages; `execution` counts this device's calls of the instruction.
  CallContext Context(const Placement& p, int64_t execution = 0) const;

  // Whether a group moves data by direct peer access (peers.h) rather than NCCL: ppermute
  // and the MoE transport over a group of several GPUs, all in this process.
  bool UsesPeers(int group_index) const;
  // The group members' local device ordinals.
  std::vector<int> LocalDevices(int group_index) const;

  // Initialize stage: makes sure this device's communicator (or peer access and events)
  // exists when it needs one.
  ffi::Error Initialize(int64_t ordinal);
  // Execute stage: what Initialize made for this device, and its execution number.
  DeviceSlot Lookup(int64_t ordinal);
  PeerExchange& peers() { return peers_; }

 private:
  std::string op_, call_site_, axis_;
  std::vector<std::vector<int64_t>> groups_;
  std::vector<std::pair<int64_t, int64_t>> partition_devices_;
  int64_t process_index_;
  std::chrono::milliseconds timeout_;
  OpAttrs attrs_;
  bool one_rank_nccl_;

  std::mutex mu_;
  std::map<int64_t, DeviceSlot> slots_;  // by device ordinal
  std::map<int64_t, bool> initialized_;  // by device ordinal
  PeerExchange peers_;
};

// "<what> failed at <file>:<line>: <why>", prefixed with the call's context.
std::string Where(const CallContext& ctx, const char* what, const char* file, int line);

}  // namespace jaxcomm::cuda

// Returns an ffi::Error carrying the call's context and the C++ call site when a CUDA
// runtime call fails. `ctx` is a CallContext in scope.
#define JAXCOMM_CUDA_CHECK(ctx, expr)                                                      \
  do {                                                                                     \
    const cudaError_t jaxcomm_err_ = (expr);                                               \
    if (jaxcomm_err_ != cudaSuccess) {                                                     \
      return ::xla::ffi::Error::Internal(::jaxcomm::cuda::Where(ctx, #expr, __FILE__, __LINE__) + \
                                         cudaGetErrorString(jaxcomm_err_));                \
    }                                                                                      \
  } while (0)

// The same for NCCL calls on communicator `comm` (a Communicator&).
#define JAXCOMM_NCCL_CHECK(ctx, comm, expr)                                                \
  do {                                                                                     \
    const ::jaxcomm::cuda::ncclResult_t jaxcomm_res_ = (expr);                             \
    if (jaxcomm_res_ != ::jaxcomm::cuda::ncclSuccess) {                                    \
      return ::xla::ffi::Error::Internal(::jaxcomm::cuda::Where(ctx, #expr, __FILE__, __LINE__) + \
                                         (comm).api().Describe(jaxcomm_res_, (comm).get())); \
    }                                                                                      \
  } while (0)
