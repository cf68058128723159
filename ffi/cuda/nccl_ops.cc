// The NCCL route (routes.h): groups of several GPUs, on XLA's stream. NCCL moves whole
// rank-major blocks; where an op splits or gathers along an inner dimension, strided
// copies reorder the blocks before or after (logic::BlockCopy).
#include <cuda_runtime_api.h>

#include "cuda/call.h"

namespace jaxcomm::cuda {
namespace {

// NCCL's type for a reduction over `dtype`, and how many NCCL elements one element is
// (complex sums are sums of their float parts). false: NCCL cannot reduce it.
bool NcclReduceType(ffi::DataType dtype, logic::ReduceOp op, ncclDataType_t* type, int* per) {
  *per = 1;
  const bool sum = op == logic::ReduceOp::kSum;
  switch (dtype) {
    case ffi::DataType::PRED: *type = ncclUint8; return !sum;  // bool sums arrive as int32
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
    case ffi::DataType::C64: *type = ncclFloat32; *per = 2; return sum;
    case ffi::DataType::C128: *type = ncclFloat64; *per = 2; return sum;
    default: return false;
  }
}

// NcclReduceType for the call's operand and reduction, or the call's rejection.
ffi::Error ReduceType(const Call& c, const ffi::AnyBuffer& x, ncclDataType_t* type, int* per) {
  return NcclReduceType(x.element_type(), c.attrs().reduce_op, type, per)
             ? ffi::Error::Success()
             : Reject(c, "NCCL cannot apply this reduction to this dtype");
}

ncclRedOp_t NcclOp(logic::ReduceOp op) {
  switch (op) {
    case logic::ReduceOp::kSum: return ncclSum;
    case logic::ReduceOp::kProd: return ncclProd;
    case logic::ReduceOp::kMin: return ncclMin;
    case logic::ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;  // unreachable: codes are checked at instantiation (attrs.cc)
}

}  // namespace

ffi::Error NcclAllReduce(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y) {
  ncclDataType_t type;
  int per;
  JAXCOMM_TRY(ReduceType(c, x, &type, &per));
  const void* in = x.untyped_data();
  void* out = y.untyped_data();
  const size_t n = x.element_count() * per;
  const ncclRedOp_t op = NcclOp(c.attrs().reduce_op);
  const auto& nccl = c.slot.comm->api();
  return c.slot.comm->Run(c.ctx, "ncclAllReduce", [&](ncclComm_t comm) {
    return nccl.AllReduce(in, out, n, type, op, comm, c.stream);
  }, c.deadline());
}

ffi::Error NcclAllGather(const Call& c, const ffi::AnyBuffer& x,
                         ffi::AnyBuffer& y) {
  const size_t R = c.size;
  // x's split along the gathered axis in one piece: R of them make a row of the result.
  const logic::Split s = SplitOf(x, c.attrs().axis_index, 1);
  const auto& nccl = c.slot.comm->api();
  char* gathered = static_cast<char*>(y.untyped_data());
  if (s.outer > 1) {
    // NCCL gathers rank-major; the result interleaves ranks inside each outer index.
    auto buf = Scratch(c, R * x.size_bytes());
    if (buf.has_error()) return buf.error();
    gathered = *buf;
  }
  const void* in = x.untyped_data();
  JAXCOMM_TRY(c.slot.comm->Run(c.ctx, "ncclAllGather", [&](ncclComm_t comm) {
    return nccl.AllGather(in, gathered, x.size_bytes(), ncclUint8, comm, c.stream);
  }, c.deadline()));
  if (s.outer == 1) return ffi::Error::Success();
  const logic::Split rows{s.outer, s.piece};  // of the result, R pieces per row
  for (size_t j = 0; j < R; ++j) {
    JAXCOMM_TRY(CopyPlanned(c, static_cast<char*>(y.untyped_data()), gathered,
                            logic::BlockCopy(rows, R, j, j * s.outer * s.piece, /*to_block=*/false)));
  }
  return ffi::Error::Success();
}

ffi::Error NcclReduceScatter(const Call& c, const ffi::AnyBuffer& x,
                             ffi::AnyBuffer& y) {
  ncclDataType_t type;
  int per;
  JAXCOMM_TRY(ReduceType(c, x, &type, &per));
  const size_t R = c.size, item = ItemBytes(x);
  const logic::Split s = SplitOf(x, c.attrs().scatter_dimension, R);
  const char* send = static_cast<const char*>(x.untyped_data());
  if (s.outer > 1) {
    // NCCL scatters rank-major blocks: gather rank d's pieces of every outer index first.
    auto buf = Scratch(c, x.size_bytes());
    if (buf.has_error()) return buf.error();
    for (size_t d = 0; d < R; ++d) {
      JAXCOMM_TRY(CopyPlanned(c, *buf, send, logic::BlockCopy(s, R, d, d * s.outer * s.piece, /*to_block=*/true)));
    }
    send = *buf;
  }
  const size_t n = s.outer * s.piece / item * per;
  const ncclRedOp_t op = NcclOp(c.attrs().reduce_op);
  const auto& nccl = c.slot.comm->api();
  void* out = y.untyped_data();
  return c.slot.comm->Run(c.ctx, "ncclReduceScatter", [&](ncclComm_t comm) {
    return nccl.ReduceScatter(send, out, n, type, op, comm, c.stream);
  }, c.deadline());
}

ffi::Error NcclAllToAll(const Call& c, const ffi::AnyBuffer& x,
                        ffi::AnyBuffer& y) {
  const size_t R = c.size;
  const size_t block = x.size_bytes() / R;  // what goes to each peer
  const logic::Split in = SplitOf(x, c.attrs().split_axis, R);
  const logic::Split out = SplitOf(y, c.attrs().concat_axis, R);
  const char* send = static_cast<const char*>(x.untyped_data());
  char* recv = static_cast<char*>(y.untyped_data());
  if (in.outer > 1) {
    auto buf = Scratch(c, x.size_bytes());
    if (buf.has_error()) return buf.error();
    for (size_t d = 0; d < R; ++d) {
      JAXCOMM_TRY(CopyPlanned(c, *buf, send, logic::BlockCopy(in, R, d, d * block, /*to_block=*/true)));
    }
    send = *buf;
  }
  if (out.outer > 1) {
    auto buf = Scratch(c, y.size_bytes());
    if (buf.has_error()) return buf.error();
    recv = *buf;
  }
  const auto& nccl = c.slot.comm->api();
  JAXCOMM_TRY(c.slot.comm->Run(c.ctx, "ncclSend/ncclRecv (all_to_all)", [&](ncclComm_t comm) {
    ncclResult_t r = nccl.GroupStart();
    for (size_t p = 0; p < R && r == ncclSuccess; ++p) {
      r = nccl.Send(send + p * block, block, ncclUint8, static_cast<int>(p), comm, c.stream);
      if (r == ncclSuccess) r = nccl.Recv(recv + p * block, block, ncclUint8, static_cast<int>(p), comm, c.stream);
    }
    const ncclResult_t end = nccl.GroupEnd();
    return r != ncclSuccess ? r : end;
  }, c.deadline()));
  if (out.outer > 1) {
    for (size_t j = 0; j < R; ++j) {
      JAXCOMM_TRY(CopyPlanned(c, static_cast<char*>(y.untyped_data()), recv,
                              logic::BlockCopy(out, R, j, j * block, /*to_block=*/false)));
    }
  }
  return ffi::Error::Success();
}

ffi::Error NcclPermute(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y) {
  const auto& src = c.attrs().sources;
  const int r = c.where.rank;
  const size_t bytes = x.size_bytes();
  if (src[r] < 0) JAXCOMM_CUDA_CHECK(c.ctx, cudaMemsetAsync(y.untyped_data(), 0, bytes, c.stream));
  const auto& nccl = c.slot.comm->api();
  return c.slot.comm->Run(c.ctx, "ncclSend/ncclRecv (ppermute)", [&](ncclComm_t comm) {
    ncclResult_t res = nccl.GroupStart();
    for (int d = 0; d < c.size && res == ncclSuccess; ++d) {
      if (src[d] == r) res = nccl.Send(x.untyped_data(), bytes, ncclUint8, d, comm, c.stream);
    }
    if (res == ncclSuccess && src[r] >= 0) {
      res = nccl.Recv(y.untyped_data(), bytes, ncclUint8, static_cast<int>(src[r]), comm, c.stream);
    }
    const ncclResult_t end = nccl.GroupEnd();
    return res != ncclSuccess ? res : end;
  }, c.deadline());
}

ffi::Error NcclBroadcast(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y) {
  const auto& nccl = c.slot.comm->api();
  const int root = static_cast<int>(c.attrs().root);
  return c.slot.comm->Run(c.ctx, "ncclBroadcast", [&](ncclComm_t comm) {
    return nccl.Broadcast(x.untyped_data(), y.untyped_data(), x.size_bytes(), ncclUint8, root, comm, c.stream);
  }, c.deadline());
}

}  // namespace jaxcomm::cuda
