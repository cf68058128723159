// The mock NCCL's exported C functions: argument checks, groups, error strings. The work
// itself is in comm.cc.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda_emu/nccl/comm.h"
#include "cuda_emu/nccl/nccl_abi.h"
#include "cuda_emu/nccl/reduce.h"

// What an ncclComm_t points to: the caller's reference to the communicator (work on a
// stream holds references of its own, so it outlives destroy and abort safely).
struct ncclComm {
  std::shared_ptr<jaxcomm::nccl_mock::Comm> impl;
};

namespace jaxcomm::nccl_mock {
namespace {

// NCCL_VERSION(2, 28, 3): the NCCL the mock's behaviour follows.
constexpr int kVersion = 22803;

// NCCL keeps the last error message and the open group per thread.
thread_local std::string last_error;

struct Pending {
  std::shared_ptr<Comm> comm;
  Op op;
};
struct GroupState {
  int depth = 0;
  ncclResult_t error = ncclSuccess;  // the first failed call inside the group
  std::vector<Pending> pending;
};
thread_local GroupState group;

ncclResult_t Error(ncclResult_t r, std::string why) {
  last_error = std::move(why);
  if (group.depth > 0 && group.error == ncclSuccess) group.error = r;
  return r;
}

// Enqueues `pending`'s operations, one host function per communicator (in call order).
ncclResult_t LaunchAll(std::vector<Pending> pending, bool* nonblocking) {
  *nonblocking = false;
  std::vector<std::pair<std::shared_ptr<Comm>, std::vector<Op>>> batches;
  for (Pending& p : pending) {
    auto it = batches.begin();
    while (it != batches.end() && it->first != p.comm) ++it;
    if (it == batches.end()) it = batches.insert(batches.end(), {p.comm, {}});
    if (!it->second.empty() && it->second.front().stream != p.op.stream) {
      return Error(ncclInvalidUsage, "mock NCCL: one group gave rank " + std::to_string(p.comm->rank()) +
                                         "'s communicator operations on two streams; the mock runs a "
                                         "communicator's part of a group on one stream");
    }
    it->second.push_back(p.op);
  }
  for (auto& [comm, ops] : batches) {
    std::string why;
    const cudaStream_t stream = ops.front().stream;
    const ncclResult_t r = comm->Launch(std::move(ops), stream, &why);
    if (r != ncclSuccess) return Error(r, why);
    *nonblocking = *nonblocking || !comm->blocking();
  }
  return ncclSuccess;
}

// Checks and enqueues one call: now outside a group, at ncclGroupEnd inside one.
ncclResult_t Enqueue(ncclComm_t comm, Op op) {
  const char* name = KindName(op.kind);
  if (comm == nullptr || !comm->impl) return Error(ncclInvalidArgument, std::string(name) + ": comm is NULL");
  Comm& c = *comm->impl;
  std::string why;
  const ncclResult_t ready = c.CheckReady(&why);
  if (ready != ncclSuccess) return Error(ready, std::string(name) + ": " + why);
  const std::string where = std::string(name) + " on rank " + std::to_string(c.rank()) + " of " +
                            std::to_string(c.nranks()) + ": ";
  if (TypeBytes(op.type) == 0) return Error(ncclInvalidArgument, where + "invalid datatype " + std::to_string(op.type));
  if ((op.kind == Kind::kAllReduce || op.kind == Kind::kReduceScatter) && (op.red < 0 || op.red >= ncclNumOps)) {
    return Error(ncclInvalidArgument, where + "invalid reduction operation " + std::to_string(op.red));
  }
  if ((op.kind == Kind::kBroadcast || op.kind == Kind::kSend || op.kind == Kind::kRecv) &&
      (op.peer < 0 || op.peer >= c.nranks())) {
    return Error(ncclInvalidArgument, where + (op.kind == Kind::kBroadcast ? "root " : "peer ") +
                                          std::to_string(op.peer) + " is not a rank of the communicator");
  }
  const bool reads = op.kind != Kind::kRecv && (op.kind != Kind::kBroadcast || op.peer == c.rank());
  const bool writes = op.kind != Kind::kSend;
  if (op.count > 0 && ((reads && op.send == nullptr) || (writes && op.recv == nullptr))) {
    return Error(ncclInvalidArgument, where + "a buffer is NULL");
  }
  // NCCL returns at once from collectives of no elements; sends and receives of none still pair.
  if (op.count == 0 && op.kind != Kind::kSend && op.kind != Kind::kRecv) return ncclSuccess;
  if (group.depth > 0) {
    group.pending.push_back({comm->impl, op});
    return ncclSuccess;
  }
  bool nonblocking = false;
  return LaunchAll({{comm->impl, op}}, &nonblocking);
}

Op Make(Kind kind, const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t red, int peer,
        cudaStream_t stream) {
  Op op{kind};
  op.send = send;
  op.recv = recv;
  op.count = count;
  op.type = type;
  op.red = red;
  op.peer = peer;
  op.stream = stream;
  return op;
}

}  // namespace
}  // namespace jaxcomm::nccl_mock

