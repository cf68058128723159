// The CUDA handlers (platform "CUDA"), three stages per op:
//   instantiate  binds the op's attributes, typed, checks them, and makes the CudaState
//   initialize   decides the group's route and prepares it for this device (state.h)
//   execute      enqueues the call on XLA's stream, on the route's path; never waits for
//                the device (the completion watcher does, watcher.h)
// Each op's execute dispatches by route: a copy (one rank), NCCL (nccl_ops.cc) or the
// peers' buffers in place (peer_ops.cc). The one-operand collectives share one execute
// body, their routes a table (JAXCOMM_CUDA_COLLECTIVES); the instantiate stages and the
// bindings are generated from core/op_table.h, the attributes' checks from op_attrs.h.
// What XLA gives a call (stream, device, run, scratch) comes through xla_context.h alone.
#include "cuda/handlers.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "core/call_attrs.h"
#include "core/deadline_message.h"
#include "core/env.h"
#include "core/fault_injection.h"
#include "core/moe_modes.h"
#include "core/registry.h"
#include "cuda/backend.h"
#include "cuda/call.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {

// ------------------------------------------------------------------ shared by the ops

ffi::Error Begin(CudaState* st, XlaContext& xla, Call* c) {
  const int32_t ordinal = xla.device;
  c->st = st;
  c->stream = xla.stream;
  c->device = ordinal;
  c->run_id = xla.run_id;
  c->scratch = &xla.scratch;
  c->where = st->Locate(ordinal);
  c->slot = st->Lookup(ordinal);
  c->ctx = st->Context(c->where, c->slot.execution);
  if (c->where.rank < 0) {
    return ffi::Error::Internal(c->ctx.Describe() + ": this device (ordinal " + std::to_string(ordinal) +
                                ") is in none of the instruction's replica groups");
  }
  if (c->slot.info == nullptr) {
    return ffi::Error::Internal(c->ctx.Describe() + ": the initialize stage did not run for this device");
  }
  c->size = static_cast<int>(st->group(c->where.group_index).size());
  // Injected faults (JAXCOMM_FAULT, core/fault_injection.h) where the host backend applies
  // them (cpu/launch.cc): before the call's flight recorder entry and before it meets its
  // peers. A delayed rank joins late; a hung one never does (its handler returns the
  // fault's error one second after its peers' deadline: a CUDA handler returns no future).
  Registry& registry = Registry::Get();
  if (registry.faults().any()) {
    if (auto hung = registry.faults().ApplyBlocking(c->ctx, registry.process_index(), st->timeout())) {
      return std::move(*hung);
    }
  }
  return ffi::Error::Success();
}

ffi::Error Reject(const Call& c, const std::string& why) {
  return ffi::Error::InvalidArgument(c.ctx.Describe() + ": " + why);
}

size_t ItemBytes(const ffi::AnyBuffer& b) {
  return b.element_count() ? b.size_bytes() / b.element_count() : 0;
}

bool ElemOf(ffi::DataType t, Elem* e, int* per) {
  *per = 1;
  switch (t) {
    case ffi::DataType::F32: *e = Elem::kF32; return true;
    case ffi::DataType::F64: *e = Elem::kF64; return true;
    case ffi::DataType::F16: *e = Elem::kF16; return true;
    case ffi::DataType::BF16: *e = Elem::kBF16; return true;
    case ffi::DataType::S8: *e = Elem::kS8; return true;
    case ffi::DataType::S16: *e = Elem::kS16; return true;
    case ffi::DataType::S32: *e = Elem::kS32; return true;
    case ffi::DataType::S64: *e = Elem::kS64; return true;
    case ffi::DataType::U8: *e = Elem::kU8; return true;
    case ffi::DataType::U16: *e = Elem::kU16; return true;
    case ffi::DataType::U32: *e = Elem::kU32; return true;
    case ffi::DataType::U64: *e = Elem::kU64; return true;
    case ffi::DataType::C64: *e = Elem::kF32; *per = 2; return true;
    case ffi::DataType::C128: *e = Elem::kF64; *per = 2; return true;
    default: return false;
  }
}

