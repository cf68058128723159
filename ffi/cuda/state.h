// The per-instruction state of the CUDA handlers (the FFI State of the instantiate stage,
// shared by the devices of the executable), what the initialize stage prepares for each
// device, and the error macros of the CUDA code.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/call_attrs.h"
#include "core/call_context.h"
#include "cuda/group_info.h"
#include "cuda/kernel_logic.h"
#include "cuda/nccl_comm.h"
#include "cuda/op_attrs.h"
#include "cuda/peers.h"
#include "cuda/routes.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {

namespace ffi = xla::ffi;

// Where this device sits in an instruction's groups.
struct Placement {
  int64_t partition = -1;
  int group_index = -1;
  int rank = -1;
};

// What the execute stage of one device finds ready for it.
struct DeviceSlot {
  std::shared_ptr<const GroupInfo> info;      // null until initialized
  std::shared_ptr<Communicator> comm;         // route nccl
  std::shared_ptr<PeerRendezvous> peers;      // the peer routes
  size_t max_pitch = 0;                       // the device's largest 2D-copy pitch
  int64_t execution = 0;                      // this device's calls of the instruction (from 1)
};

class CudaState {
 public:
  static ffi::TypeId id;

  CudaState(std::string op, std::string call_site, std::string axis, GroupAttrs groups,
            int64_t process_index, std::chrono::milliseconds timeout, OpAttrs attrs,
            bool one_rank_nccl, uint64_t instruction_key);

  const std::string& op() const { return op_; }
  const OpAttrs& attrs() const { return attrs_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const std::vector<int64_t>& group(int i) const { return groups_.groups[i]; }
  uint64_t instruction_key() const { return instruction_key_; }

  // This device's place, from its local ordinal (-1 fields when in no group).
  Placement Locate(int64_t ordinal) const;
  // The group's identity across processes: "process/ordinal" of each member, rank order.
  std::string GroupKey(int group_index) const;
  bool SpansProcesses(int group_index) const;
  // Context for messages.
  CallContext Context(const Placement& p, int64_t execution = 0) const;
  // A short description of the parsed attributes (the tests' attribute probe).
  std::string Summary() const;

  // Initialize stage: decides the route of this device's group (once per group) and makes
  // what it needs for this device: a communicator, peer access and events, IPC exports.
  ffi::Error Initialize(int64_t ordinal);
  // Execute stage: what Initialize made for this device, with its execution number.
  DeviceSlot Lookup(int64_t ordinal);

 private:
  // The group's shared description and route, made by its first device. Under mu_.
  ffi::ErrorOr<std::shared_ptr<GroupInfo>> Describe(int group_index);

  std::string op_, call_site_, axis_;
  GroupAttrs groups_;
  int64_t process_index_;
  std::chrono::milliseconds timeout_;
  OpAttrs attrs_;
  bool one_rank_nccl_;
  uint64_t instruction_key_;

  std::mutex mu_;
  std::map<int64_t, DeviceSlot> slots_;  // by device ordinal, once initialized
  std::map<int, std::shared_ptr<GroupInfo>> infos_;  // by group index
  std::map<int, std::shared_ptr<LocalPeers>> local_peers_;  // by group index
};

// "<what> failed at <file>:<line>: ", prefixed with the call's context.
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

// Returns the error of `expr`, if any.
#define JAXCOMM_TRY(expr)                        \
  do {                                           \
    ::xla::ffi::Error jaxcomm_e_ = (expr);       \
    if (jaxcomm_e_.failure()) return jaxcomm_e_; \
  } while (0)
