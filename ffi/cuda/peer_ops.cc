// The peer routes (routes.h, peers.h): every rank reads the buffers of the ranks it needs
// in place, with the copy engine (no SMs) or jaxcomm's kernels, in stream order. Each op
// below says which buffers it publishes, whose `ready` it waits for, and whose reads
// (`done`) it must outlive.
#include <cuda_runtime_api.h>

#include <numeric>

#include "core/moe_operands.h"
#include "cuda/backend.h"
#include "cuda/call.h"
#include "cuda/split.h"

namespace jaxcomm::cuda {
namespace {

std::vector<int> AllRanks(int size) {
  std::vector<int> v(size);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// Where a split send (split.h) runs its reads instead of XLA's stream: `stream`, which
// first waits for this rank's `ready`; XLA's stream then waits for nothing, and `pending`
// receives what the receive half must wait for (this rank's `done`, and its readers').
struct OffStream {
  cudaStream_t stream;
  PendingSend* pending;
};

// Runs `enqueue` between the two phases of a peer exchange (peers.h): after every rank's
// buffers are published and this stream waits for the ranks in `wait_ready`, and before
// it waits for the `done` of the ranks in `wait_done` (those that read this rank's
// buffers). Phase 2 is joined even when `enqueue` fails, so peers never hang. With `off`,
// the reads go to off->stream (see OffStream).
ffi::Error PeerCall(const Call& c, const PeerInfo& mine, const std::vector<int>& wait_ready,
                    const std::function<ffi::Error(const std::vector<PeerInfo>&)>& enqueue,
                    const std::vector<int>& wait_done, const OffStream* off = nullptr) {
  PeerRendezvous& peers = *c.slot.peers;
  PeerInfo me = mine;
  me.ready = peers.ready();
  me.done = peers.done();
  JAXCOMM_CUDA_CHECK(c.ctx, cudaEventRecord(me.ready, c.stream));
  const cudaStream_t work = off != nullptr ? off->stream : c.stream;
  const int rank = c.where.rank;
  const PeerCallKey key{c.route() == Route::kLocalPeers ? c.run_id : 0, c.slot.execution, c.where.group_index};
  auto all = peers.Exchange(key, rank, c.size, me, c.st->timeout(), c.ctx);
  if (all.has_error()) return all.error();
  ffi::Error result = [&]() -> ffi::Error {
    if (off != nullptr) JAXCOMM_CUDA_CHECK(c.ctx, cudaStreamWaitEvent(work, me.ready, 0));
    for (int d : wait_ready) {
      if (d == rank) continue;
      JAXCOMM_CUDA_CHECK(c.ctx, cudaStreamWaitEvent(work, (*all)[d].ready, 0));
    }
    JAXCOMM_TRY(enqueue(*all));
    JAXCOMM_CUDA_CHECK(c.ctx, cudaEventRecord(me.done, work));
    return ffi::Error::Success();
  }();
  ffi::Error finished = peers.Finish(key, rank, c.st->timeout(), c.ctx);
  if (result.failure()) return result;
  if (finished.failure()) return finished;
  if (off != nullptr) off->pending->waits.push_back(me.done);
  for (int d : wait_done) {
    if (d == rank) continue;
    if (off != nullptr) {
      off->pending->waits.push_back((*all)[d].done);
    } else {
      JAXCOMM_CUDA_CHECK(c.ctx, cudaStreamWaitEvent(c.stream, (*all)[d].done, 0));
    }
  }
  return ffi::Error::Success();
}

// Every rank's operand (ptr[0]) as the reduction kernel's table.
PeerOperands Operands(const std::vector<PeerInfo>& all) {
  PeerOperands p;
  p.R = static_cast<int>(all.size());
  for (size_t d = 0; d < all.size(); ++d) p.src[d] = all[d].ptr[0];
  return p;
}

// The reduction kernel's element type for the call's operand and reduction, and elements
// per element; or the call's rejection.
ffi::Error PeerReduceType(const Call& c, const ffi::AnyBuffer& x, Elem* e, int* per) {
  const bool sum = c.attrs().reduce_op == logic::ReduceOp::kSum;
  bool ok;
  if (x.element_type() == ffi::DataType::PRED) {
    *e = Elem::kU8;
    *per = 1;
    ok = !sum;  // bool sums arrive as int32
  } else {
    ok = ElemOf(x.element_type(), e, per) && (*per == 1 || sum);  // complex: sums only
  }
  return ok ? ffi::Error::Success()
            : Reject(c, "jaxcomm's reduction kernel cannot apply this reduction to this dtype");
}

}  // namespace

ffi::Error PeerAllReduce(const Call& c, const ffi::AnyBuffer& x,
                         ffi::AnyBuffer& y) {
  Elem elem;
  int per;
  JAXCOMM_TRY(PeerReduceType(c, x, &elem, &per));
  const void* operand = x.untyped_data();
  if (operand == y.untyped_data()) {
    // The result reuses the operand (XLA aliased them), which the peers still read while
    // this rank writes it: publish a copy.
    auto copy = Scratch(c, x.size_bytes());
    if (copy.has_error()) return copy.error();
    JAXCOMM_TRY(CopyOnStream(c, *copy, operand, x.size_bytes()));
    operand = *copy;
  }
  PeerInfo mine;
  mine.ptr[0] = operand;
  const auto everyone = AllRanks(c.size);
  const int64_t n = static_cast<int64_t>(x.element_count()) * per;
  return PeerCall(c, mine, everyone, [&](const std::vector<PeerInfo>& all) -> ffi::Error {
    JAXCOMM_CUDA_CHECK(c.ctx, LaunchPeerReduce(c.attrs().reduce_op, elem, y.untyped_data(), Operands(all),
                                               1, n, 0, 0, c.stream));
    return ffi::Error::Success();
  }, everyone);
}

ffi::Error PeerReduceScatter(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y) {
  Elem elem;
  int per;
  JAXCOMM_TRY(PeerReduceType(c, x, &elem, &per));
  const size_t R = c.size, item = ItemBytes(x);
  const logic::Split s = SplitOf(x, c.attrs().scatter_dimension, R);
  const int64_t inner = static_cast<int64_t>(s.piece / item) * per;  // elements of one piece
  PeerInfo mine;
  mine.ptr[0] = x.untyped_data();
  const auto everyone = AllRanks(c.size);
  return PeerCall(c, mine, everyone, [&](const std::vector<PeerInfo>& all) -> ffi::Error {
    // Rank r's result: piece r of every outer row, reduced over the ranks.
    JAXCOMM_CUDA_CHECK(c.ctx, LaunchPeerReduce(c.attrs().reduce_op, elem, y.untyped_data(), Operands(all),
                                               static_cast<int64_t>(s.outer), inner,
                                               static_cast<int64_t>(R) * inner, c.where.rank * inner, c.stream));
    return ffi::Error::Success();
  }, everyone);
}

ffi::Error PeerAllGather(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y) {
  const size_t R = c.size;
  const logic::Split s = SplitOf(x, c.attrs().axis_index, 1);  // one piece per row of x
  PeerInfo mine;
  mine.ptr[0] = x.untyped_data();
  const auto everyone = AllRanks(c.size);
  return PeerCall(c, mine, everyone, [&](const std::vector<PeerInfo>& all) -> ffi::Error {
    for (size_t j = 0; j < R; ++j) {
      // Rank j's operand, whole, becomes piece j of every row of the result.
      JAXCOMM_TRY(CopyPlanned(c, static_cast<char*>(y.untyped_data()), static_cast<const char*>(all[j].ptr[0]),
                              logic::BlockCopy(s, R, j, 0, /*to_block=*/false)));
    }
    return ffi::Error::Success();
  }, everyone);
}

ffi::Error PeerAllToAll(const Call& c, const ffi::AnyBuffer& x,
                        ffi::AnyBuffer& y) {
  const size_t R = c.size, r = c.where.rank;
  const size_t block = x.size_bytes() / R;
  const logic::Split in = SplitOf(x, c.attrs().split_axis, R);
  const logic::Split out = SplitOf(y, c.attrs().concat_axis, R);
  char* staging = nullptr;
  if (in.outer > 1 && out.outer > 1) {
    // Both sides strided, with different rows: through a contiguous block.
    auto buf = Scratch(c, block);
    if (buf.has_error()) return buf.error();
    staging = *buf;
  }
  PeerInfo mine;
  mine.ptr[0] = x.untyped_data();
  const auto everyone = AllRanks(c.size);
  char* result = static_cast<char*>(y.untyped_data());
  return PeerCall(c, mine, everyone, [&](const std::vector<PeerInfo>& all) -> ffi::Error {
    for (size_t j = 0; j < R; ++j) {
      // Block r of rank j's operand becomes block j of this rank's result.
      const char* theirs = static_cast<const char*>(all[j].ptr[0]);
      if (in.outer == 1) {
        JAXCOMM_TRY(CopyPlanned(c, result, theirs, logic::BlockCopy(out, R, j, r * block, /*to_block=*/false)));
      } else if (out.outer == 1) {
        JAXCOMM_TRY(CopyPlanned(c, result, theirs, logic::BlockCopy(in, R, r, j * block, /*to_block=*/true)));
      } else {
        JAXCOMM_TRY(CopyPlanned(c, staging, theirs, logic::BlockCopy(in, R, r, 0, /*to_block=*/true)));
        JAXCOMM_TRY(CopyPlanned(c, result, staging, logic::BlockCopy(out, R, j, 0, /*to_block=*/false)));
      }
    }
    return ffi::Error::Success();
  }, everyone);
}

// A split send's movement (split.h) on `stream`: after XLA's stream (`ready`) on one rank,
// through PeerCall's phases otherwise; records what the receive half waits for under the
// result's address `result`.
ffi::Error SplitSend(const Call& c, cudaStream_t stream, const PeerInfo& mine, const void* result,
                     const std::function<ffi::Error(const std::vector<PeerInfo>&)>& enqueue) {
  PendingSend pending;
  if (c.size == 1) {
    OwnedEvent ready, done;
    JAXCOMM_TRY(MakeCallEvents(c.device, c.ctx, &ready, &done));
    JAXCOMM_CUDA_CHECK(c.ctx, cudaEventRecord(ready.get(), c.stream));
    JAXCOMM_CUDA_CHECK(c.ctx, cudaStreamWaitEvent(stream, ready.get(), 0));
    JAXCOMM_TRY(enqueue({mine}));
    JAXCOMM_CUDA_CHECK(c.ctx, cudaEventRecord(done.get(), stream));
    pending.waits.push_back(done.get());
    pending.owned.push_back(std::move(ready));
    pending.owned.push_back(std::move(done));
  } else {
    // Every rank may read every other's buffers: wait for all, and all wait for everyone.
    const auto everyone = AllRanks(c.size);
    const OffStream off{stream, &pending};
    JAXCOMM_TRY(PeerCall(c, mine, everyone, enqueue, everyone, &off));
  }
  Backend::Get().splits().Put(c.device, result, std::move(pending));
  return ffi::Error::Success();
}

ffi::Error PeerPermute(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y) {
  return PermuteOnPeers(c, x, y);
}

ffi::Error PermuteOnPeers(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y, cudaStream_t split) {
  const auto& src = c.attrs().sources;
  const int r = c.where.rank;
  const size_t bytes = x.size_bytes();
  const cudaStream_t stream = split != nullptr ? split : c.stream;
  // The receiver pulls with the copy engine from its source's buffer, once the source's
  // stream has produced it; the source outlives the reads of the ranks it feeds.
  auto enqueue = [&](const std::vector<PeerInfo>& all) -> ffi::Error {
    if (src[r] < 0) {
      JAXCOMM_CUDA_CHECK(c.ctx, cudaMemsetAsync(y.untyped_data(), 0, bytes, stream));
    } else {
      JAXCOMM_CUDA_CHECK(c.ctx, cudaMemcpyAsync(y.untyped_data(), all[src[r]].ptr[0], bytes,
                                                cudaMemcpyDefault, stream));
    }
    return ffi::Error::Success();
  };
  PeerInfo mine;
  mine.ptr[0] = x.untyped_data();
  if (split == nullptr) {
    std::vector<int> readers, source;
    for (int d = 0; d < c.size; ++d) {
      if (src[d] == r) readers.push_back(d);
    }
    if (src[r] >= 0) source.push_back(static_cast<int>(src[r]));
    return PeerCall(c, mine, source, enqueue, readers);
  }
  // A put (jaxcomm.tp.put_start): the reads run on `split`, and the receive half finds
  // what to wait for by the result's address (split.h).
  return SplitSend(c, stream, mine, y.untyped_data(), enqueue);
}

ffi::Error PeerBroadcast(const Call& c, const ffi::AnyBuffer& x, ffi::AnyBuffer& y) {
  const int root = static_cast<int>(c.attrs().root);
  PeerInfo mine;
  mine.ptr[0] = x.untyped_data();
  const bool is_root = c.where.rank == root;
  return PeerCall(c, mine, {root}, [&](const std::vector<PeerInfo>& all) -> ffi::Error {
    return CopyOnStream(c, y.untyped_data(), all[root].ptr[0], x.size_bytes());
  }, is_root ? AllRanks(c.size) : std::vector<int>{});
}

namespace {

// The kernels' float type of a float32, bfloat16 or float16 buffer (kF32 for others,
// which the operand check has excluded wherever the mode reads them as floats).
Elem MoeFloat(ffi::DataType t) {
  return t == ffi::DataType::BF16 ? Elem::kBF16 : t == ffi::DataType::F16 ? Elem::kF16 : Elem::kF32;
}

}  // namespace

ffi::Error MoeTransportOnPeers(const Call& c, const ffi::AnyBuffer& src,
                        const ffi::AnyBuffer& dest, const ffi::AnyBuffer& pos, const ffi::AnyBuffer& w,
                        const ffi::AnyBuffer& g, ffi::AnyBuffer& result, cudaStream_t split) {
  if (c.size > kMaxPeers) return Reject(c, "more ranks than the MoE kernels address (16)");
  int64_t mode = c.attrs().mode;
  MoeOperandShape checked;
  if (std::string why = CheckMoeOperands(mode, src, dest, pos, w, g, result, &checked); !why.empty()) {
    return Reject(c, why);
  }
  MoeShape s;
  s.T = checked.T;
  s.K = checked.K;
  s.H = checked.H;
  s.rows = checked.rows;
  s.row_bytes = checked.row_bytes;
  s.src = MoeFloat(checked.src_type);
  s.out = MoeFloat(checked.out_type);
  s.g = MoeFloat(checked.g_type);
  if (s.K > kMaxSlots) return Reject(c, "more than 64 experts per token (top-k)");
  // A split send's movement outlives its call, and with it XLA's scratch: its gathers zero
  // the whole result first instead of the rows nobody wrote (which needs scratch flags).
  bool zero_first = false;
  if (split != nullptr && ZeroesUnwritten(mode)) {
    if (mode == kGatherScaled) return Reject(c, "gather-scaled has no split-phase form");
    mode = mode == kGatherCopy ? kGatherSparse : kGatherDequantSparse;
    zero_first = true;
  }
  const cudaStream_t stream = split != nullptr ? split : c.stream;
  if (result.size_bytes() == 0) return ffi::Error::Success();
  uint8_t* written = nullptr;
  if (ZeroesUnwritten(mode)) {
    auto flags = Scratch(c, static_cast<size_t>(std::max<int64_t>(s.rows, 1)));
    if (flags.has_error()) return flags.error();
    written = reinterpret_cast<uint8_t*>(*flags);
  }
  const int r = c.where.rank;
  s.self = r;
  // Rank r computes its own result, reading the peers' rows and slot tables in place
  // (one GPU per rank; with one rank, its own buffers). With no tokens, its gathers still
  // zero the rows its peers do not write.
  auto launch = [&](const std::vector<PeerInfo>& all) -> ffi::Error {
    MoePeers p;
    p.R = c.size;
    for (int d = 0; d < c.size; ++d) {
      p.src[d] = all[d].ptr[0];
      p.out[d] = const_cast<void*>(all[d].ptr[1]);
      p.dest[d] = static_cast<const int32_t*>(all[d].ptr[2]);
      p.pos[d] = static_cast<const int32_t*>(all[d].ptr[3]);
      p.w[d] = static_cast<const float*>(all[d].ptr[4]);
      p.g[d] = all[d].ptr[5];
    }
    p.written[r] = written;
    if (zero_first || (s.T == 0 && (ZeroesUnwritten(mode) || !checked.gather))) {
      JAXCOMM_CUDA_CHECK(c.ctx, cudaMemsetAsync(result.untyped_data(), 0, result.size_bytes(), stream));
    }
    if (s.T == 0) return ffi::Error::Success();
    if (ZeroesUnwritten(mode)) JAXCOMM_CUDA_CHECK(c.ctx, MoeZeroWritten(p, s, stream));
    JAXCOMM_CUDA_CHECK(c.ctx, LaunchMoe(static_cast<int>(mode), p, s, stream));
    return ffi::Error::Success();
  };
  PeerInfo mine;
  mine.ptr = {src.untyped_data(), result.untyped_data(), dest.untyped_data(), pos.untyped_data(),
              w.untyped_data(), g.untyped_data()};
  const auto everyone = AllRanks(c.size);
  if (split == nullptr) {
    if (c.size == 1) return launch({mine});
    // Every rank may read every other's buffers: wait for all, and all wait for everyone.
    return PeerCall(c, mine, everyone, launch, everyone);
  }
  return SplitSend(c, stream, mine, result.untyped_data(), launch);
}

ffi::Error MoeReceive(const Call& c, const ffi::AnyBuffer& data, const ffi::AnyBuffer& data_out) {
  if (data.size_bytes() == 0) return ffi::Error::Success();
  if (data_out.untyped_data() != data.untyped_data()) {
    return Reject(c, "the receive half's result is not its send's result (XLA copied it instead "
                     "of aliasing): pass the send's pending value to its receive unchanged");
  }
  PendingSend pending;
  if (!Backend::Get().splits().Take(c.device, data.untyped_data(), &pending)) {
    return Reject(c, "no send half is pending for this result (each send's pending value must "
                     "reach exactly one receive, once)");
  }
  for (cudaEvent_t e : pending.waits) JAXCOMM_CUDA_CHECK(c.ctx, cudaStreamWaitEvent(c.stream, e, 0));
  return ffi::Error::Success();
}

}  // namespace jaxcomm::cuda
