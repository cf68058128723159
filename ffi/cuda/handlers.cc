// The CUDA handlers. Groups of more than one rank run through NCCL on XLA's stream; a
// one-rank group (what runs on a single GPU) is a copy on the stream, or NCCL too with
// JAXCOMM_CUDA_ONE_RANK=nccl (to exercise the NCCL path on one GPU). Nothing here waits
// for the device: every call only enqueues work.
#include "cuda/handlers.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/registry.h"
#include "cuda/comms.h"
#include "cuda/kernels.h"
#include "cuda/nccl.h"
#include "cpu/launch.h"
#include "cpu/moe_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {
namespace {

namespace ffi = xla::ffi;

// Returns the error of `expr`, if any.
#define JAXCOMM_TRY(expr)                        \
  do {                                           \
    ffi::Error jaxcomm_e_ = (expr);              \
    if (jaxcomm_e_.failure()) return jaxcomm_e_; \
  } while (0)

// ----------------------------------------------------------------------- stage 1 and 2

template <typename T>
std::optional<T> Get(const ffi::Dictionary& d, std::string_view name) {
  if (!d.contains(name)) return std::nullopt;
  auto v = d.get<T>(name);
  if (v.has_error()) return std::nullopt;
  return *v;
}

bool OneRankNccl() {
  const char* env = std::getenv("JAXCOMM_CUDA_ONE_RANK");
  return env != nullptr && std::string_view(env) == "nccl";
}

ffi::ErrorOr<std::unique_ptr<CudaState>> MakeState(std::string_view op, ffi::Dictionary attrs) {
  auto parsed = cpu::ParseGroupAttrs(attrs, "jaxcomm." + std::string(op) + " (CUDA)");
  if (!parsed.has_value()) return ffi::Unexpected(parsed.error());
  std::vector<std::vector<int64_t>>& groups = parsed->groups;
  std::vector<std::pair<int64_t, int64_t>>& partition_devices = parsed->partition_devices;
  OpAttrs a;
  a.reduce_op = Get<int64_t>(attrs, "reduce_op").value_or(0);
  a.axis_index = Get<int64_t>(attrs, "axis_index").value_or(0);
  a.scatter_dimension = Get<int64_t>(attrs, "scatter_dimension").value_or(0);
  a.split_axis = Get<int64_t>(attrs, "split_axis").value_or(0);
  a.concat_axis = Get<int64_t>(attrs, "concat_axis").value_or(0);
  a.root = Get<int64_t>(attrs, "root").value_or(0);
  a.mode = Get<int64_t>(attrs, "mode").value_or(0);
  a.src_rows = Get<int64_t>(attrs, "src_rows").value_or(0);
  a.dst_rows = Get<int64_t>(attrs, "dst_rows").value_or(0);
  if (auto s = Get<ffi::Span<const int64_t>>(attrs, "sources")) a.sources.assign(s->begin(), s->end());
  const auto timeout = std::chrono::milliseconds(
      std::max<int64_t>(1, Get<int64_t>(attrs, "timeout_ms").value_or(300000)));
  return std::make_unique<CudaState>(
      std::string(op), std::string(Get<std::string_view>(attrs, "call_site").value_or("?")),
      std::string(Get<std::string_view>(attrs, "axis").value_or("?")), std::move(groups),
      std::move(partition_devices), Registry::Get().process_index(), timeout, std::move(a),
      OneRankNccl());
}

ffi::Error Initialize(CudaState* st, int32_t ordinal, ffi::Dictionary) {
  return st->Initialize(ordinal);
}

// ------------------------------------------------------------------------ execute stage

// One device's view of one call.
struct Call {
  CudaState* st;
  cudaStream_t stream;
  Placement where;
  CallContext ctx;
  std::shared_ptr<Communicator> comm;   // null: one-rank copies or the peer path
  std::shared_ptr<DeviceEvents> events; // set: the group takes the peer path (peers.h)
  int size = 0;
};

ffi::Error Begin(CudaState* st, cudaStream_t stream, int32_t ordinal, Call* c) {
  c->st = st;
  c->stream = stream;
  c->where = st->Locate(ordinal);
  DeviceSlot slot = st->Lookup(ordinal);
  c->comm = std::move(slot.comm);
  c->events = std::move(slot.events);
  c->ctx = st->Context(c->where, slot.execution);
  if (c->where.rank < 0) {
    return ffi::Error::Internal(c->ctx.Describe() + ": this device (ordinal " + std::to_string(ordinal) +
                                ") is in none of the instruction's replica groups");
  }
  c->size = static_cast<int>(st->group(c->where.group_index).size());
  if (c->size > 1 && c->comm == nullptr && c->events == nullptr) {
    return ffi::Error::Internal(c->ctx.Describe() +
                                ": no NCCL communicator (the initialize stage did not run)");
  }
  return ffi::Error::Success();
}

ffi::Error Reject(const Call& c, const std::string& why) {
  return ffi::Error::InvalidArgument(c.ctx.Describe() + ": " + why);
}

// The copy that a one-rank collective reduces to; nothing when XLA aliased the buffers.
ffi::Error CopyOnStream(const Call& c, void* dst, const void* src, size_t bytes) {
  if (dst == src || bytes == 0) return ffi::Error::Success();
  JAXCOMM_CUDA_CHECK(c.ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c.stream));
  return ffi::Error::Success();
}