ffi::Error CopyOnStream(const Call& c, void* dst, const void* src, size_t bytes) {
  if (dst == src || bytes == 0) return ffi::Error::Success();
  JAXCOMM_CUDA_CHECK(c.ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c.stream));
  return ffi::Error::Success();
}

ffi::Error CopyPlanned(const Call& c, char* dst, const char* src, const logic::Copy2D& copy) {
  cudaError_t err = cudaSuccess;
  logic::PlanCopy(copy, c.slot.max_pitch, [&](const logic::Copy2D& p) {
    if (err != cudaSuccess) return;
    err = p.height == 1 ? cudaMemcpyAsync(dst + p.dst, src + p.src, p.width, cudaMemcpyDefault, c.stream)
                        : cudaMemcpy2DAsync(dst + p.dst, p.dpitch, src + p.src, p.spitch, p.width,
                                            p.height, cudaMemcpyDefault, c.stream);
  });
  JAXCOMM_CUDA_CHECK(c.ctx, err);
  return ffi::Error::Success();
}

ffi::ErrorOr<char*> Scratch(const Call& c, size_t bytes) {
  std::string why;
  void* p = c.scratch->Allocate(bytes, &why);
  if (p == nullptr) {
    return ffi::Unexpected(ffi::Error::Internal(c.ctx.Describe() + ": cannot allocate " + std::to_string(bytes) +
                                                " bytes of scratch: " + why));
  }
  return static_cast<char*>(p);
}

logic::Split SplitOf(const ffi::AnyBuffer& b, int64_t axis, size_t R) {
  const auto dims = Dims(b);
  return logic::SplitAlong(dims.data(), dims.size(), static_cast<size_t>(axis), R, ItemBytes(b));
}