using jaxcomm::nccl_mock::Comm;
using jaxcomm::nccl_mock::Enqueue;
using jaxcomm::nccl_mock::Error;
using jaxcomm::nccl_mock::Kind;
using jaxcomm::nccl_mock::Make;
namespace mock = jaxcomm::nccl_mock;

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr) return Error(ncclInvalidArgument, "ncclGetVersion: version is NULL");
  *version = mock::kVersion;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return Error(ncclInvalidArgument, "ncclGetUniqueId: id is NULL");
  mock::MakeUniqueId(id);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
  if (comm == nullptr) return Error(ncclInvalidArgument, "ncclCommInitRankConfig: comm is NULL");
  // NCCL_CONFIG_UNDEF_INT (INT_MIN) and 1 mean blocking.
  const bool blocking = config == nullptr || config->blocking != 0;
  auto handle = std::make_unique<ncclComm>(ncclComm{std::make_shared<Comm>(id, nranks, rank, blocking)});
  const ncclResult_t r = handle->impl->Init();
  if (r == ncclSuccess || r == ncclInProgress) {
    *comm = handle.release();
    return r;
  }
  Error(r, handle->impl->error_message());
  if (blocking) {
    *comm = nullptr;  // a failed blocking init leaves nothing behind
    return r;
  }
  // Non-blocking: the communicator exists and carries its error (ncclCommGetAsyncError).
  *comm = handle.release();
  return r;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  if (comm == nullptr || async_error == nullptr) {
    return Error(ncclInvalidArgument, "ncclCommGetAsyncError: comm or asyncError is NULL");
  }
  *async_error = comm->impl->AsyncError();
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (comm == nullptr) return Error(ncclInvalidArgument, "ncclCommFinalize: comm is NULL");
  std::string why;
  const ncclResult_t r = comm->impl->Finalize(&why);
  if (r != ncclSuccess && r != ncclInProgress) return Error(r, "ncclCommFinalize: " + why);
  return r;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;  // as NCCL
  std::unique_ptr<ncclComm> owned(comm);
  owned->impl->StopJoining();
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  std::unique_ptr<ncclComm> owned(comm);
  owned->impl->Abort();
  return ncclSuccess;
}

ncclResult_t ncclCommCount(ncclComm_t comm, int* count) {
  if (comm == nullptr || count == nullptr) return Error(ncclInvalidArgument, "ncclCommCount: NULL argument");
  *count = comm->impl->nranks();
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(ncclComm_t comm, int* rank) {
  if (comm == nullptr || rank == nullptr) return Error(ncclInvalidArgument, "ncclCommUserRank: NULL argument");
  *rank = comm->impl->rank();
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  // NCCL's own strings (src/misc/argcheck.cc, init.cc of 2.28).
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  // A communicator's own failure (on a stream, or while joining) comes first: it may have
  // happened on another thread than the caller's.
  if (comm != nullptr && comm->impl) {
    const char* own = comm->impl->error_message();
    if (*own != '\0') return own;
  }
  return mock::last_error.c_str();
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return Enqueue(comm, Make(Kind::kAllReduce, sendbuff, recvbuff, count, datatype, op, 0, stream));
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  return Enqueue(comm, Make(Kind::kAllGather, sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, stream));
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return Enqueue(comm, Make(Kind::kReduceScatter, sendbuff, recvbuff, recvcount, datatype, op, 0, stream));
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  return Enqueue(comm, Make(Kind::kBroadcast, sendbuff, recvbuff, count, datatype, ncclSum, root, stream));
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return Enqueue(comm, Make(Kind::kSend, sendbuff, nullptr, count, datatype, ncclSum, peer, stream));
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return Enqueue(comm, Make(Kind::kRecv, nullptr, recvbuff, count, datatype, ncclSum, peer, stream));
}

ncclResult_t ncclGroupStart() {
  ++mock::group.depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  mock::GroupState& g = mock::group;
  if (g.depth == 0) return Error(ncclInvalidUsage, "ncclGroupEnd: not in a group (no matching ncclGroupStart)");
  if (--g.depth > 0) return ncclSuccess;
  std::vector<mock::Pending> pending = std::move(g.pending);
  g.pending.clear();
  const ncclResult_t failed = std::exchange(g.error, ncclSuccess);
  if (failed != ncclSuccess) return failed;  // a call of the group failed: none of it runs
  if (pending.empty()) return ncclSuccess;
  bool nonblocking = false;
  const ncclResult_t r = mock::LaunchAll(std::move(pending), &nonblocking);
  // A non-blocking communicator's group finishes asynchronously in NCCL: the caller polls
  // ncclCommGetAsyncError (which says ncclSuccess once the work is enqueued).
  if (r == ncclSuccess && nonblocking) return ncclInProgress;
  return r;
}

}  // extern "C"
