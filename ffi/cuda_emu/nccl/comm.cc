#include "cuda_emu/nccl/comm.h"

#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>

#include "core/env.h"
#include "cuda_emu/nccl/reduce.h"

namespace jaxcomm::nccl_mock {
namespace {

constexpr char kMagic[8] = {'J', 'X', 'N', 'C', 'C', 'L', 'M', 'K'};
constexpr int kMaxRanks = 4096;
constexpr uint32_t kAborted = 1, kFailed = 2;

// One rank's entry in the control segment.
struct alignas(64) RankEntry {
  std::atomic<uint32_t> claimed;  // 0 -> 1 by the rank that takes this entry
  std::atomic<uint32_t> joined;   // its fields below are written
  std::atomic<uint32_t> aborted;  // that rank stopped: kAborted (ncclCommAbort) or kFailed
  int32_t nranks;
  int32_t device;
  int32_t pid;
  int64_t bus_id;
  uint64_t host_hash;
};
struct alignas(64) CtlHeader {
  std::atomic<uint32_t> done;  // ranks through the join; the last removes the name
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "atomics in shared memory must be lock-free");

// The header of one operation's part from one rank.
struct alignas(64) MessageHeader {
  std::atomic<uint32_t> ready;   // the data below is written
  std::atomic<uint32_t> opened;  // readers that mapped it
  uint32_t kind;
  int32_t type, red, root;
  uint64_t count, bytes, seq;
};

RankEntry* Entries(const ShmSegment& ctl) {
  return reinterpret_cast<RankEntry*>(ctl.data() + sizeof(CtlHeader));
}

// JAXCOMM_NCCL_MOCK_TIMEOUT_S (jaxcomm/_src/config.py); a malformed value goes to `errors`.
std::chrono::milliseconds TimeoutFromEnv(std::vector<std::string>* errors) {
  return std::chrono::seconds(env::Count("JAXCOMM_NCCL_MOCK_TIMEOUT_S", "seconds", 300, errors));
}

// NCCL's busIdToInt64: the hex digits of "0000:01:00.0", separators skipped.
int64_t BusIdToInt(const char* bus) {
  int64_t v = 0;
  for (int i = 0; i < 16 && bus[i] != '\0'; ++i) {
    const char c = bus[i];
    if (c == '.' || c == ':') continue;
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else break;
    v = v * 16 + d;
  }
  return v;
}

// NCCL tells hosts apart by a hash of the host name.
uint64_t HostHash() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return std::hash<std::string>{}(name);
}

std::string Millis(std::chrono::milliseconds ms) { return std::to_string(ms.count()) + " ms"; }

std::string Describe(const Op& op) {
  std::ostringstream s;
  s << KindName(op.kind) << " #" << op.seq << " (" << op.count << " x " << TypeName(op.type);
  if (op.kind == Kind::kAllReduce || op.kind == Kind::kReduceScatter) s << ", " << OpName(op.red);
  if (op.kind == Kind::kBroadcast) s << ", root " << op.peer;
  if (op.kind == Kind::kSend) s << ", to rank " << op.peer;
  if (op.kind == Kind::kRecv) s << ", from rank " << op.peer;
  s << ")";
  return s.str();
}

bool IsCollective(Kind k) { return k != Kind::kSend && k != Kind::kRecv; }

}  // namespace

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kAllReduce: return "ncclAllReduce";
    case Kind::kAllGather: return "ncclAllGather";
    case Kind::kReduceScatter: return "ncclReduceScatter";
    case Kind::kBroadcast: return "ncclBroadcast";
    case Kind::kSend: return "ncclSend";
    case Kind::kRecv: return "ncclRecv";
  }
  return "?";
}

void MakeUniqueId(ncclUniqueId* id) {
  std::memset(id->internal, 0, sizeof(id->internal));
  std::random_device rd;
  const uint64_t nonce = (uint64_t{rd()} << 32 | rd()) ^ static_cast<uint64_t>(getpid()) ^
                         static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  std::memcpy(id->internal, kMagic, sizeof(kMagic));
  std::memcpy(id->internal + sizeof(kMagic), &nonce, sizeof(nonce));
}

namespace {
std::string PrefixOf(const ncclUniqueId& id, bool* valid) {
  *valid = std::memcmp(id.internal, kMagic, sizeof(kMagic)) == 0;
  uint64_t nonce = 0;
  std::memcpy(&nonce, id.internal + sizeof(kMagic), sizeof(nonce));
  char buf[40];
  std::snprintf(buf, sizeof(buf), "/jxnccl_%016" PRIx64, nonce);
  return buf;
}
}  // namespace

