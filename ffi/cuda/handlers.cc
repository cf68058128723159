// The CUDA handlers (platform "CUDA"), three stages per op:
//   instantiate  binds the op's attributes, typed, checks them, and makes the CudaState
//   initialize   decides the group's route and prepares it for this device (state.h)
//   execute      enqueues the call on XLA's stream, on the route's path; never waits for
//                the device (the completion watcher does, watcher.h)
// Each op's execute dispatches by route: a copy (one rank), NCCL (nccl_ops.cc) or the
// peers' buffers in place (peer_ops.cc).
#include "cuda/handlers.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/call_attrs.h"
#include "core/env.h"
#include "core/moe_modes.h"
#include "core/registry.h"
#include "cuda/backend.h"
#include "cuda/call.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {

// ------------------------------------------------------------------ shared by the ops

ffi::Error Begin(CudaState* st, cudaStream_t stream, int32_t ordinal, ffi::RunId run, Call* c) {
  c->st = st;
  c->stream = stream;
  c->device = ordinal;
  c->run_id = run.run_id;
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

ffi::ErrorOr<char*> Scratch(const Call& c, ffi::ScratchAllocator& scratch, size_t bytes) {
  auto p = scratch.Allocate(bytes, 256);
  if (!p.has_value()) {
    return ffi::Unexpected(ffi::Error::Internal(c.ctx.Describe() + ": cannot allocate " +
                                                std::to_string(bytes) + " bytes of scratch"));
  }
  return static_cast<char*>(*p);
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
  ffi::Error e = f();
  if (e.failure()) {
    watcher.Abandon(std::move(w), e.message());
    return e;
  }
  c.slot.info->enqueued[c.where.rank].store(c.slot.execution, std::memory_order_relaxed);
  watcher.End(std::move(w), c.stream);
  return e;
}

#define JAXCOMM_BEGIN(c) \
  Call c;                \
  JAXCOMM_TRY(Begin(st, stream, ordinal, run, &c))

// --------------------------------------------------------------------------- execute

ffi::Error AllReduce(cudaStream_t stream, CudaState* st, int32_t ordinal, ffi::RunId run,
                     ffi::ScratchAllocator scratch, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  JAXCOMM_BEGIN(c);
  return Watched(c, x, [&]() -> ffi::Error {
    switch (c.route()) {
      case Route::kCopy: return CopyOnStream(c, y->untyped_data(), x.untyped_data(), x.size_bytes());
      case Route::kNccl: return NcclAllReduce(c, x, *y);
      default: return PeerAllReduce(c, scratch, x, *y);
    }
  });
}

ffi::Error AllGather(cudaStream_t stream, CudaState* st, int32_t ordinal, ffi::RunId run,
                     ffi::ScratchAllocator scratch, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  JAXCOMM_BEGIN(c);
  return Watched(c, x, [&]() -> ffi::Error {
    switch (c.route()) {
      case Route::kCopy: return CopyOnStream(c, y->untyped_data(), x.untyped_data(), x.size_bytes());
      case Route::kNccl: return NcclAllGather(c, scratch, x, *y);
      default: return PeerAllGather(c, x, *y);
    }
  });
}

ffi::Error ReduceScatter(cudaStream_t stream, CudaState* st, int32_t ordinal, ffi::RunId run,
                         ffi::ScratchAllocator scratch, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  JAXCOMM_BEGIN(c);
  return Watched(c, x, [&]() -> ffi::Error {
    switch (c.route()) {
      case Route::kCopy: return CopyOnStream(c, y->untyped_data(), x.untyped_data(), x.size_bytes());
      case Route::kNccl: return NcclReduceScatter(c, scratch, x, *y);
      default: return PeerReduceScatter(c, x, *y);
    }
  });
}

ffi::Error AllToAll(cudaStream_t stream, CudaState* st, int32_t ordinal, ffi::RunId run,
                    ffi::ScratchAllocator scratch, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  JAXCOMM_BEGIN(c);
  return Watched(c, x, [&]() -> ffi::Error {
    switch (c.route()) {
      case Route::kCopy: return CopyOnStream(c, y->untyped_data(), x.untyped_data(), x.size_bytes());
      case Route::kNccl: return NcclAllToAll(c, scratch, x, *y);
      default: return PeerAllToAll(c, scratch, x, *y);
    }
  });
}

ffi::Error Permute(cudaStream_t stream, CudaState* st, int32_t ordinal, ffi::RunId run,
                   ffi::ScratchAllocator, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  JAXCOMM_BEGIN(c);
  return Watched(c, x, [&]() -> ffi::Error {
    switch (c.route()) {
      case Route::kCopy: {
        const int64_t source = c.attrs().sources[0];
        if (source == 0) return CopyOnStream(c, y->untyped_data(), x.untyped_data(), x.size_bytes());
        JAXCOMM_CUDA_CHECK(c.ctx, cudaMemsetAsync(y->untyped_data(), 0, x.size_bytes(), c.stream));
        return ffi::Error::Success();
      }
      case Route::kNccl: return NcclPermute(c, x, *y);
      default: return PeerPermute(c, x, *y);
    }
  });
}

ffi::Error Broadcast(cudaStream_t stream, CudaState* st, int32_t ordinal, ffi::RunId run,
                     ffi::ScratchAllocator, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  JAXCOMM_BEGIN(c);
  return Watched(c, x, [&]() -> ffi::Error {
    switch (c.route()) {
      case Route::kCopy: return CopyOnStream(c, y->untyped_data(), x.untyped_data(), x.size_bytes());
      case Route::kNccl: return NcclBroadcast(c, x, *y);
      default: return PeerBroadcast(c, x, *y);
    }
  });
}

int64_t Rows(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return d.size() == 0 ? 1 : d[0];
}

ffi::Error RaggedAllToAll(cudaStream_t stream, CudaState* st, int32_t ordinal, ffi::RunId run,
                          ffi::AnyBuffer operand, ffi::AnyBuffer output, ffi::AnyBuffer input_offsets,
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

ffi::Error Moe(cudaStream_t stream, CudaState* st, int32_t ordinal, ffi::RunId run,
               ffi::ScratchAllocator scratch, ffi::AnyBuffer src, ffi::AnyBuffer dest, ffi::AnyBuffer pos,
               ffi::AnyBuffer w, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> result) {
  JAXCOMM_BEGIN(c);
  if (c.route() == Route::kNccl) {
    return Reject(c, "the CUDA MoE transport runs on jaxcomm's own kernels, which this group's "
                     "layout does not allow (JAXCOMM_CUDA_ONE_RANK=nccl?)");
  }
  return Watched(c, src, [&] { return MoeTransport(c, scratch, src, dest, pos, w, g, *result); });
}

// The send half of a split transport (split.h): the movement runs on jaxcomm's stream, and
// the watcher follows it there. `status` is the receive half's second operand; nothing
// reads it on this backend, so it is zeroed.
ffi::Error MoeSend(cudaStream_t stream, CudaState* st, int32_t ordinal, ffi::RunId run,
                   ffi::ScratchAllocator scratch, ffi::AnyBuffer src, ffi::AnyBuffer dest, ffi::AnyBuffer pos,
                   ffi::AnyBuffer w, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> result,
                   ffi::Result<ffi::AnyBuffer> status) {
  JAXCOMM_BEGIN(c);
  if (c.route() == Route::kNccl) {
    return Reject(c, "the CUDA MoE transport runs on jaxcomm's own kernels, which this group's "
                     "layout does not allow (JAXCOMM_CUDA_ONE_RANK=nccl?)");
  }
  JAXCOMM_CUDA_CHECK(c.ctx, cudaMemsetAsync(status->untyped_data(), 0, status->size_bytes(), c.stream));
  auto side = Backend::Get().splits().Stream(c.device, c.ctx);
  if (side.has_error()) return side.error();
  Call on_side = c;
  on_side.stream = *side;
  return Watched(on_side, src, [&] { return MoeTransport(c, scratch, src, dest, pos, w, g, *result, *side); });
}

ffi::Error MoeRecv(cudaStream_t stream, CudaState* st, int32_t ordinal, ffi::RunId run, ffi::AnyBuffer data,
                   ffi::AnyBuffer, ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> data_out,
                   ffi::Result<ffi::AnyBuffer>) {
  JAXCOMM_BEGIN(c);
  return MoeReceive(c, data, *data_out);
}

#undef JAXCOMM_BEGIN

ffi::Error Fp8Quantize(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
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
                                            static_cast<float*>(scales->untyped_data()), stream);
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

ffi::ErrorOr<logic::ReduceOp> ReduceCode(std::string_view op, const CommonAttrs& a, int64_t code) {
  if (std::string why = CheckReduceOp(code); !why.empty()) return ffi::Unexpected(BadAttr(op, a, why));
  return static_cast<logic::ReduceOp>(code);
}

ffi::Error NonNegative(std::string_view op, const CommonAttrs& a, const char* name, int64_t v) {
  return v >= 0 ? ffi::Error::Success()
                : BadAttr(op, a, std::string(name) + " must be non-negative, got " + std::to_string(v));
}

#define JAXCOMM_COMMON_PARAMS                                                            \
  std::string_view call_site, std::string_view axis, int64_t timeout_ms,                 \
      ffi::Span<const int64_t> groups, int64_t group_size, ffi::Span<const int64_t> partition_devices
#define JAXCOMM_COMMON_ARGS \
  CommonAttrs { call_site, axis, timeout_ms, groups, group_size, partition_devices }
#define JAXCOMM_ATTR_TRY(expr)                                  \
  do {                                                          \
    ::xla::ffi::Error jaxcomm_e_ = (expr);                      \
    if (jaxcomm_e_.failure()) return ffi::Unexpected(jaxcomm_e_); \
  } while (0)

ffi::ErrorOr<std::unique_ptr<CudaState>> InstAllReduce(JAXCOMM_COMMON_PARAMS, int64_t reduce_op) {
  const CommonAttrs a = JAXCOMM_COMMON_ARGS;
  auto code = ReduceCode("all_reduce", a, reduce_op);
  if (code.has_error()) return ffi::Unexpected(code.error());
  OpAttrs o;
  o.reduce_op = *code;
  return MakeState("all_reduce", a, std::move(o));
}

ffi::ErrorOr<std::unique_ptr<CudaState>> InstAllGather(JAXCOMM_COMMON_PARAMS, int64_t axis_index) {
  const CommonAttrs a = JAXCOMM_COMMON_ARGS;
  JAXCOMM_ATTR_TRY(NonNegative("all_gather", a, "axis_index", axis_index));
  OpAttrs o;
  o.axis_index = axis_index;
  return MakeState("all_gather", a, std::move(o));
}

ffi::ErrorOr<std::unique_ptr<CudaState>> InstReduceScatter(JAXCOMM_COMMON_PARAMS, int64_t reduce_op,
                                                           int64_t scatter_dimension) {
  const CommonAttrs a = JAXCOMM_COMMON_ARGS;
  auto code = ReduceCode("reduce_scatter", a, reduce_op);
  if (code.has_error()) return ffi::Unexpected(code.error());
  JAXCOMM_ATTR_TRY(NonNegative("reduce_scatter", a, "scatter_dimension", scatter_dimension));
  OpAttrs o;
  o.reduce_op = *code;
  o.scatter_dimension = scatter_dimension;
  return MakeState("reduce_scatter", a, std::move(o));
}

ffi::ErrorOr<std::unique_ptr<CudaState>> InstAllToAll(JAXCOMM_COMMON_PARAMS, int64_t split_axis,
                                                      int64_t concat_axis) {
  const CommonAttrs a = JAXCOMM_COMMON_ARGS;
  JAXCOMM_ATTR_TRY(NonNegative("all_to_all", a, "split_axis", split_axis));
  JAXCOMM_ATTR_TRY(NonNegative("all_to_all", a, "concat_axis", concat_axis));
  OpAttrs o;
  o.split_axis = split_axis;
  o.concat_axis = concat_axis;
  return MakeState("all_to_all", a, std::move(o));
}

ffi::ErrorOr<std::unique_ptr<CudaState>> InstPermute(JAXCOMM_COMMON_PARAMS, ffi::Span<const int64_t> sources) {
  const CommonAttrs a = JAXCOMM_COMMON_ARGS;
  if (static_cast<int64_t>(sources.size()) != group_size) {
    return ffi::Unexpected(BadAttr("ppermute", a, "sources has " + std::to_string(sources.size()) +
                                                      " entries for a group of " + std::to_string(group_size)));
  }
  for (int64_t s : sources) {
    if (s < -1 || s >= group_size) {
      return ffi::Unexpected(BadAttr("ppermute", a, "source rank " + std::to_string(s) + " is outside the group"));
    }
  }
  OpAttrs o;
  o.sources.assign(sources.begin(), sources.end());
  return MakeState("ppermute", a, std::move(o));
}

ffi::ErrorOr<std::unique_ptr<CudaState>> InstBroadcast(JAXCOMM_COMMON_PARAMS, int64_t root) {
  const CommonAttrs a = JAXCOMM_COMMON_ARGS;
  if (root < 0 || root >= group_size) {
    return ffi::Unexpected(BadAttr("broadcast", a, "root " + std::to_string(root) + " is outside the group"));
  }
  OpAttrs o;
  o.root = root;
  return MakeState("broadcast", a, std::move(o));
}

ffi::ErrorOr<std::unique_ptr<CudaState>> InstRaggedAllToAll(JAXCOMM_COMMON_PARAMS, int64_t mode, int64_t src_rows,
                                                            int64_t dst_rows) {
  const CommonAttrs a = JAXCOMM_COMMON_ARGS;
  if (std::string why = CheckRaggedMode(mode); !why.empty()) {
    return ffi::Unexpected(BadAttr("ragged_all_to_all", a, why));
  }
  JAXCOMM_ATTR_TRY(NonNegative("ragged_all_to_all", a, "src_rows", src_rows));
  JAXCOMM_ATTR_TRY(NonNegative("ragged_all_to_all", a, "dst_rows", dst_rows));
  OpAttrs o;
  o.mode = mode;
  o.src_rows = src_rows;
  o.dst_rows = dst_rows;
  return MakeState("ragged_all_to_all", a, std::move(o));
}

ffi::ErrorOr<std::unique_ptr<CudaState>> InstMoeOp(std::string_view op, const CommonAttrs& a, int64_t mode) {
  if (std::string why = CheckMoeMode(mode); !why.empty()) {
    return ffi::Unexpected(BadAttr(op, a, why));
  }
  OpAttrs o;
  o.mode = mode;
  return MakeState(op, a, std::move(o));
}

ffi::ErrorOr<std::unique_ptr<CudaState>> InstMoeTransport(JAXCOMM_COMMON_PARAMS, int64_t mode) {
  return InstMoeOp("moe_transport", JAXCOMM_COMMON_ARGS, mode);
}

ffi::ErrorOr<std::unique_ptr<CudaState>> InstMoeTransportSend(JAXCOMM_COMMON_PARAMS, int64_t mode) {
  return InstMoeOp("moe_transport_send", JAXCOMM_COMMON_ARGS, mode);
}

ffi::ErrorOr<std::unique_ptr<CudaState>> InstMoeRecv(JAXCOMM_COMMON_PARAMS) {
  return MakeState("moe_recv", JAXCOMM_COMMON_ARGS, OpAttrs{});
}

#undef JAXCOMM_ATTR_TRY
#undef JAXCOMM_COMMON_ARGS
#undef JAXCOMM_COMMON_PARAMS

// The execute stage's context: stream, state, device, run, (scratch).
template <typename B>
auto Exec(B&& b) {
  return std::move(b)
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::State<CudaState>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Ctx<ffi::RunId>();
}

template <int N, typename B>
auto Buffers(B&& b) {
  if constexpr (N == 0) {
    return std::move(b).template Ret<ffi::AnyBuffer>();
  } else {
    return Buffers<N - 1>(std::move(b).template Arg<ffi::AnyBuffer>());
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_AllReduce, AllReduce,
                              Buffers<1>(Exec(ffi::Ffi::Bind()).Ctx<ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_AllGather, AllGather,
                              Buffers<1>(Exec(ffi::Ffi::Bind()).Ctx<ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_ReduceScatter, ReduceScatter,
                              Buffers<1>(Exec(ffi::Ffi::Bind()).Ctx<ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_AllToAll, AllToAll,
                              Buffers<1>(Exec(ffi::Ffi::Bind()).Ctx<ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_Permute, Permute,
                              Buffers<1>(Exec(ffi::Ffi::Bind()).Ctx<ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_Broadcast, Broadcast,
                              Buffers<1>(Exec(ffi::Ffi::Bind()).Ctx<ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_RaggedAllToAll, RaggedAllToAll, Buffers<6>(Exec(ffi::Ffi::Bind())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_MoeTransport, Moe,
                              Buffers<5>(Exec(ffi::Ffi::Bind()).Ctx<ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_MoeTransportSend, MoeSend,
                              Buffers<5>(Exec(ffi::Ffi::Bind()).Ctx<ffi::ScratchAllocator>())
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_MoeRecv, MoeRecv,
                              Exec(ffi::Ffi::Bind())
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_Fp8Quantize, Fp8Quantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
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
