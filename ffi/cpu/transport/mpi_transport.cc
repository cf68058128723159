#include "cpu/transport/mpi_transport.h"

#include <algorithm>
#include <climits>
#include <cstring>

#include "core/registry.h"
#include "core/thread_name.h"
#include "cpu/transport/shm_transport.h"  // ProcessGone

namespace jaxcomm::cpu {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kFrameTag = 1;
// Data tags: kFirstDataTag + (frame number modulo the tags there are).
constexpr int kFirstDataTag = 16;
// One data message carries at most this many bytes (MPI counts are ints).
constexpr size_t kChunkBytes = size_t{1} << 30;
// Frames of calls not reached yet, kept per link at most (their header receives wait).
constexpr size_t kMaxFrames = 4096;
// The key of notice frames (the mismatch check): never a call's (plan keys are not 0).
constexpr uint64_t kNoticeKey = 0;
// Spare receive buffers kept per link, in bytes.
constexpr size_t kMaxSpareBytes = size_t{256} << 20;

struct Header {
  uint64_t key;
  int64_t seq;
  uint64_t fingerprint;
  uint64_t bytes;
  uint32_t data_tag;  // larger rounds: the tag of their data messages
  uint32_t parts;     // larger rounds: how many part sizes follow
};
static_assert(sizeof(Header) == 40, "the header is 40 bytes");

constexpr size_t kHeaderBytes = sizeof(Header) + std::max(MpiPeerTransport::kInlineBytes,
                                                          MpiPeerTransport::kMaxParts * sizeof(uint64_t));

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

}  // namespace

struct MpiPeerTransport::OutFrame {
  uint64_t key = 0;
  int64_t seq = 0;
  std::vector<char> header;  // the header message (with the bytes, or the part sizes)
  std::vector<char> copy;    // a round of too many parts, as one
  std::vector<std::pair<const void*, size_t>> chunks;  // the data messages
  int data_tag = 0;
  std::vector<MpiRequest> requests;  // header first
  bool posted = false;
};

struct MpiPeerTransport::InFrame {
  uint64_t fingerprint = 0;
  uint64_t wire_bytes = 0;
  std::vector<char> bytes;  // empty when it did not match its call (then dropped)
  std::vector<uint64_t> parts;
  int data_tag = 0;
  bool complete = false;
  bool posted = false;
  bool keep = true;
  std::vector<char> sink;  // the bytes of a frame that did not match, received and dropped
  std::vector<MpiRequest> requests;
};

// ------------------------------------------------------------------ this process's side

std::unique_ptr<Transport> MpiTransport::Make(const TransportContext& context, const Params& settings,
                                              std::string* error) {
  MpiAbi abi;
  abi.library = Field(settings, "library");
  int64_t rank = -1, size = 0, tag_ub = 0, multiple = 0;
  if (!IntField(settings, "comm", &abi.comm, error) || !IntField(settings, "byte", &abi.byte, error) ||
      !IntField(settings, "handle_bytes", &abi.handle_bytes, error) ||
      !IntField(settings, "status_bytes", &abi.status_bytes, error) ||
      !IntField(settings, "proc_failed", &abi.proc_failed, error) || !IntField(settings, "rank", &rank, error) ||
      !IntField(settings, "size", &size, error) || !IntField(settings, "tag_ub", &tag_ub, error) ||
      !IntField(settings, "thread_multiple", &multiple, error)) {
    return nullptr;
  }
  std::unique_ptr<MpiTransport> t(new MpiTransport());
  t->library_ = MpiLibrary::Load(abi, error);
  if (!t->library_) return nullptr;
  t->context_ = context;
  t->rank_ = static_cast<int>(rank);
  t->size_ = static_cast<int>(size);
  t->tag_ub_ = static_cast<int>(std::min<int64_t>(tag_ub, INT_MAX));
  if (t->tag_ub_ < kFirstDataTag + 1024) {
    *error = "MPI_TAG_UB is " + std::to_string(tag_ub) + ": too few tags";
    return nullptr;
  }
  t->any_thread_ = multiple != 0;
  t->world_ = Field(settings, "world");
  t->machine_ = Field(settings, "machine");
  MpiTransport* raw = t.get();
  t->thread_ = std::thread([raw] {
    NameThisThread("jaxcomm-mpi");
    raw->Run();
  });
  return t;
}

