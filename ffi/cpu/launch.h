// What every host handler does around its data movement: decode the attributes all
// jaxcomm custom calls carry, locate this rank in its group, and hand the op's work to
// the rendezvous (core/rendezvous.h). Handlers in handlers.cc (and any new op family's
// file) use these helpers.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/call_attrs.h"  // GroupAttrs, ParseGroupAttrs, Dims, Product
#include "core/rendezvous.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {

namespace ffi = xla::ffi;

// One rank's view of one call, from the attributes set by jaxcomm/_src/primitive.py.
struct Common {
  InstructionState* state;
  ffi::RunId run;
  int64_t ordinal;  // this device's local ordinal; the table maps it to a partition
  std::string_view op, call_site, axis;
  int64_t timeout_ms;
};

// Context and attributes every jaxcomm handler binds, in this order:
//   ctx: State<InstructionState>, RunId, DeviceOrdinal
//   attrs: call_site, axis, timeout_ms, groups, group_size, partition_devices
// Operands and results are bound by the caller in between (`bind_buffers`).
// The device ordinal, not a partition-id operand, locates the rank: XLA refuses
// PartitionId inside a shard_map that is manual over only some mesh axes.
template <typename B, typename F>
auto BindCommon(B&& b, F&& bind_buffers) {
  return BindCallAttrs(std::forward<F>(bind_buffers)(std::move(b)
                                                         .template Ctx<ffi::State<InstructionState>>()
                                                         .template Ctx<ffi::RunId>()
                                                         .template Ctx<ffi::DeviceOrdinal>()));
}

// Binds `N` operands and one result, all AnyBuffer.
template <int N, typename B>
auto BindBuffers(B&& b) {
  if constexpr (N == 0) {
    return std::move(b).template Ret<ffi::AnyBuffer>();
  } else {
    return BindBuffers<N - 1>(std::move(b).template Arg<ffi::AnyBuffer>());
  }
}

// The buffers of the one-operand collectives: x and the result.
template <typename B>
auto BindUnary(B&& b) {
  return BindBuffers<1>(std::move(b));
}

// The buffers of a split call's receive half (MoE's moe_recv, tp's put_done): the send
// half's result and status block, then the operands it keeps alive (any number); the
// result and the status block.
template <typename B>
auto BindReceiveHalf(B&& b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .RemainingArgs()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

// Locates this rank and joins the call with this rank's buffers `mine`; the future
// completes when this rank's result is written (see core/rendezvous.h).
// How a call's work may be split and whether it tolerates failed peers (see CollectiveCall).
struct LaunchOptions {
  bool split_by_rank = true;
  bool tolerant = false;
  // The work by element ranges (see RangeFn), for ops whose results allow it, and the
  // combining step of reductions (see CombineFn).
  RangeFn range;
  CombineFn combine;
  // Whether `combine` may reduce partial results, as hierarchical rounds do (within each
  // host, then across): not for half precision, which would then round once per phase.
  bool combine_partials = true;
  // Which operands each result reads (see NeedsFn), for ops that read only some, and
  // which element ranges of them (see ReadsFn).
  NeedsFn needs;
  ReadsFn reads;
  // Each operand is read by one rank at most (ppermute): across hosts, large calls then
  // send directly instead of in phases (see MayRunInPhases).
  bool point_to_point = false;
};
// Done at once when the round completed on this thread (core/call_result.h).
CallResult Launch(const Common& c, Peer mine, size_t work_bytes, WorkFn work, LaunchOptions options = {});

// The ReadsFn of ops whose rank d reads block d (`block` elements) of every input.
ReadsFn ReadsOwnBlock(size_t block);

// Futures for handlers that finish (or fail validation) without meeting their peers.
ffi::Future Done();
ffi::Future Failed(ffi::Error error);

// This rank's call described for messages: op, axis, group, rank, call site.
CallContext Describe(const Common& c);
// Fails this rank's call at validation, `why` prefixed with Describe(c).
ffi::Future Reject(const Common& c, const std::string& why);

// Asks the kernel to back the 2 MiB-aligned interior of a large result buffer with
// transparent huge pages. XLA allocates a fresh result buffer for every execution, and
// above glibc's mmap threshold that is fresh memory: writing it costs a page fault per
// 4 KiB (about 1.4 us each on the development VM: 6 ms for 16 MiB, against 0.6 ms for
// the copy itself). Measured with it: MoE dispatch of 1 GiB over 8 ranks 327 -> 83 ms;
// across 2 processes, 16 MiB all_gather results 4-7 ms in 3 of 5 runs -> 0.8-1.6 ms in 8
// of 8, and 4 MiB all_to_all calls that took 3.5-4.3 ms in their 2048 faults, one in
// three, ran as the others (0.5-0.7 ms). Advice only: where the kernel declines (THP
// "never", no free huge pages) nothing changes.
void AdviseHugePages(void* data, size_t bytes);

// This rank's buffers: operand `in`, result `out`, and up to four further operands.
// Advises huge pages for `out` (see AdviseHugePages) when it is written whole, as every
// op's result is but the MoE low-latency layout's (`written_whole` false: it is mostly
// rows nobody writes, and each 2 MiB page a few rows touch would be zeroed whole).
Peer Buffers(const ffi::AnyBuffer& in, ffi::AnyBuffer& out,
             std::initializer_list<const ffi::AnyBuffer*> aux = {}, bool written_whole = true);

// The ranks whose results this process writes (those of other processes have no
// `out`), dealt out to `num_parts` parts; calls f(rank) for part `part`'s share.
template <typename F>
void ForEachOwnedRank(const std::vector<Peer>& peers, int part, int num_parts, F&& f) {
  int index = 0;
  for (int r = 0; r < static_cast<int>(peers.size()); ++r) {
    if (peers[r].out == nullptr) continue;
    if (index++ % num_parts == part) f(r);
  }
}

}  // namespace jaxcomm::cpu