Comm::Comm(const ncclUniqueId& id, int nranks, int rank, bool blocking)
    : prefix_([&] { bool v; return PrefixOf(id, &v); }()),
      id_valid_([&] { bool v; PrefixOf(id, &v); return v; }()),
      nranks_(nranks), rank_(rank), blocking_(blocking), timeout_(TimeoutFromEnv(&config_errors_)),
      sent_(nranks > 0 ? nranks : 0), received_(nranks > 0 ? nranks : 0) {}

Comm::~Comm() { StopJoining(); }

std::string Comm::Name(const std::string& suffix) const { return prefix_ + "_" + suffix; }

std::string Comm::Who() const {
  return "mock NCCL: rank " + std::to_string(rank_) + " of " + std::to_string(nranks_);
}

const char* Comm::error_message() const { return error_text_.load(); }

ncclResult_t Comm::Fail(ncclResult_t r, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (error_) return r;  // the first error stays
    error_ = std::make_unique<const std::string>(why);
    error_text_.store(error_->c_str());
  }
  const int before = state_.exchange(r);
  // The peers of a working communicator stop waiting for this rank (ncclRemoteError)
  // instead of running into their deadlines. (A rank that fails to join tells nobody: each
  // of the others finds its own reason, as in NCCL.)
  if (before == ncclSuccess && ctl_.mapped()) {
    uint32_t running = 0;
    Entries(ctl_)[rank_].aborted.compare_exchange_strong(running, kFailed);
  }
  return r;
}

ncclResult_t Comm::Init() {
  if (!config_errors_.empty()) return Fail(ncclInvalidArgument, Who() + ": " + config_errors_.front());
  if (!id_valid_) {
    return Fail(ncclInvalidArgument, Who() + ": the unique id was not made by this library's ncclGetUniqueId");
  }
  if (nranks_ < 1 || nranks_ > kMaxRanks || rank_ < 0 || rank_ >= nranks_) {
    return Fail(ncclInvalidArgument, Who() + ": invalid rank or nranks (at most " +
                                         std::to_string(kMaxRanks) + " ranks)");
  }
  // The device is the calling thread's current one, as for NCCL, known by its PCI bus id
  // (the string cudaDeviceGetPCIBusId gives).
  cudaDeviceProp prop{};
  cudaError_t e = cudaGetDevice(&device_);
  if (e == cudaSuccess) e = cudaGetDeviceProperties(&prop, device_);
  if (e != cudaSuccess) {
    return Fail(ncclUnhandledCudaError, Who() + ": cannot tell the calling thread's CUDA device: " +
                                            cudaGetErrorString(e));
  }
  char bus[32];
  std::snprintf(bus, sizeof(bus), "%04x:%02x:%02x.0", prop.pciDomainID, prop.pciBusID, prop.pciDeviceID);
  bus_id_ = BusIdToInt(bus);
  host_hash_ = HostHash();
  if (blocking_) return Join();
  joining_ = std::thread([this] { Join(); });
  return ncclInProgress;
}

void Comm::StopJoining() {
  if (!joining_.joinable()) return;
  if (state_.load() == ncclInProgress) aborted_.store(true);
  joining_.join();
}