MpiTransport::~MpiTransport() { Close(); }

const Capabilities& MpiTransport::caps() const {
  static const Capabilities caps = [] {
    Capabilities c;
    c.name = "mpi";
    c.per_peer_sends = true;
    c.sends_complete_later = true;
    return c;
  }();
  return caps;
}

Params MpiTransport::Endpoint() const {
  return {{"rank", std::to_string(rank_)}, {"size", std::to_string(size_)}, {"world", world_},
          {"machine", machine_}};
}

std::shared_ptr<PeerTransport> MpiTransport::Link(const LinkRequest& request, std::string* error) {
  int64_t rank = -1, size = 0;
  if (!IntField(request.endpoint, "rank", &rank, error) || !IntField(request.endpoint, "size", &size, error)) {
    return nullptr;
  }
  if (Field(request.endpoint, "world") != world_ || size != size_) {
    *error = "it belongs to another MPI job (its MPI world: " + std::to_string(size) + " processes, '" +
             Field(request.endpoint, "world") + "'; this one's: " + std::to_string(size_) + ", '" + world_ + "')";
    return nullptr;
  }
  if (rank < 0 || rank >= size_ || rank == rank_) {
    *error = "its MPI rank " + std::to_string(rank) + " is not another process of this MPI job";
    return nullptr;
  }
  if (closed()) {
    *error = "jaxcomm's MPI transport was closed (the process is exiting)";
    return nullptr;
  }
  const bool same_machine = !machine_.empty() && Field(request.endpoint, "machine") == machine_;
  auto link = std::make_shared<MpiPeerTransport>(*this, *library_, static_cast<int>(rank),
                                                 same_machine ? request.who.pid : 0, context_.wake);
  {
    std::lock_guard<std::mutex> lock(links_mu_);
    links_.push_back(link);
  }
  Progress();  // posts its first header receive
  return link;
}