namespace {

// Enqueues `f` as this rank's part of the call, watched (flight recorder, NCCL deadline);
// nothing for an empty operand.
template <typename F>
ffi::Error Watched(Call& c, const ffi::AnyBuffer& x, F&& f) {
  if (x.element_count() == 0 && c.st->op().rfind("moe_", 0) != 0) return ffi::Error::Success();
  CompletionWatcher& watcher = Backend::Get().watcher();
  Watch w = watcher.Begin(c.slot.info, c.slot.comm, c.device, c.where.rank, c.where.partition,
                          c.slot.execution, c.st->timeout(), c.run_id,
                          static_cast<uint8_t>(x.element_type()), static_cast<int64_t>(x.element_count()),
                          static_cast<int64_t>(x.size_bytes()), c.stream);
  // A NCCL call whose peers this process's watcher already aborted at its deadline: this
  // rank came too late (a rank later than the deadline), in the host backend's words. Its
  // NCCL call would wait for peers that gave up.
  ffi::Error e = c.slot.comm != nullptr && watcher.TimedOut(c.slot.info.get(), c.slot.execution)
                     ? ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                  c.ctx.Describe() + ": " + std::string(kArrivedTooLate))
                     : f();
  if (e.failure()) {
    // Recorded as the host backend records its rounds' errors: without the call's
    // description, which the entry holds. Deadlines (a peer never came, or this rank came
    // too late) dump, as on the host.
    std::string recorded = e.message();
    if (const std::string prefix = c.ctx.Describe() + ": "; recorded.rfind(prefix, 0) == 0) {
      recorded.erase(0, prefix.size());
    }
    const auto code = e.errc();
    watcher.Abandon(std::move(w), recorded,
                    code == ffi::ErrorCode::kDeadlineExceeded || code == ffi::ErrorCode::kFailedPrecondition);
    return e;
  }
  c.slot.info->enqueued[c.where.rank].store(c.slot.execution, std::memory_order_relaxed);
  [[maybe_unused]] const std::shared_ptr<std::atomic<bool>> finished = w.finished;
  watcher.End(std::move(w), c.stream);
#ifdef JAXCOMM_CUDA_EMULATION
  // XLA:CPU reads a call's results as soon as its handler returns (the emulation's seam
  // drains the stream then, cuda_emu/seam/xla_context_emu.cc), so here the call's own
  // outcome is known before the handler returns: a NCCL call that the watcher aborted
  // (at its deadline: a rank never came; or at NCCL's error) fails with the watcher's
  // error, as the host backend's call would. On a GPU the handler returned long before
  // the deadline; the program learns of it at the communicator's next call ("was aborted
  // earlier: ..."), from the log and from the flight recorder's dump.
  if (c.slot.comm != nullptr) {
    cudaStreamSynchronize(c.stream);
    // The watcher's verdict on the call: it polls every 100 us.
    const auto until = Clock::now() + c.st->timeout();
    while (finished && !finished->load(std::memory_order_acquire) && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (std::string failure = c.slot.comm->failure(); !failure.empty()) {
      const bool deadline = watcher.TimedOut(c.slot.info.get(), c.slot.execution);
      return ffi::Error(deadline ? ffi::ErrorCode::kDeadlineExceeded : ffi::ErrorCode::kInternal, failure);
    }
  }
#endif
  return e;
}

// The send half of a split call (split.h): `status`, the receive half's second operand,
// zeroed (nothing reads it on this backend); the movement `move(stream)` on jaxcomm's
// stream, where the watcher follows it.
template <typename F>
ffi::Error SendHalf(Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& status, F&& move) {
  JAXCOMM_CUDA_CHECK(c.ctx, cudaMemsetAsync(status.untyped_data(), 0, status.size_bytes(), c.stream));
  auto side = Backend::Get().splits().Stream(c.device, c.ctx);
  if (side.has_error()) return side.error();
  Call on_side = c;
  on_side.stream = *side;
  return Watched(on_side, x, [&] { return move(*side); });
}

#define JAXCOMM_BEGIN(c) \
  Call c;                \
  JAXCOMM_TRY(Begin(st, xla, &c))

// --------------------------------------------------------------------------- execute

// How a one-operand collective moves data on each route.
using RouteFn = ffi::Error (*)(const Call&, const ffi::AnyBuffer&, ffi::AnyBuffer&);
struct CollectiveRoutes {
  RouteFn copy, nccl, peers;
};

ffi::Error RunCollective(const CollectiveRoutes& routes, XlaContext& xla, CudaState* st, const ffi::AnyBuffer& x,
                         ffi::AnyBuffer& y) {
  JAXCOMM_BEGIN(c);
  return Watched(c, x, [&]() -> ffi::Error {
    switch (c.route()) {
      case Route::kCopy: return routes.copy(c, x, y);
      case Route::kNccl: return routes.nccl(c, x, y);
      default: return routes.peers(c, x, y);
    }
  });
}

// One rank: its result is its operand.
ffi::Error CopyWhole(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y) {
  return CopyOnStream(c, y.untyped_data(), x.untyped_data(), x.size_bytes());
}

// One rank of a ppermute: its operand if it is its own source, else zeros.
ffi::Error CopyOrZero(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y) {
  if (c.attrs().sources[0] == 0) return CopyWhole(c, x, y);
  JAXCOMM_CUDA_CHECK(c.ctx, cudaMemsetAsync(y.untyped_data(), 0, x.size_bytes(), c.stream));
  return ffi::Error::Success();
}

// The one-operand collectives, X(Handler, copy route, NCCL route, peer routes).
#define JAXCOMM_CUDA_COLLECTIVES(X)                               \
  X(AllReduce, CopyWhole, NcclAllReduce, PeerAllReduce)           \
  X(AllGather, CopyWhole, NcclAllGather, PeerAllGather)           \
  X(ReduceScatter, CopyWhole, NcclReduceScatter, PeerReduceScatter) \
  X(AllToAll, CopyWhole, NcclAllToAll, PeerAllToAll)              \
  X(Permute, CopyOrZero, NcclPermute, PeerPermute)                \
  X(Broadcast, CopyWhole, NcclBroadcast, PeerBroadcast)

#define JAXCOMM_CUDA_COLLECTIVE_(Handler, copy, nccl, peers)                                    \
  ffi::Error Handler(XlaContext xla, CudaState* st, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) { \
    return RunCollective(CollectiveRoutes{copy, nccl, peers}, xla, st, x, *y);                  \
  }
JAXCOMM_CUDA_COLLECTIVES(JAXCOMM_CUDA_COLLECTIVE_)
#undef JAXCOMM_CUDA_COLLECTIVE_

int64_t Rows(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return d.size() == 0 ? 1 : d[0];
}

ffi::Error RaggedAllToAll(XlaContext xla, CudaState* st, ffi::AnyBuffer operand, ffi::AnyBuffer output, ffi::AnyBuffer input_offsets,
                          ffi::AnyBuffer send_sizes, ffi::AnyBuffer output_offsets,
                          ffi::AnyBuffer recv_sizes, ffi::Result<ffi::AnyBuffer> result) {
  JAXCOMM_BEGIN(c);
  if (c.size != 1) {
    return Reject(c, "the CUDA ragged_all_to_all serves one-rank groups; larger groups lower "
                     "to jax.lax.ragged_all_to_all");
  }
  const auto& a = st->attrs();
  const int64_t n = static_cast<int64_t>(input_offsets.element_count());
  const auto idx_type = input_offsets.element_type();
  if (idx_type != ffi::DataType::S32 && idx_type != ffi::DataType::S64) {
    return Reject(c, "offsets and sizes must be int32 or int64");
  }
  for (const ffi::AnyBuffer* b : {&send_sizes, &output_offsets, &recv_sizes}) {
    if (b->element_type() != idx_type || static_cast<int64_t>(b->element_count()) != n) {
      return Reject(c, "offsets and sizes must share one dtype and length");
    }
  }
  if (n == 0) return Reject(c, "the number of slices must be a positive multiple of the group size");
  const auto mode = static_cast<logic::RaggedMode>(a.mode);
  const bool transpose = mode == logic::RaggedMode::kTransposeOperand;
  const int64_t rows = Rows(*result);
  const int64_t expect_in = transpose ? a.dst_rows : a.src_rows;
  const int64_t expect_out = transpose ? a.src_rows : a.dst_rows;
  if ((mode != logic::RaggedMode::kZeroReceived && Rows(operand) != expect_in) || rows != expect_out ||
      Rows(output) != expect_out) {
    return Reject(c, "buffer shapes disagree with the call");
  }
  Elem elem = Elem::kU8;
  int per = 1;
  if (transpose && !ElemOf(result->element_type(), &elem, &per)) {
    return Reject(c, "the transpose needs a dtype that supports addition");
  }
  return Watched(c, operand, [&]() -> ffi::Error {
    JAXCOMM_TRY(CopyOnStream(c, result->untyped_data(), output.untyped_data(), result->size_bytes()));
    const int64_t row_bytes = rows ? static_cast<int64_t>(result->size_bytes()) / rows : 0;
    const int64_t row_elems = rows ? static_cast<int64_t>(result->element_count()) / rows * per : 0;
    JAXCOMM_CUDA_CHECK(c.ctx, LaunchRaggedOneRank(
        static_cast<int>(a.mode), operand.untyped_data(), result->untyped_data(), a.src_rows,
        a.dst_rows, row_bytes, row_elems, elem, input_offsets.untyped_data(),
        send_sizes.untyped_data(), output_offsets.untyped_data(), recv_sizes.untyped_data(), n,
        idx_type == ffi::DataType::S64 ? 8 : 4, c.stream));
    return ffi::Error::Success();
  });
}

ffi::Error MoeTransport(XlaContext xla, CudaState* st, ffi::AnyBuffer src, ffi::AnyBuffer dest, ffi::AnyBuffer pos,
               ffi::AnyBuffer w, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> result) {
  JAXCOMM_BEGIN(c);
  if (c.route() == Route::kNccl) {
    return Reject(c, "the CUDA MoE transport runs on jaxcomm's own kernels, which this group's "
                     "layout does not allow (JAXCOMM_CUDA_ONE_RANK=nccl?)");
  }
  return Watched(c, src, [&] { return MoeTransportOnPeers(c, src, dest, pos, w, g, *result); });
}

// The send half of a split transport (split.h, SendHalf).
ffi::Error MoeTransportSend(XlaContext xla, CudaState* st, ffi::AnyBuffer src, ffi::AnyBuffer dest, ffi::AnyBuffer pos,
                   ffi::AnyBuffer w, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> result,
                   ffi::Result<ffi::AnyBuffer> status) {
  JAXCOMM_BEGIN(c);
  if (c.route() == Route::kNccl) {
    return Reject(c, "the CUDA MoE transport runs on jaxcomm's own kernels, which this group's "
                     "layout does not allow (JAXCOMM_CUDA_ONE_RANK=nccl?)");
  }
  return SendHalf(c, src, *status, [&](cudaStream_t side) {
    return MoeTransportOnPeers(c, src, dest, pos, w, g, *result, side);
  });
}

// A one-sided put (jaxcomm.tp.put_start): ppermute's copies on jaxcomm's stream (SendHalf),
// the copy engine pulling the source's block into this rank's result; XLA's stream goes on.
ffi::Error PutStart(XlaContext xla, CudaState* st, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> data,
                    ffi::Result<ffi::AnyBuffer> status) {
  JAXCOMM_BEGIN(c);
  if (c.route() == Route::kNccl) {
    return Reject(c, "the CUDA put runs on the copy engine over peers, which this group's layout does "
                     "not allow (JAXCOMM_CUDA_ONE_RANK=nccl?)");
  }
  return SendHalf(c, x, *status, [&](cudaStream_t side) { return PermuteOnPeers(c, x, *data, side); });
}

// put_done: XLA's stream waits for the put that writes `data` (split.h).
ffi::Error PutDone(XlaContext xla, CudaState* st, ffi::AnyBuffer data, ffi::AnyBuffer, ffi::RemainingArgs,
                   ffi::Result<ffi::AnyBuffer> data_out, ffi::Result<ffi::AnyBuffer>) {
  JAXCOMM_BEGIN(c);
  return MoeReceive(c, data, *data_out);
}

ffi::Error MoeRecv(XlaContext xla, CudaState* st, ffi::AnyBuffer data,
                   ffi::AnyBuffer, ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> data_out,
                   ffi::Result<ffi::AnyBuffer>) {
  JAXCOMM_BEGIN(c);
  return MoeReceive(c, data, *data_out);
}

#undef JAXCOMM_BEGIN

ffi::Error Fp8Quantize(XlaContext xla, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                       ffi::Result<ffi::AnyBuffer> scales) {
  auto xd = x.dimensions(), qd = q->dimensions(), sd = scales->dimensions();
  int per = 1;
  Elem elem = Elem::kU8;
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || !ElemOf(x.element_type(), &elem, &per) ||
      !(elem == Elem::kF32 || elem == Elem::kBF16 || elem == Elem::kF16) ||
      q->element_type() != ffi::DataType::F8E4M3FN || scales->element_type() != ffi::DataType::F32 ||
      qd[0] != xd[0] || qd[1] != xd[1] || sd[0] != xd[0] || sd[1] != Fp8Blocks(xd[1])) {
    return ffi::Error::InvalidArgument(
        "jaxcomm.moe FP8 quantize (CUDA): x must be float32, bfloat16 or float16 [T, H], q "
        "float8_e4m3fn [T, H] and scales float32 [T, ceil(H/128)]");
  }
  const cudaError_t err = LaunchFp8Quantize(elem, x.untyped_data(), xd[0], xd[1],
                                            static_cast<uint8_t*>(q->untyped_data()),
                                            static_cast<float*>(scales->untyped_data()), xla.stream);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jaxcomm.moe FP8 quantize (CUDA): ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// ----------------------------------------------------------------------- instantiate

// The attributes every jaxcomm custom call carries (jaxcomm/_src/primitive.py).
struct CommonAttrs {
  std::string_view call_site, axis;
  int64_t timeout_ms;
  ffi::Span<const int64_t> groups;
  int64_t group_size;
  ffi::Span<const int64_t> partition_devices;
};

std::string Who(std::string_view op, const CommonAttrs& a) {
  return "jaxcomm." + std::string(op) + " (CUDA) at " + std::string(a.call_site);
}

ffi::Error BadAttr(std::string_view op, const CommonAttrs& a, const std::string& why) {
  return ffi::Error::InvalidArgument(Who(op, a) + ": " + why);
}

ffi::ErrorOr<std::unique_ptr<CudaState>> MakeState(std::string_view op, const CommonAttrs& a, OpAttrs attrs) {
  auto groups = MakeGroupAttrs(a.groups, a.group_size, a.partition_devices, Who(op, a));
  if (groups.has_error()) return ffi::Unexpected(groups.error());
  if (a.timeout_ms <= 0) {
    return ffi::Unexpected(BadAttr(op, a, "timeout_ms must be positive, got " + std::to_string(a.timeout_ms)));
  }
  // JAXCOMM_CUDA_ONE_RANK=nccl: one-rank groups go through NCCL too (to test NCCL on one GPU).
  std::string env_error;
  const bool one_rank_nccl = env::Choice("JAXCOMM_CUDA_ONE_RANK", {"nccl"}, &env_error) == "nccl";
  if (!env_error.empty()) return ffi::Unexpected(BadAttr(op, a, env_error));
  return std::make_unique<CudaState>(std::string(op), std::string(a.call_site), std::string(a.axis),
                                     std::move(*groups), Registry::Get().process_index(),
                                     std::chrono::milliseconds(a.timeout_ms), std::move(attrs),
                                     one_rank_nccl, InstructionKey(a.call_site, a.axis, a.groups));
}

#define JAXCOMM_COMMON_PARAMS                                                            \
  std::string_view call_site, std::string_view axis, int64_t timeout_ms,                 \
      ffi::Span<const int64_t> groups, int64_t group_size, ffi::Span<const int64_t> partition_devices
#define JAXCOMM_COMMON_ARGS \
  CommonAttrs { call_site, axis, timeout_ms, groups, group_size, partition_devices }

// Every op's instantiate stage, Inst<Handler>(common attributes, the op's own): each own
// attribute checked and stored by its set_attr function (op_attrs.h).
#define JAXCOMM_CUDA_ATTR_PARAM_(type, name) , JAXCOMM_ATTR_TYPE_##type name
#define JAXCOMM_CUDA_ATTR_SET_(type, name)                                              \
  if (std::string why = set_attr::name(check, name, &o); !why.empty()) {                \
    return ffi::Unexpected(BadAttr(op, a, why));                                        \
  }                                                                                     \
  o.bound.push_back(AttrId::name);
#define JAXCOMM_CUDA_INST_(name, Handler, operands, results, backends)                       \
  JAXCOMM_IF_CUDA_##backends(                                                                \
      ffi::ErrorOr<std::unique_ptr<CudaState>> Inst##Handler(                                \
          JAXCOMM_COMMON_PARAMS JAXCOMM_ATTRS_##name(JAXCOMM_CUDA_ATTR_PARAM_)) {            \
        const CommonAttrs a = JAXCOMM_COMMON_ARGS;                                           \
        const std::string_view op = #name;                                                   \
        [[maybe_unused]] const AttrCheck check{op, group_size};                              \
        OpAttrs o;                                                                           \
        JAXCOMM_ATTRS_##name(JAXCOMM_CUDA_ATTR_SET_) return MakeState(op, a, std::move(o));  \
      })
