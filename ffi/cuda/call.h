// One device's view of one call of a CUDA handler, and what the op implementations share
// (nccl_ops.cc: the NCCL route; peer_ops.cc: the peer routes; handlers.cc: dispatch).
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cuda/kernel_logic.h"
#include "cuda/kernels.h"
#include "cuda/peers.h"
#include "cuda/state.h"
#include "cuda/xla_context.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {

namespace ffi = xla::ffi;

struct Call {
  CudaState* st = nullptr;
  cudaStream_t stream = nullptr;
  int device = 0;
  int64_t run_id = 0;
  DeviceScratch* scratch = nullptr;  // the call's scratch memory (xla_context.h)
  Placement where;
  CallContext ctx;
  DeviceSlot slot;
  int size = 0;  // ranks in the group
  Route route() const { return slot.info->route; }
  const OpAttrs& attrs() const { return st->attrs(); }
  Clock::time_point deadline() const { return Clock::now() + st->timeout(); }
};

// Locates this device's rank and takes what the initialize stage made for it.
ffi::Error Begin(CudaState* st, XlaContext& xla, Call* c);
// Fails this rank's call at validation, `why` prefixed with the call's context.
ffi::Error Reject(const Call& c, const std::string& why);

size_t ItemBytes(const ffi::AnyBuffer& b);
// The kernels' element type for `t` and how many of them one element is (complex: 2).
bool ElemOf(ffi::DataType t, Elem* e, int* per);

// A copy on the stream; nothing when XLA aliased the buffers or there is nothing to copy.
ffi::Error CopyOnStream(const Call& c, void* dst, const void* src, size_t bytes);
// A strided copy between `dst` and `src` (the copy's offsets are relative to them), split
// where a pitch exceeds the device's maximum (logic::PlanCopy).
ffi::Error CopyPlanned(const Call& c, char* dst, const char* src, const logic::Copy2D& copy);
// `bytes` of the call's scratch memory (kScratchAlignment); the error names XLA's reason.
ffi::ErrorOr<char*> Scratch(const Call& c, size_t bytes);

// The operand's layout split R ways along `axis` (logic::SplitAlong).
logic::Split SplitOf(const ffi::AnyBuffer& b, int64_t axis, size_t R);

// ------------------------------------------------------------------- the NCCL route

ffi::Error NcclAllReduce(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y);
ffi::Error NcclAllGather(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y);
ffi::Error NcclReduceScatter(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y);
ffi::Error NcclAllToAll(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y);
ffi::Error NcclPermute(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y);
ffi::Error NcclBroadcast(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y);

// ------------------------------------------------------------------- the peer routes

ffi::Error PeerAllReduce(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y);
ffi::Error PeerAllGather(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y);
ffi::Error PeerReduceScatter(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y);
ffi::Error PeerAllToAll(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y);
ffi::Error PeerPermute(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y);
// ppermute's movement on the peer routes (or one rank's own buffers, with `split` only).
// With `split`, the send half of a put (jaxcomm.tp.put_start): the copies run on that
// stream (split.h) and put_done (MoeReceive) finds them by y's address.
ffi::Error PermuteOnPeers(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y,
                          cudaStream_t split = nullptr);
ffi::Error PeerBroadcast(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y);
// The MoE transport on any route but NCCL (one rank: its own buffers). With `split`, the
// send half of a split-phase call: the movement runs on that stream (split.h) and the
// receive half finds it by the result's address.
ffi::Error MoeTransportOnPeers(const Call& c, const ffi::AnyBuffer& src,
                        const ffi::AnyBuffer& dest, const ffi::AnyBuffer& pos, const ffi::AnyBuffer& w,
                        const ffi::AnyBuffer& g, ffi::AnyBuffer& result, cudaStream_t split = nullptr);
// The receive half: XLA's stream waits for the send of `data` (aliased to `data_out`).
ffi::Error MoeReceive(const Call& c, const ffi::AnyBuffer& data, const ffi::AnyBuffer& data_out);

}  // namespace jaxcomm::cuda