void MpiTransport::Close() {
  stop_.store(true);
  {
    std::lock_guard<std::mutex> lock(cv_mu_);
    kicked_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  std::lock_guard<std::mutex> lock(mpi_mu_);
  if (closed_.exchange(true)) return;
  std::vector<std::shared_ptr<MpiPeerTransport>> links;
  {
    std::lock_guard<std::mutex> lock(links_mu_);
    links = links_;
  }
  // After MPI_Finalize no call may be made; before it, jaxcomm's requests are dropped.
  const bool finalized = library_->Finalized();
  for (const auto& link : links) {
    link->Abandon(finalized ? "" : "jaxcomm's MPI transport was closed (the process is exiting)");
  }
}

void MpiTransport::Busy() {
  busy_until_ns_.store(NowNs() + 20'000'000, std::memory_order_relaxed);
  if (!any_thread_) {
    std::lock_guard<std::mutex> lock(cv_mu_);
    kicked_ = true;
    cv_.notify_one();
  }
}

void MpiTransport::Progress() {
  if (closed()) return;
  if (!any_thread_) {
    // Only the MPI thread may call MPI.
    {
      std::lock_guard<std::mutex> lock(cv_mu_);
      kicked_ = true;
    }
    cv_.notify_one();
    return;
  }
  std::unique_lock<std::mutex> lock(mpi_mu_, std::try_to_lock);
  if (!lock.owns_lock() || closed()) return;
  if (Pump()) context_.wake();
}

bool MpiTransport::Pump() {
  std::vector<std::shared_ptr<MpiPeerTransport>> links;
  {
    std::lock_guard<std::mutex> lock(links_mu_);
    links = links_;
  }
  bool progressed = false;
  int in_flight = 0;
  for (const auto& link : links) progressed |= link->Progress(&in_flight);
  outstanding_.store(in_flight, std::memory_order_relaxed);
  return progressed;
}

void MpiTransport::Run() {
  auto last = Clock::now();
  auto nap = std::chrono::microseconds(10);
  // MPI_THREAD_MULTIPLE: the waiting threads advance the requests themselves; this one
  // only backs them up (naps of at most 200 us). Otherwise it is the only one: it spins
  // for the spin budget after the last progress, then naps of at most 1 ms.
  const auto longest_nap = std::chrono::microseconds(any_thread_ ? 200 : 1000);
  while (!stop_.load()) {
    bool progressed = false;
    {
      std::lock_guard<std::mutex> lock(mpi_mu_);
      if (closed()) return;
      progressed = Pump();
    }
    const auto now = Clock::now();
    if (progressed) {
      context_.wake();
      last = now;
      nap = std::chrono::microseconds(10);
      continue;
    }
    const bool busy = NowNs() < busy_until_ns_.load(std::memory_order_relaxed) ||
                      outstanding_.load(std::memory_order_relaxed) > 0;
    if (busy) {
      if (!any_thread_ && now - last < Registry::Get().spin()) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, longest_nap);
      continue;
    }
    std::unique_lock<std::mutex> lock(cv_mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(10), [this] { return kicked_ || stop_.load(); });
    kicked_ = false;
    nap = std::chrono::microseconds(10);
    last = Clock::now();
  }
}

// ------------------------------------------------------------------------ one peer

MpiPeerTransport::MpiPeerTransport(MpiTransport& local, MpiLibrary& library, int rank, int local_pid,
                                   std::function<void()> wake)
    : local_(local), library_(library), rank_(rank), local_pid_(local_pid), wake_(std::move(wake)) {}

std::string MpiPeerTransport::Send(const Outgoing& round, const Parts& parts) {
  auto f = std::make_unique<OutFrame>();
  f->key = round.key;
  f->seq = round.seq;
  size_t bytes = 0;
  for (const auto& [ptr, n] : parts) bytes += n;
  Header h{round.key, round.seq, round.fingerprint, bytes, 0, 0};
  if (bytes <= kInlineBytes) {
    f->header.resize(sizeof(Header) + bytes);
    char* at = f->header.data() + sizeof(Header);
    for (const auto& [ptr, n] : parts) {
      if (n > 0) std::memcpy(at, ptr, n);
      at += n;
    }
  } else {
    Parts pieces;
    for (const auto& [ptr, n] : parts) {
      if (n > 0) pieces.emplace_back(ptr, n);
    }
    if (pieces.size() > kMaxParts) {
      f->copy.resize(bytes);
      char* at = f->copy.data();
      for (const auto& [ptr, n] : pieces) {
        std::memcpy(at, ptr, n);
        at += n;
      }
      pieces = {{f->copy.data(), bytes}};
    }
    h.parts = static_cast<uint32_t>(pieces.size());
    f->header.resize(sizeof(Header) + pieces.size() * sizeof(uint64_t));
    for (size_t i = 0; i < pieces.size(); ++i) {
      const uint64_t n = pieces[i].second;
      std::memcpy(f->header.data() + sizeof(Header) + i * sizeof(uint64_t), &n, sizeof(n));
      for (size_t off = 0; off < n; off += kChunkBytes) {
        f->chunks.emplace_back(static_cast<const char*>(pieces[i].first) + off, std::min<size_t>(kChunkBytes, n - off));
      }
    }
  }
  f->header.resize(std::max(f->header.size(), sizeof(Header)));
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int tags = local_.tag_ub() - kFirstDataTag + 1;
    f->data_tag = kFirstDataTag + static_cast<int>(frames_sent_++ % static_cast<uint64_t>(tags));
  }
  h.data_tag = static_cast<uint32_t>(f->data_tag);
  std::memcpy(f->header.data(), &h, sizeof(h));
  return Queue(std::move(f));
}