JAXCOMM_OPS(JAXCOMM_CUDA_INST_)
#undef JAXCOMM_CUDA_INST_
#undef JAXCOMM_CUDA_ATTR_SET_
#undef JAXCOMM_CUDA_ATTR_PARAM_
#undef JAXCOMM_COMMON_ARGS
#undef JAXCOMM_COMMON_PARAMS

// An op's execute binding: what XLA gives the call (xla_context.h), the instruction's
// state, then its buffers as core/op_table.h counts them (a variadic op's count is a
// minimum: the rest come as RemainingArgs).
constexpr bool IsVariadic(std::string_view op) {
#define JAXCOMM_CUDA_IS_VARIADIC_(name) || op == #name
  return false JAXCOMM_VARIADIC_OPS(JAXCOMM_CUDA_IS_VARIADIC_);
#undef JAXCOMM_CUDA_IS_VARIADIC_
}

template <int Args, int Rets, bool Variadic, typename B>
auto BindBuffers(B&& b) {
  static_assert(Rets >= 1, "every op returns a buffer");  // (a Binding cannot be returned as is)
  if constexpr (Args > 0) {
    return BindBuffers<Args - 1, Rets, Variadic>(std::move(b).template Arg<ffi::AnyBuffer>());
  } else if constexpr (Variadic) {
    return BindBuffers<0, Rets, false>(std::move(b).RemainingArgs());
  } else if constexpr (Rets > 1) {
    return BindBuffers<0, Rets - 1, false>(std::move(b).template Ret<ffi::AnyBuffer>());
  } else {
    return std::move(b).template Ret<ffi::AnyBuffer>();
  }
}