ncclResult_t Comm::Join() {
  const auto deadline = Clock::now() + timeout_;
  const size_t ctl_bytes = sizeof(CtlHeader) + sizeof(RankEntry) * static_cast<size_t>(kMaxRanks);
  std::string err = ctl_.Create(Name("ctl"), ctl_bytes, /*exclusive=*/false);
  if (!err.empty()) return Fail(ncclSystemError, Who() + ": joining: " + err);
  RankEntry* entries = Entries(ctl_);
  RankEntry& mine = entries[rank_];
  if (mine.claimed.exchange(1) != 0) {
    return Fail(ncclInvalidUsage, Who() + ": another rank " + std::to_string(rank_) +
                                      " already joined with this unique id");
  }
  mine.nranks = nranks_;
  mine.device = device_;
  mine.pid = static_cast<int32_t>(getpid());
  mine.bus_id = bus_id_;
  mine.host_hash = host_hash_;
  mine.joined.store(1, std::memory_order_release);

  std::string why;
  const ncclResult_t r = Wait(
      [&](std::string*) {
        for (int p = 0; p < nranks_; ++p) {
          if (entries[p].joined.load(std::memory_order_acquire) == 0) return false;
        }
        return true;
      },
      deadline, kAnyPeer, "the other ranks to join (ncclCommInitRankConfig)", &why);
  if (r != ncclSuccess) {
    if (!aborted_.load()) {
      std::string missing;
      for (int p = 0; p < nranks_; ++p) {
        if (entries[p].joined.load() == 0) missing += (missing.empty() ? "" : ", ") + std::to_string(p);
      }
      why += " (ranks that never joined: " + missing + ")";
    }
    ctl_.Unlink();  // a late rank makes a fresh one and times out alone
    return Fail(r, why);
  }
  for (int p = 0; p < nranks_; ++p) {
    if (entries[p].nranks != nranks_) {
      return Fail(ncclInvalidUsage, Who() + ": rank " + std::to_string(p) + " joined with nranks " +
                                        std::to_string(entries[p].nranks));
    }
  }
  auto* header = reinterpret_cast<CtlHeader*>(ctl_.data());
  if (header->done.fetch_add(1) + 1 == static_cast<uint32_t>(nranks_)) ctl_.Unlink();
  // NCCL's rule (init.cc): two ranks of one communicator may not share a GPU.
  for (int p = 0; p < nranks_; ++p) {
    if (p != rank_ && entries[p].host_hash == host_hash_ && entries[p].bus_id == bus_id_) {
      char msg[160];
      std::snprintf(msg, sizeof(msg), "Duplicate GPU detected : rank %d and rank %d both on CUDA device %" PRIx64,
                    rank_, p, static_cast<uint64_t>(bus_id_));
      return Fail(ncclInvalidUsage, msg);
    }
  }
  int expected = ncclInProgress;
  state_.compare_exchange_strong(expected, ncclSuccess);
  return static_cast<ncclResult_t>(state_.load());
}

ncclResult_t Comm::Wait(const std::function<bool(std::string*)>& done, Clock::time_point deadline, int peer,
                        const std::string& waiting_for, std::string* why) {
  const auto start = Clock::now();
  for (int i = 0;; ++i) {
    std::string err;
    if (done(&err)) return ncclSuccess;
    if (!err.empty()) {
      *why = Who() + ": " + err;
      return ncclSystemError;
    }
    if (aborted_.load()) {
      *why = Who() + ": the communicator was aborted (ncclCommAbort) while waiting for " + waiting_for;
      return ncclInvalidUsage;
    }
    // A peer stops only after what it did before (joining, publishing its part), so one
    // more look tells a finished wait from one that never can finish.
    const int gone = AbortedPeer(peer);
    if (gone >= 0 && !done(&err)) {
      const bool aborted = Entries(ctl_)[gone].aborted.load() == kAborted;
      *why = Who() + ": rank " + std::to_string(gone) +
             (aborted ? " aborted its communicator (ncclCommAbort)" : "'s communicator failed") + " while rank " +
             std::to_string(rank_) + " was waiting for " + waiting_for;
      return ncclRemoteError;
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      *why = Who() + ": waited " +
             Millis(std::chrono::duration_cast<std::chrono::milliseconds>(now - start)) + " for " + waiting_for +
             " and gave up (JAXCOMM_NCCL_MOCK_TIMEOUT_S: " + Millis(timeout_) + ")";
      return ncclSystemError;
    }
    // Spin briefly (the peer is usually close behind), then back off to 1 ms.
    if (i < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(i < 200 ? 20 : 1000));
    }
  }
}

int Comm::AbortedPeer(int peer) const {
  if (peer == kNoPeer || !ctl_.mapped()) return -1;
  const RankEntry* entries = Entries(ctl_);
  int failed = -1;  // an aborted rank is the cause of the others' failures: named first
  for (int p = peer == kAnyPeer ? 0 : peer; p < (peer == kAnyPeer ? nranks_ : peer + 1); ++p) {
    const uint32_t state = p == rank_ ? 0 : entries[p].aborted.load();
    if (state == kAborted) return p;
    if (state == kFailed && failed < 0) failed = p;
  }
  return failed;
}

ncclResult_t Comm::AsyncError() const {
  const int s = state_.load();
  if (s == ncclSuccess && finalizing_.load() && outstanding_.load() > 0) return ncclInProgress;
  return static_cast<ncclResult_t>(s);
}

ncclResult_t Comm::CheckReady(std::string* why) const {
  const int s = state_.load();
  if (s == ncclInProgress) {
    *why = Who() + ": the communicator is still being initialized (poll ncclCommGetAsyncError until it "
                   "returns ncclSuccess before using it)";
    return ncclInvalidUsage;
  }
  if (s != ncclSuccess) {
    *why = error_message();
    return static_cast<ncclResult_t>(s);
  }
  if (finalizing_.load()) {
    *why = Who() + ": the communicator was finalized (ncclCommFinalize)";
    return ncclInvalidUsage;
  }
  return ncclSuccess;
}