std::string MpiPeerTransport::Queue(std::unique_ptr<OutFrame> frame) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.load()) return failure_;
    outgoing_.push_back(std::move(frame));
  }
  local_.Busy();
  local_.Progress();
  return "";
}

bool MpiPeerTransport::Delivered(uint64_t key, int64_t seq) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sent_.find(key);
    if (it != sent_.end() && it->second >= seq) return true;
  }
  local_.Busy();
  local_.Progress();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sent_.find(key);
  return it != sent_.end() && it->second >= seq;
}

bool MpiPeerTransport::Find(uint64_t key, int64_t seq, uint64_t fingerprint, uint64_t bytes, Arrival* arrival,
                            std::string* /*error*/) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto [expected, added] = expected_.try_emplace(key);
      if (added) {
        expected->second.fingerprint = fingerprint;
        expected->second.bytes = bytes;
      }
      auto it = inbox_.find({key, seq});
      if (it != inbox_.end() && it->second->complete) {
        const InFrame& f = *it->second;
        arrival->fingerprint = f.fingerprint;
        arrival->bytes = f.wire_bytes;
        arrival->data = f.bytes.empty() ? "" : f.bytes.data();  // non-null: it arrived
        return true;
      }
    }
    if (attempt == 0) {
      local_.Busy();
      local_.Progress();
    }
  }
  return false;
}

void MpiPeerTransport::Release(uint64_t key, int64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = inbox_.find({key, seq});
  if (it != inbox_.end() && it->second->complete) {
    GiveBuffer(std::move(it->second->bytes));
    inbox_.erase(it);
  }
  Expected& e = expected_[key];
  e.done = std::max(e.done, seq);
}

std::pair<int64_t, std::vector<char>> MpiPeerTransport::Newest(uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto first = inbox_.lower_bound({key, INT64_MIN});
  auto end = inbox_.lower_bound({key + 1, INT64_MIN});
  for (auto it = end; it != first;) {
    --it;
    if (it->second->complete) return {it->first.second, it->second->bytes};
  }
  return {0, {}};
}

std::string MpiPeerTransport::Failure() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.load()) return failure_;
  }
  return local_pid_ > 0 ? ProcessGone(local_pid_) : "";
}

std::vector<WaitNotice> MpiPeerTransport::Notices() {
  std::lock_guard<std::mutex> lock(mu_);
  return notices_;
}

std::string MpiPeerTransport::ShowWaits(const std::vector<WaitNotice>& notices,
                                        std::chrono::steady_clock::time_point /*deadline*/) {
  // A notice frame replaces what the peer showed before; it is queued, never waited for.
  const size_t n = std::min<size_t>(notices.size(), kInlineBytes / sizeof(WaitNotice));
  auto f = std::make_unique<OutFrame>();
  f->key = kNoticeKey;
  f->header.resize(sizeof(Header) + n * sizeof(WaitNotice));
  {
    std::lock_guard<std::mutex> lock(mu_);
    f->seq = ++notices_sent_;
  }
  const Header h{kNoticeKey, f->seq, 0, n * sizeof(WaitNotice), 0, 0};
  std::memcpy(f->header.data(), &h, sizeof(h));
  if (n > 0) std::memcpy(f->header.data() + sizeof(Header), notices.data(), n * sizeof(WaitNotice));
  return Queue(std::move(f));
}

void MpiPeerTransport::Fail(const std::string& why) {
  if (failed_.load()) return;
  failure_ = why;
  failed_.store(true);
  if (wake_) wake_();
}