ffi::Error Initialize(CudaState* st, int32_t ordinal) { return st->Initialize(ordinal); }

}  // namespace

// Every op's instantiate stage, its attributes bound from core/op_table.h.
#define JAXCOMM_CUDA_INSTANTIATE_(name, Handler, operands, results, backends) \
  JAXCOMM_IF_CUDA_##backends(XLA_FFI_DEFINE_HANDLER_SYMBOL(                   \
      jaxcomm_cuda_Inst##Handler, Inst##Handler,                            \
      BindCallAttrs(ffi::Ffi::BindInstantiate()) JAXCOMM_BIND_ATTRS(name));)
JAXCOMM_OPS(JAXCOMM_CUDA_INSTANTIATE_)
#undef JAXCOMM_CUDA_INSTANTIATE_

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_Initialize, Initialize,
                              ffi::Ffi::BindInitialize().Ctx<ffi::State<CudaState>>().Ctx<ffi::DeviceOrdinal>());

// Every op's execute stage.
#define JAXCOMM_CUDA_EXECUTE_(name, Handler, operands, results, backends)                       \
  JAXCOMM_IF_CUDA_##backends(XLA_FFI_DEFINE_HANDLER_SYMBOL(                                     \
      jaxcomm_cuda_##Handler, Handler,                                                          \
      (BindBuffers<operands, results, IsVariadic(#name)>(                                       \
          ffi::Ffi::Bind().Ctx<XlaContext>().Ctx<ffi::State<CudaState>>())));)