struct Comm::Work {
  std::shared_ptr<Comm> comm;
  std::vector<Op> ops;
};

void Comm::RunWork(void* p) {
  std::unique_ptr<Work> work(static_cast<Work*>(p));
  work->comm->RunOps(work->ops);
  work->comm->outstanding_.fetch_sub(1);
}

ncclResult_t Comm::Launch(std::vector<Op> ops, cudaStream_t stream, std::string* why) {
  std::lock_guard<std::mutex> lock(launch_mu_);
  for (Op& op : ops) {
    if (IsCollective(op.kind)) op.seq = collectives_++;
    else if (op.kind == Kind::kSend) op.seq = sent_[op.peer]++;
    else op.seq = received_[op.peer]++;
  }
  auto work = std::make_unique<Work>(Work{shared_from_this(), std::move(ops)});
  outstanding_.fetch_add(1);
  const cudaError_t e = cudaLaunchHostFunc(stream, &Comm::RunWork, work.get());
  if (e != cudaSuccess) {
    outstanding_.fetch_sub(1);
    *why = Who() + ": cudaLaunchHostFunc failed: " + cudaGetErrorString(e);
    return Fail(ncclUnhandledCudaError, *why);
  }
  work.release();  // RunWork owns it now
  return ncclSuccess;
}

ncclResult_t Comm::Finalize(std::string* why) {
  const ncclResult_t ready = CheckReady(why);
  if (ready != ncclSuccess) return ready;
  finalizing_.store(true);
  if (!blocking_) return AsyncError();
  return Wait([&](std::string*) { return outstanding_.load() == 0; }, Clock::now() + timeout_, kNoPeer,
              "its enqueued operations to finish (ncclCommFinalize)", why);
}

void Comm::Abort() {
  aborted_.store(true);
  if (joining_.joinable()) joining_.join();
  if (ctl_.mapped()) {
    uint32_t running = 0;  // a failure stays what the peers see
    Entries(ctl_)[rank_].aborted.compare_exchange_strong(running, kAborted);
  }
}