std::vector<char> MpiPeerTransport::TakeBuffer(size_t bytes) {
  for (auto it = spare_.begin(); it != spare_.end(); ++it) {
    if (it->size() == bytes) {
      std::vector<char> b = std::move(*it);
      spare_.erase(it);
      spare_bytes_ -= bytes;
      return b;
    }
  }
  return std::vector<char>(bytes);
}

void MpiPeerTransport::GiveBuffer(std::vector<char> buffer) {
  // Large ones only: a fresh large buffer costs its zero-fill and a page fault per 4 KiB.
  if (buffer.size() <= kInlineBytes || spare_bytes_ + buffer.size() > kMaxSpareBytes) return;
  spare_bytes_ += buffer.size();
  spare_.push_back(std::move(buffer));
}

std::string MpiPeerTransport::Accept(const char* message) {
  Header h;
  std::memcpy(&h, message, sizeof(h));
  const char* body = message + sizeof(Header);
  if (h.key == kNoticeKey) {
    if (h.bytes % sizeof(WaitNotice) != 0 || h.bytes > kInlineBytes) return "a malformed notice frame arrived";
    if (h.seq > notices_seq_) {
      notices_seq_ = h.seq;
      notices_.assign(h.bytes / sizeof(WaitNotice), WaitNotice{});
      if (h.bytes > 0) std::memcpy(notices_.data(), body, h.bytes);
    }
    return "";
  }
  if (h.seq <= 0) return "a frame with round number " + std::to_string(h.seq) + " arrived";
  if (auto e = expected_.find(h.key); e != expected_.end() && h.seq <= e->second.done) {
    return "a frame of a round already finished (" + std::to_string(h.seq) + ") arrived";
  }
  auto [slot, added] = inbox_.try_emplace({h.key, h.seq});
  if (!added) return "a second frame of round " + std::to_string(h.seq) + " of one call arrived";
  auto f = std::make_unique<InFrame>();
  f->fingerprint = h.fingerprint;
  f->wire_bytes = h.bytes;
  if (h.bytes <= kInlineBytes) {
    f->bytes = TakeBuffer(h.bytes);
    if (h.bytes > 0) std::memcpy(f->bytes.data(), body, h.bytes);
    f->complete = true;
  } else {
    if (h.parts == 0 || h.parts > kMaxParts) return "a frame of " + std::to_string(h.parts) + " parts arrived";
    f->parts.resize(h.parts);
    std::memcpy(f->parts.data(), body, h.parts * sizeof(uint64_t));
    uint64_t total = 0;
    for (uint64_t n : f->parts) total += n;
    if (total != h.bytes) return "a frame whose parts do not add up to its length arrived";
    f->data_tag = static_cast<int>(h.data_tag);
  }
  slot->second = std::move(f);
  return "";
}

std::string MpiPeerTransport::PostData(InFrame& f, bool keep) {
  f.keep = keep;
  std::vector<char>& into = keep ? f.bytes : f.sink;
  into = TakeBuffer(f.wire_bytes);
  size_t offset = 0;
  for (uint64_t part : f.parts) {
    for (uint64_t off = 0; off < part; off += kChunkBytes) {
      const size_t n = std::min<uint64_t>(kChunkBytes, part - off);
      f.requests.emplace_back();
      const int rc = library_.Irecv(into.data() + offset, n, rank_, f.data_tag, &f.requests.back());
      if (rc != 0) return "MPI_Irecv: " + library_.ErrorText(rc);
      offset += n;
    }
  }
  f.posted = true;
  return "";
}