JAXCOMM_OPS(JAXCOMM_CUDA_EXECUTE_)
#undef JAXCOMM_CUDA_EXECUTE_

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_Fp8Quantize, Fp8Quantize,
                              ffi::Ffi::Bind()
                                  .Ctx<XlaContext>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

const LocalTarget* LocalTargets() {
#define JAXCOMM_CUDA_LOCAL_(name, Handler, operands, results, backends) \
  JAXCOMM_IF_CUDA_##backends({#name, jaxcomm_cuda_##Handler},)
  static const LocalTarget kTargets[] = {
      JAXCOMM_LOCAL_OPS(JAXCOMM_CUDA_LOCAL_)
      {nullptr, nullptr},
  };
#undef JAXCOMM_CUDA_LOCAL_
  return kTargets;
}

const Stages* AllStages() {
#define JAXCOMM_CUDA_STAGES_(name, Handler, operands, results, backends) \
  JAXCOMM_IF_CUDA_##backends({#name, jaxcomm_cuda_Inst##Handler, jaxcomm_cuda_Initialize, jaxcomm_cuda_##Handler},)
  static const Stages kStages[] = {
      JAXCOMM_OPS(JAXCOMM_CUDA_STAGES_)
      {nullptr, nullptr, nullptr, nullptr},
  };
#undef JAXCOMM_CUDA_STAGES_
  return kStages;
}

}  // namespace jaxcomm::cuda