void Comm::RunOps(const std::vector<Op>& ops) {
  if (aborted_.load() || state_.load() != ncclSuccess) return;  // an aborted or failed NCCL runs nothing
  const auto deadline = Clock::now() + timeout_;
  // 1. Publish this rank's part of every operation.
  struct Outgoing {
    ShmSegment segment;
    int readers;
    int peer;  // who reads it: one rank, or kAnyPeer
    std::string what;
  };
  std::vector<Outgoing> outgoing;
  std::vector<int> published(ops.size(), -1);  // index into outgoing
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    const size_t item = TypeBytes(op.type);
    size_t bytes = op.count * item;
    int readers = nranks_ - 1;
    std::string name = Name("c" + std::to_string(op.seq) + "_" + std::to_string(rank_));
    switch (op.kind) {
      case Kind::kReduceScatter: bytes *= static_cast<size_t>(nranks_); break;
      case Kind::kBroadcast:
        if (rank_ != op.peer) continue;
        break;
      case Kind::kSend:
        readers = 1;
        name = Name("p" + std::to_string(rank_) + "_" + std::to_string(op.peer) + "_" + std::to_string(op.seq));
        break;
      case Kind::kRecv: continue;
      default: break;
    }
    Outgoing out{ShmSegment(), readers, op.kind == Kind::kSend ? op.peer : kAnyPeer, Describe(op)};
    const std::string err = out.segment.Create(name, sizeof(MessageHeader) + bytes, /*exclusive=*/true);
    if (!err.empty()) {
      Fail(ncclSystemError, Who() + ": " + Describe(op) + ": " + err);
      return;
    }
    auto* h = reinterpret_cast<MessageHeader*>(out.segment.data());
    h->kind = static_cast<uint32_t>(op.kind);
    h->type = op.type;
    h->red = op.red;
    h->root = op.peer;
    h->count = op.count;
    h->bytes = bytes;
    h->seq = op.seq;
    if (bytes > 0) std::memcpy(out.segment.data() + sizeof(MessageHeader), op.send, bytes);
    h->ready.store(1, std::memory_order_release);
    published[i] = static_cast<int>(outgoing.size());
    outgoing.push_back(std::move(out));
  }

  // 2. Read the peers' parts, checking that they belong to the same operation.
  // Opens rank `from`'s part `name` of `op`: the data, or nullptr with the error recorded.
  auto open = [&](const Op& op, int from, const std::string& name, size_t bytes, ShmSegment* seg) -> const char* {
    const std::string waiting_for = "rank " + std::to_string(from) + "'s part of " + Describe(op);
    std::string why;
    MessageHeader* h = nullptr;
    ncclResult_t r = Wait(
        [&](std::string* err) {
          if (!seg->mapped() && !seg->TryOpen(name, err)) return false;
          h = reinterpret_cast<MessageHeader*>(seg->data());
          return h->ready.load(std::memory_order_acquire) != 0;
        },
        deadline, op.kind == Kind::kSend ? from : kAnyPeer, waiting_for, &why);
    if (r != ncclSuccess) {
      if (!aborted_.load()) Fail(r, why);
      return nullptr;
    }
    h->opened.fetch_add(1);
    const bool same = h->kind == static_cast<uint32_t>(op.kind) && h->type == op.type && h->count == op.count &&
                      h->bytes == bytes && h->seq == op.seq &&
                      (op.kind != Kind::kBroadcast || h->root == op.peer) &&
                      ((op.kind != Kind::kAllReduce && op.kind != Kind::kReduceScatter) || h->red == op.red);
    if (!same) {
      Op theirs{static_cast<Kind>(h->kind), nullptr, nullptr, h->count, static_cast<ncclDataType_t>(h->type),
                static_cast<ncclRedOp_t>(h->red), h->root, h->seq, nullptr};
      Fail(ncclInvalidUsage, Who() + ": " + Describe(op) + " met rank " + std::to_string(from) + "'s " +
                                 Describe(theirs) +
                                 ": the ranks' calls do not match (real NCCL would hang or corrupt data)");
      return nullptr;
    }
    return seg->data() + sizeof(MessageHeader);
  };

  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    const size_t item = TypeBytes(op.type);
    const size_t bytes = op.count * item;
    if (op.kind == Kind::kSend) continue;
    if (op.kind == Kind::kRecv) {
      ShmSegment seg;
      const std::string name =
          Name("p" + std::to_string(op.peer) + "_" + std::to_string(rank_) + "_" + std::to_string(op.seq));
      Op as_sent = op;  // the header the sender wrote
      as_sent.kind = Kind::kSend;
      as_sent.peer = rank_;
      const char* data = open(as_sent, op.peer, name, bytes, &seg);
      if (data == nullptr) return;
      if (bytes > 0) std::memcpy(op.recv, data, bytes);
      continue;
    }
    if (op.kind == Kind::kBroadcast) {
      const int root = op.peer;
      ShmSegment seg;
      const char* data = rank_ == root
                             ? outgoing[published[i]].segment.data() + sizeof(MessageHeader)
                             : open(op, root, Name("c" + std::to_string(op.seq) + "_" + std::to_string(root)), bytes, &seg);
      if (data == nullptr) return;
      if (bytes > 0) std::memcpy(op.recv, data, bytes);
      continue;
    }
    const size_t part = op.kind == Kind::kReduceScatter ? bytes * static_cast<size_t>(nranks_) : bytes;
    std::vector<ShmSegment> segs(static_cast<size_t>(nranks_));
    std::vector<const void*> parts(static_cast<size_t>(nranks_));
    for (int p = 0; p < nranks_; ++p) {
      const char* data = p == rank_ ? outgoing[published[i]].segment.data() + sizeof(MessageHeader)
                                    : open(op, p, Name("c" + std::to_string(op.seq) + "_" + std::to_string(p)),
                                           part, &segs[p]);
      if (data == nullptr) return;
      parts[p] = op.kind == Kind::kReduceScatter ? data + static_cast<size_t>(rank_) * bytes : data;
    }
    switch (op.kind) {
      case Kind::kAllReduce:
      case Kind::kReduceScatter:
        Reduce(op.type, op.red, parts.data(), nranks_, op.recv, op.count);
        break;
      case Kind::kAllGather:
        for (int p = 0; p < nranks_; ++p) {
          if (bytes > 0) std::memcpy(static_cast<char*>(op.recv) + static_cast<size_t>(p) * bytes, parts[p], bytes);
        }
        break;
      default: break;
    }
  }

  // 3. Remove this rank's parts once every reader has them mapped.
  for (Outgoing& out : outgoing) {
    auto* h = reinterpret_cast<MessageHeader*>(out.segment.data());
    std::string why;
    const ncclResult_t r = Wait(
        [&](std::string*) { return h->opened.load() >= static_cast<uint32_t>(out.readers); }, deadline,
        out.peer, "its readers to take its part of " + out.what, &why);
    if (r != ncclSuccess) {
      if (!aborted_.load()) Fail(r, why);
      return;
    }
    out.segment.Unlink();
  }
}

}  // namespace jaxcomm::nccl_mock