bool MpiPeerTransport::Progress(int* in_flight) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.load()) return false;
  bool progressed = false;
  std::string error;
  const auto fail_with = [&](const std::string& what, int rc) {
    if (library_.ProcessFailed(rc)) {
      error = "it failed (MPI reports the process failed: " + library_.ErrorText(rc) + ")";
    } else {
      error = what + ": " + library_.ErrorText(rc);
    }
  };
  // Sends: post the new frames, then see which finished.
  for (auto& f : outgoing_) {
    if (f->posted) continue;
    f->requests.resize(1 + f->chunks.size());
    int rc = library_.Isend(f->header.data(), f->header.size(), rank_, kFrameTag, &f->requests[0]);
    for (size_t i = 0; rc == 0 && i < f->chunks.size(); ++i) {
      rc = library_.Isend(f->chunks[i].first, f->chunks[i].second, rank_, f->data_tag, &f->requests[i + 1]);
    }
    if (rc != 0) {
      fail_with("MPI_Isend", rc);
      break;
    }
    f->posted = true;
  }
  for (auto it = outgoing_.begin(); error.empty() && it != outgoing_.end();) {
    OutFrame& f = **it;
    bool all = f.posted;
    for (MpiRequest& r : f.requests) {
      if (!r.active) continue;
      bool done = false;
      if (const int rc = library_.Test(&r, &done); rc != 0) {
        fail_with("sending to it (MPI_Test)", rc);
        break;
      }
      all &= done;
    }
    if (!error.empty() || !all) {
      ++it;
      continue;
    }
    // The rounds of one call are sent one after the other: the newest one sent whole
    // says which are.
    if (f.key != kNoticeKey) {
      int64_t& s = sent_[f.key];
      s = std::max(s, f.seq);
    }
    it = outgoing_.erase(it);
    progressed = true;
  }
  *in_flight += static_cast<int>(outgoing_.size());
  // Headers: a posted receive, taken and posted again while frames arrive.
  for (int i = 0; error.empty() && i < 64; ++i) {
    if (!header_request_.active) {
      if (inbox_.size() >= kMaxFrames) break;  // the peer's sends wait until rounds finish here
      header_.resize(kHeaderBytes);
      if (const int rc = library_.Irecv(header_.data(), header_.size(), rank_, kFrameTag, &header_request_); rc != 0) {
        fail_with("MPI_Irecv", rc);
        break;
      }
    }
    bool done = false;
    if (const int rc = library_.Test(&header_request_, &done); rc != 0) {
      fail_with("receiving from it (MPI_Test)", rc);
      break;
    }
    if (!done) break;
    error = Accept(header_.data());
    progressed = true;
  }
  // Data: posted once the call is reached here, taken when complete.
  for (auto it = inbox_.begin(); error.empty() && it != inbox_.end(); ++it) {
    InFrame& f = *it->second;
    if (f.complete) continue;
    if (!f.posted) {
      auto e = expected_.find(it->first.first);
      if (e == expected_.end()) continue;  // a call this process has not reached
      const bool keep = e->second.fingerprint == f.fingerprint && e->second.bytes == f.wire_bytes;
      error = PostData(f, keep);
      if (!error.empty()) break;
    }
    bool all = true;
    for (MpiRequest& r : f.requests) {
      if (!r.active) continue;
      bool done = false;
      if (const int rc = library_.Test(&r, &done); rc != 0) {
        fail_with("receiving from it (MPI_Test)", rc);
        break;
      }
      all &= done;
    }
    if (!error.empty()) break;
    if (all) {
      f.complete = true;
      if (!f.keep) GiveBuffer(std::move(f.sink));  // another program's: its bytes are dropped
      f.requests.clear();
      progressed = true;
    } else {
      ++*in_flight;
    }
  }
  if (!error.empty()) {
    Fail(error);
    return true;
  }
  return progressed;
}

void MpiPeerTransport::Abandon(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!why.empty()) {
    library_.Abandon(&header_request_);
    for (auto& f : outgoing_) {
      for (MpiRequest& r : f->requests) library_.Abandon(&r);
    }
    for (auto& [k, f] : inbox_) {
      for (MpiRequest& r : f->requests) library_.Abandon(&r);
    }
  }
  Fail(why.empty() ? "MPI was finalized" : why);
}

}  // namespace jaxcomm::cpu