using cpu::Dims;     // shape helpers shared with the host backend (cpu/launch.h)
using cpu::Product;

// Begin, plus what every one-operand collective does first: nothing for an empty
// operand, a copy for a one-rank group served without NCCL. `*finished`: nothing is left.
ffi::Error BeginUnary(CudaState* st, cudaStream_t stream, int32_t ordinal, const ffi::AnyBuffer& x,
                      ffi::AnyBuffer& y, Call* c, bool* finished) {
  JAXCOMM_TRY(Begin(st, stream, ordinal, c));
  *finished = x.element_count() == 0 || (!c->comm && !c->events);
  if (x.element_count() == 0 || !*finished) return ffi::Error::Success();
  return CopyOnStream(*c, y.untyped_data(), x.untyped_data(), x.size_bytes());
}

size_t ItemBytes(const ffi::AnyBuffer& b) {
  return b.element_count() ? b.size_bytes() / b.element_count() : 0;
}

// NCCL's type for a reduction over `dtype`, and how many NCCL elements one element is
// (complex sums are sums of their float parts). false: NCCL cannot reduce it.
bool NcclReduceType(ffi::DataType dtype, int64_t reduce_op, ncclDataType_t* type, int* per) {
  *per = 1;
  switch (dtype) {
    case ffi::DataType::PRED: *type = ncclUint8; return reduce_op != 0;  // bool sums are int32
    case ffi::DataType::S8: *type = ncclInt8; return true;
    case ffi::DataType::U8: *type = ncclUint8; return true;
    case ffi::DataType::S32: *type = ncclInt32; return true;
    case ffi::DataType::U32: *type = ncclUint32; return true;
    case ffi::DataType::S64: *type = ncclInt64; return true;
    case ffi::DataType::U64: *type = ncclUint64; return true;
    case ffi::DataType::F16: *type = ncclFloat16; return true;
    case ffi::DataType::BF16: *type = ncclBfloat16; return true;
    case ffi::DataType::F32: *type = ncclFloat32; return true;
    case ffi::DataType::F64: *type = ncclFloat64; return true;
    case ffi::DataType::C64: *type = ncclFloat32; *per = 2; return reduce_op == 0;
    case ffi::DataType::C128: *type = ncclFloat64; *per = 2; return reduce_op == 0;
    default: return false;
  }
}

ncclRedOp_t NcclOp(int64_t reduce_op) {
  // jaxcomm/_src/ops/reduce.py's REDUCE_OPS: sum 0, prod 1, min 2, max 3.
  switch (reduce_op) {
    case 1: return ncclProd;
    case 2: return ncclMin;
    case 3: return ncclMax;
    default: return ncclSum;
  }
}

// Copies `height` rows of `width` bytes between pitched layouts on the stream.
ffi::Error Copy2D(const Call& c, void* dst, size_t dpitch, const void* src, size_t spitch,
                  size_t width, size_t height) {
  if (width == 0 || height == 0) return ffi::Error::Success();
  JAXCOMM_CUDA_CHECK(c.ctx, cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
                                              cudaMemcpyDeviceToDevice, c.stream));
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

// ---------------------------------------------------------------------------- all_reduce

ffi::Error AllReduce(cudaStream_t stream, CudaState* st, int32_t ordinal, ffi::AnyBuffer x,
                     ffi::Result<ffi::AnyBuffer> y, ffi::Dictionary) {
  Call c;
  bool finished = false;
  JAXCOMM_TRY(BeginUnary(st, stream, ordinal, x, *y, &c, &finished));
  if (finished) return ffi::Error::Success();
  ncclDataType_t type;
  int per;
  if (!NcclReduceType(x.element_type(), st->attrs().reduce_op, &type, &per)) {
    return Reject(c, "NCCL cannot apply this reduction to this dtype");
  }
  JAXCOMM_NCCL_CHECK(c.ctx, *c.comm,
                     c.comm->api().AllReduce(x.untyped_data(), y->untyped_data(),
                                             x.element_count() * per, type,
                                             NcclOp(st->attrs().reduce_op), c.comm->get(), stream));
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------- all_gather

ffi::Error AllGather(cudaStream_t stream, CudaState* st, int32_t ordinal,
                     ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                     ffi::Result<ffi::AnyBuffer> y, ffi::Dictionary) {
  Call c;
  bool finished = false;
  JAXCOMM_TRY(BeginUnary(st, stream, ordinal, x, *y, &c, &finished));
  if (finished) return ffi::Error::Success();
  const auto dims = Dims(x);
  const int64_t axis = st->attrs().axis_index;
  const size_t outer = Product(dims, 0, axis);
  const size_t inner = Product(dims, axis, dims.size()) * ItemBytes(x);
  const size_t R = c.size;
  const auto& nccl = c.comm->api();
  if (outer == 1) {
    JAXCOMM_NCCL_CHECK(c.ctx, *c.comm, nccl.AllGather(x.untyped_data(), y->untyped_data(),
                                                       x.size_bytes(), ncclUint8, c.comm->get(), stream));
    return ffi::Error::Success();
  }
  // NCCL gathers rank-major; the result interleaves ranks inside each outer index.
  auto buf = Scratch(c, scratch, R * x.size_bytes());
  if (buf.has_error()) return buf.error();
  JAXCOMM_NCCL_CHECK(c.ctx, *c.comm, nccl.AllGather(x.untyped_data(), *buf, x.size_bytes(),
                                                     ncclUint8, c.comm->get(), stream));
  char* out = static_cast<char*>(y->untyped_data());
  for (size_t j = 0; j < R; ++j) {
    JAXCOMM_TRY(Copy2D(c, out + j * inner, R * inner, *buf + j * outer * inner, inner, inner, outer));
  }
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------ reduce_scatter

ffi::Error ReduceScatter(cudaStream_t stream, CudaState* st, int32_t ordinal,
                         ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Dictionary) {
  Call c;
  bool finished = false;
  JAXCOMM_TRY(BeginUnary(st, stream, ordinal, x, *y, &c, &finished));
  if (finished) return ffi::Error::Success();
  ncclDataType_t type;
  int per;
  if (!NcclReduceType(x.element_type(), st->attrs().reduce_op, &type, &per)) {
    return Reject(c, "NCCL cannot apply this reduction to this dtype");
  }
  const auto dims = Dims(x);
  const size_t R = c.size, item = ItemBytes(x);
  const size_t outer = Product(dims, 0, st->attrs().scatter_dimension);
  const size_t inner = Product(dims, st->attrs().scatter_dimension, dims.size()) / R;  // elements
  const void* send = x.untyped_data();
  if (outer > 1) {
    // NCCL scatters rank-major blocks: gather rank d's pieces of every outer index first.
    auto buf = Scratch(c, scratch, x.size_bytes());
    if (buf.has_error()) return buf.error();
    const char* in = static_cast<const char*>(x.untyped_data());
    for (size_t d = 0; d < R; ++d) {
      JAXCOMM_TRY(Copy2D(c, *buf + d * outer * inner * item, inner * item, in + d * inner * item,
                         R * inner * item, inner * item, outer));
    }
    send = *buf;
  }
  JAXCOMM_NCCL_CHECK(c.ctx, *c.comm,
                     c.comm->api().ReduceScatter(send, y->untyped_data(), outer * inner * per, type,
                                                 NcclOp(st->attrs().reduce_op), c.comm->get(), stream));
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------- all_to_all

ffi::Error AllToAll(cudaStream_t stream, CudaState* st, int32_t ordinal,
                    ffi::ScratchAllocator scratch, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                    ffi::Dictionary) {
  Call c;
  bool finished = false;
  JAXCOMM_TRY(BeginUnary(st, stream, ordinal, x, *y, &c, &finished));
  if (finished) return ffi::Error::Success();
  const size_t R = c.size, item = ItemBytes(x);
  const auto in = Dims(x), out = Dims(*y);
  const int64_t s = st->attrs().split_axis, cat = st->attrs().concat_axis;
  const size_t block = x.size_bytes() / R;  // what goes to each peer
  // Block d of the input: for each outer index, the d-th piece of the split dimension.
  const size_t outer_s = Product(in, 0, s);
  const size_t piece_s = (in[s] / R) * Product(in, s + 1, in.size()) * item;
  // Block j lands at the j-th piece of the concat dimension of the output.
  const size_t outer_c = Product(out, 0, cat);
  const size_t piece_c = (out[cat] / R) * Product(out, cat + 1, out.size()) * item;
  const char* send = static_cast<const char*>(x.untyped_data());
  char* recv = static_cast<char*>(y->untyped_data());
  if (outer_s > 1) {
    auto buf = Scratch(c, scratch, x.size_bytes());
    if (buf.has_error()) return buf.error();
    for (size_t d = 0; d < R; ++d) {
      JAXCOMM_TRY(Copy2D(c, *buf + d * block, piece_s, send + d * piece_s, R * piece_s, piece_s, outer_s));
    }
    send = *buf;
  }
  if (outer_c > 1) {
    auto buf = Scratch(c, scratch, y->size_bytes());
    if (buf.has_error()) return buf.error();
    recv = *buf;
  }
  const auto& nccl = c.comm->api();
  JAXCOMM_NCCL_CHECK(c.ctx, *c.comm, nccl.GroupStart());
  for (size_t p = 0; p < R; ++p) {
    JAXCOMM_NCCL_CHECK(c.ctx, *c.comm, nccl.Send(send + p * block, block, ncclUint8, static_cast<int>(p),
                                                  c.comm->get(), stream));
    JAXCOMM_NCCL_CHECK(c.ctx, *c.comm, nccl.Recv(recv + p * block, block, ncclUint8, static_cast<int>(p),
                                                  c.comm->get(), stream));
  }
  JAXCOMM_NCCL_CHECK(c.ctx, *c.comm, nccl.GroupEnd());
  if (outer_c > 1) {
    char* dst = static_cast<char*>(y->untyped_data());
    for (size_t j = 0; j < R; ++j) {
      JAXCOMM_TRY(Copy2D(c, dst + j * piece_c, R * piece_c, recv + j * block, piece_c, piece_c, outer_c));
    }
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------- peer path

// Runs `enqueue` between the two phases of a peer exchange (peers.h): after every rank's
// buffers are published and this stream waits for the ranks in `wait_ready`, and before
// this stream waits for the `done` of the ranks in `wait_done` (those that read this
// rank's buffers). Phase 2 is joined even when `enqueue` fails, so peers never hang.
ffi::Error PeerCall(const Call& c, ffi::RunId run, const PeerInfo& mine,
                    const std::function<std::vector<int>(const std::vector<PeerInfo>&)>& wait_ready,
                    const std::function<ffi::Error(const std::vector<PeerInfo>&)>& enqueue,
                    const std::vector<int>& wait_done) {
  PeerInfo me = mine;
  me.ready = c.events->ready();
  me.done = c.events->done();
  JAXCOMM_CUDA_CHECK(c.ctx, cudaEventRecord(me.ready, c.stream));
  const int group = c.where.group_index, rank = c.where.rank;
  auto all = c.st->peers().Exchange(run.run_id, group, rank, c.size, me, c.st->timeout(), c.ctx);
  if (all.has_error()) return all.error();
  ffi::Error result = [&]() -> ffi::Error {
    for (int d : wait_ready(*all)) {
      if (d == rank) continue;
      JAXCOMM_CUDA_CHECK(c.ctx, cudaStreamWaitEvent(c.stream, (*all)[d].ready, 0));
    }
    ffi::Error e = enqueue(*all);
    if (e.failure()) return e;
    JAXCOMM_CUDA_CHECK(c.ctx, cudaEventRecord(me.done, c.stream));
    return ffi::Error::Success();
  }();
  ffi::Error finished = c.st->peers().Finish(run.run_id, group, rank, c.st->timeout(), c.ctx);
  if (result.failure()) return result;
  if (finished.failure()) return finished;
  for (int d : wait_done) {
    if (d == rank) continue;
    JAXCOMM_CUDA_CHECK(c.ctx, cudaStreamWaitEvent(c.stream, (*all)[d].done, 0));
  }
  return ffi::Error::Success();
}

std::vector<int> AllRanks(int size) {
  std::vector<int> v(size);
  for (int i = 0; i < size; ++i) v[i] = i;
  return v;
}

// ------------------------------------------------------------------------------ ppermute

ffi::Error Permute(cudaStream_t stream, CudaState* st, int32_t ordinal, ffi::RunId run,
                   ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, ffi::Dictionary) {
  Call c;
  JAXCOMM_TRY(Begin(st, stream, ordinal, &c));
  if (x.element_count() == 0) return ffi::Error::Success();
  const auto& src = st->attrs().sources;
  if (static_cast<int>(src.size()) != c.size) return Reject(c, "sources has the wrong length");
  const int r = c.where.rank;
  const size_t bytes = x.size_bytes();
  if (src[r] < 0) {
    JAXCOMM_CUDA_CHECK(c.ctx, cudaMemsetAsync(y->untyped_data(), 0, bytes, stream));
  }
  if (c.events) {
    // GPUs of this process: the receiver pulls with the copy engine (no SM), from the
    // source's buffer, once the source's stream has produced it.
    PeerInfo mine;
    mine.ptr[0] = x.untyped_data();
    std::vector<int> readers;
    for (int d = 0; d < c.size; ++d) {
      if (src[d] == r) readers.push_back(d);
    }
    return PeerCall(
        c, run, mine,
        [&](const std::vector<PeerInfo>&) {
          return src[r] >= 0 ? std::vector<int>{static_cast<int>(src[r])} : std::vector<int>{};
        },
        [&](const std::vector<PeerInfo>& all) -> ffi::Error {
          if (src[r] < 0) return ffi::Error::Success();
          JAXCOMM_CUDA_CHECK(c.ctx, cudaMemcpyAsync(y->untyped_data(), all[src[r]].ptr[0], bytes,
                                                    cudaMemcpyDefault, stream));
          return ffi::Error::Success();
        },
        readers);
  }
  if (!c.comm) {
    return src[r] == r ? CopyOnStream(c, y->untyped_data(), x.untyped_data(), bytes)
                       : ffi::Error::Success();
  }
  const auto& nccl = c.comm->api();
  JAXCOMM_NCCL_CHECK(c.ctx, *c.comm, nccl.GroupStart());
  for (int d = 0; d < c.size; ++d) {
    if (src[d] == r) {
      JAXCOMM_NCCL_CHECK(c.ctx, *c.comm, nccl.Send(x.untyped_data(), bytes, ncclUint8, d, c.comm->get(), stream));
    }
  }
  if (src[r] >= 0) {
    JAXCOMM_NCCL_CHECK(c.ctx, *c.comm, nccl.Recv(y->untyped_data(), bytes, ncclUint8,
                                                  static_cast<int>(src[r]), c.comm->get(), stream));
  }
  JAXCOMM_NCCL_CHECK(c.ctx, *c.comm, nccl.GroupEnd());
  return ffi::Error::Success();
}

// ----------------------------------------------------------------------------- broadcast

ffi::Error Broadcast(cudaStream_t stream, CudaState* st, int32_t ordinal, ffi::AnyBuffer x,
                     ffi::Result<ffi::AnyBuffer> y, ffi::Dictionary) {
  Call c;
  bool finished = false;
  JAXCOMM_TRY(BeginUnary(st, stream, ordinal, x, *y, &c, &finished));
  if (finished) return ffi::Error::Success();
  JAXCOMM_NCCL_CHECK(c.ctx, *c.comm,
                     c.comm->api().Broadcast(x.untyped_data(), y->untyped_data(), x.size_bytes(),
                                             ncclUint8, static_cast<int>(st->attrs().root),
                                             c.comm->get(), stream));
  return ffi::Error::Success();
}

// --------------------------------------------------------------------- ragged_all_to_all

int64_t Rows(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return d.size() == 0 ? 1 : d[0];
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

ffi::Error RaggedAllToAll(cudaStream_t stream, CudaState* st, int32_t ordinal,
                          ffi::AnyBuffer operand, ffi::AnyBuffer output,
                          ffi::AnyBuffer input_offsets, ffi::AnyBuffer send_sizes,
                          ffi::AnyBuffer output_offsets, ffi::AnyBuffer recv_sizes,
                          ffi::Result<ffi::AnyBuffer> result, ffi::Dictionary) {
  Call c;
  JAXCOMM_TRY(Begin(st, stream, ordinal, &c));
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
  const int64_t rows = Rows(*result);
  const int64_t expect_in = a.mode == 1 ? a.dst_rows : a.src_rows;
  const int64_t expect_out = a.mode == 1 ? a.src_rows : a.dst_rows;
  if ((a.mode != 2 && Rows(operand) != expect_in) || rows != expect_out || Rows(output) != expect_out) {
    return Reject(c, "buffer shapes disagree with the call");
  }
  Elem elem = Elem::kU8;
  int per = 1;
  if (a.mode == 1 && !ElemOf(result->element_type(), &elem, &per)) {
    return Reject(c, "the transpose needs a dtype that supports addition");
  }
  JAXCOMM_TRY(CopyOnStream(c, result->untyped_data(), output.untyped_data(), result->size_bytes()));
  const int64_t row_bytes = rows ? static_cast<int64_t>(result->size_bytes()) / rows : 0;
  const int64_t row_elems = rows ? static_cast<int64_t>(result->element_count()) / rows * per : 0;
  JAXCOMM_CUDA_CHECK(c.ctx, LaunchRaggedOneRank(
      static_cast<int>(a.mode), operand.untyped_data(), result->untyped_data(), a.src_rows,
      a.dst_rows, row_bytes, row_elems, elem, input_offsets.untyped_data(),
      send_sizes.untyped_data(), output_offsets.untyped_data(), recv_sizes.untyped_data(), n,
      idx_type == ffi::DataType::S64 ? 8 : 4, stream));
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------ moe_transport

ffi::Error MoeTransport(cudaStream_t stream, CudaState* st, int32_t ordinal, ffi::RunId run,
                        ffi::ScratchAllocator scratch, ffi::AnyBuffer src, ffi::AnyBuffer dest,
                        ffi::AnyBuffer pos, ffi::AnyBuffer w, ffi::AnyBuffer g,
                        ffi::Result<ffi::AnyBuffer> result, ffi::Dictionary) {
  Call c;
  JAXCOMM_TRY(Begin(st, stream, ordinal, &c));
  if (c.size != 1 && !c.events) {
    return Reject(c, "the CUDA MoE transport serves groups inside one process; groups spanning "
                     "processes take the composed transport");
  }
  if (c.size > kMaxPeers) return Reject(c, "more ranks than the MoE kernels address (16)");
  const int64_t mode = st->attrs().mode;
  cpu::MoeOperandShape checked;
  if (std::string why = cpu::CheckMoeOperands(mode, src, dest, pos, w, g, *result, &checked);
      !why.empty()) {
    return Reject(c, why);
  }
  MoeShape s;
  s.T = checked.T;
  s.K = checked.K;
  s.H = checked.H;
  s.rows = checked.rows;
  s.row_bytes = checked.row_bytes;
  const bool gather = checked.gather;
  if (s.K > kMaxSlots) return Reject(c, "more than 64 experts per token (top-k)");
  if (result->size_bytes() == 0) return ffi::Error::Success();
  uint8_t* written = nullptr;
  if (gather) {
    auto flags = Scratch(c, scratch, static_cast<size_t>(std::max<int64_t>(s.rows, 1)));
    if (flags.has_error()) return flags.error();
    written = reinterpret_cast<uint8_t*>(*flags);
  }
  if (s.T == 0) {
    JAXCOMM_CUDA_CHECK(c.ctx, cudaMemsetAsync(result->untyped_data(), 0, result->size_bytes(), stream));
    return ffi::Error::Success();
  }
  const int r = c.where.rank;
  s.self = r;
  // Rank r computes its own result, reading the peers' rows and slot tables in place
  // (one GPU per rank; with one rank, its own buffers).
  auto launch = [&](const std::vector<PeerInfo>& all) -> ffi::Error {
    MoePeers p;
    p.R = c.size;
    for (int d = 0; d < c.size; ++d) {
      p.src[d] = all[d].ptr[0];
      p.out[d] = const_cast<void*>(all[d].ptr[1]);
      p.dest[d] = static_cast<const int32_t*>(all[d].ptr[2]);
      p.pos[d] = static_cast<const int32_t*>(all[d].ptr[3]);
      p.w[d] = static_cast<const float*>(all[d].ptr[4]);
      p.g[d] = static_cast<const float*>(all[d].ptr[5]);
    }
    p.written[r] = written;
    if (gather) JAXCOMM_CUDA_CHECK(c.ctx, MoeZeroWritten(p, s, stream));
    JAXCOMM_CUDA_CHECK(c.ctx, LaunchMoe(static_cast<int>(mode), p, s, stream));
    return ffi::Error::Success();
  };
  PeerInfo mine;
  mine.ptr = {src.untyped_data(), result->untyped_data(), dest.untyped_data(), pos.untyped_data(),
              w.untyped_data(), g.untyped_data()};
  if (c.size == 1) return launch({mine});
  // Every rank may read every other's buffers: wait for all, and all wait for everyone.
  const std::vector<int> everyone = AllRanks(c.size);
  return PeerCall(c, run, mine, [&](const std::vector<PeerInfo>&) { return everyone; }, launch,
                  everyone);
}

// --------------------------------------------------------------------------- bindings

template <typename B>
auto Exec(B&& b) {
  return std::move(b)
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::State<CudaState>>()
      .template Ctx<ffi::DeviceOrdinal>();
}

template <int N, typename B>
auto Buffers(B&& b) {
  if constexpr (N == 0) {
    return std::move(b).template Ret<ffi::AnyBuffer>();
  } else {
    return Buffers<N - 1>(std::move(b).template Arg<ffi::AnyBuffer>());
  }
}

}  // namespace

#define JAXCOMM_CUDA_INSTANTIATE(sym, name)                                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(sym, [](ffi::Dictionary attrs) { return MakeState(name, attrs); }, \
                                ffi::Ffi::BindInstantiate().Attrs<ffi::Dictionary>());

JAXCOMM_CUDA_INSTANTIATE(jaxcomm_cuda_InstAllReduce, "all_reduce")
JAXCOMM_CUDA_INSTANTIATE(jaxcomm_cuda_InstAllGather, "all_gather")
JAXCOMM_CUDA_INSTANTIATE(jaxcomm_cuda_InstReduceScatter, "reduce_scatter")
JAXCOMM_CUDA_INSTANTIATE(jaxcomm_cuda_InstAllToAll, "all_to_all")
JAXCOMM_CUDA_INSTANTIATE(jaxcomm_cuda_InstPermute, "ppermute")
JAXCOMM_CUDA_INSTANTIATE(jaxcomm_cuda_InstBroadcast, "broadcast")
JAXCOMM_CUDA_INSTANTIATE(jaxcomm_cuda_InstRagged, "ragged_all_to_all")
JAXCOMM_CUDA_INSTANTIATE(jaxcomm_cuda_InstMoe, "moe_transport")
#undef JAXCOMM_CUDA_INSTANTIATE

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_Initialize, Initialize,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::State<CudaState>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attrs<ffi::Dictionary>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_AllReduce, AllReduce,
                              Buffers<1>(Exec(ffi::Ffi::Bind())).Attrs<ffi::Dictionary>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_AllGather, AllGather,
                              Buffers<1>(Exec(ffi::Ffi::Bind()).Ctx<ffi::ScratchAllocator>())
                                  .Attrs<ffi::Dictionary>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_ReduceScatter, ReduceScatter,
                              Buffers<1>(Exec(ffi::Ffi::Bind()).Ctx<ffi::ScratchAllocator>())
                                  .Attrs<ffi::Dictionary>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_AllToAll, AllToAll,
                              Buffers<1>(Exec(ffi::Ffi::Bind()).Ctx<ffi::ScratchAllocator>())
                                  .Attrs<ffi::Dictionary>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_Permute, Permute,
                              Buffers<1>(Exec(ffi::Ffi::Bind()).Ctx<ffi::RunId>()).Attrs<ffi::Dictionary>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_Broadcast, Broadcast,
                              Buffers<1>(Exec(ffi::Ffi::Bind())).Attrs<ffi::Dictionary>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_Ragged, RaggedAllToAll,
                              Buffers<6>(Exec(ffi::Ffi::Bind())).Attrs<ffi::Dictionary>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_Moe, MoeTransport,
                              Buffers<5>(Exec(ffi::Ffi::Bind()).Ctx<ffi::RunId>().Ctx<ffi::ScratchAllocator>())
                                  .Attrs<ffi::Dictionary>());

const Stages* AllStages() {
  // Scratch allocation happens on the execute path, so ops that may need it stay out of
  // command buffers; the others only enqueue NCCL calls or copies, which CUDA graphs record.
  static const Stages kStages[] = {
      {"all_reduce", jaxcomm_cuda_InstAllReduce, jaxcomm_cuda_Initialize, jaxcomm_cuda_AllReduce, true},
      {"all_gather", jaxcomm_cuda_InstAllGather, jaxcomm_cuda_Initialize, jaxcomm_cuda_AllGather, false},
      {"reduce_scatter", jaxcomm_cuda_InstReduceScatter, jaxcomm_cuda_Initialize, jaxcomm_cuda_ReduceScatter, false},
      {"all_to_all", jaxcomm_cuda_InstAllToAll, jaxcomm_cuda_Initialize, jaxcomm_cuda_AllToAll, false},
      // The peer path of ppermute meets its peers on the host: not recordable into a graph.
      {"ppermute", jaxcomm_cuda_InstPermute, jaxcomm_cuda_Initialize, jaxcomm_cuda_Permute, false},
      {"broadcast", jaxcomm_cuda_InstBroadcast, jaxcomm_cuda_Initialize, jaxcomm_cuda_Broadcast, true},
      {"ragged_all_to_all", jaxcomm_cuda_InstRagged, jaxcomm_cuda_Initialize, jaxcomm_cuda_Ragged, true},
      {"moe_transport", jaxcomm_cuda_InstMoe, jaxcomm_cuda_Initialize, jaxcomm_cuda_Moe, false},
      {nullptr, nullptr, nullptr, nullptr, false},
  };
  return kStages;
}

}  // namespace jaxcomm::cuda
