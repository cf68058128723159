#include "cpu/tcp_transport.h"

namespace jaxcomm::cpu {
namespace {
// The key of the one frame a restarted process sends a TCP peer to ask to rejoin; its
// sequence number carries the request's generation.
constexpr uint64_t kJoinKey = 0x6a6f696e72657175ull;  // "joinrequ"
}  // namespace

std::unique_ptr<TcpTransport> TcpTransport::Create(const TcpJob& job, std::function<void()> wake,
                                                   std::string* error) {
  std::unique_ptr<TcpTransport> t(new TcpTransport());
  t->job_ = job;
  t->wake_ = std::move(wake);
  t->listener_ = TcpListener::Create(t->job_, error);
  if (!t->listener_) return nullptr;
  return t;
}

std::shared_ptr<TcpPeerTransport> TcpTransport::Wrap(int fd, int64_t process) {
  auto link = std::make_shared<TcpPeerTransport>(*this, fd, job_, wake_);
  link->peer.process = process;
  return link;
}

std::shared_ptr<PeerTransport> TcpTransport::Connect(const std::string& host, int port,
                                                     std::chrono::steady_clock::time_point deadline,
                                                     std::string* error) {
  const int fd = TcpLink::Connect(host, port, job_, deadline, error);
  if (fd < 0) return nullptr;
  return Wrap(fd, -1);
}

std::shared_ptr<TcpPeerTransport> TcpTransport::Accept(std::chrono::steady_clock::time_point deadline) {
  // The listener checked the job's secret and the process index.
  const TcpHello hello = listener_->Accept(deadline);
  if (hello.fd < 0) return nullptr;
  return Wrap(hello.fd, hello.process);
}

void TcpTransport::Hold(std::shared_ptr<TcpPeerTransport> link) {
  std::lock_guard<std::mutex> lock(mu_);
  held_[link->peer.process] = std::move(link);
}

std::vector<Rejoiner> TcpTransport::Joins(const std::vector<int64_t>& candidates,
                                          const std::function<bool(int64_t, uint64_t)>& wanted) {
  std::vector<Rejoiner> joins;
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t q : candidates) {
    auto it = held_.find(q);
    if (it == held_.end()) continue;
    const uint64_t g = it->second->JoinRequest();
    if (g == 0 || !wanted(q, g)) continue;
    joins.push_back({std::move(it->second), g});
    held_.erase(it);
  }
  return joins;
}

uint64_t TcpPeerTransport::JoinRequest() {
  const int64_t g = link_.Newest(kJoinKey).first;
  return g > 0 ? static_cast<uint64_t>(g) : 0;
}

bool TcpPeerTransport::Find(uint64_t key, int64_t seq, uint64_t fingerprint, uint64_t bytes, Arrival* arrival,
                            std::string* /*error*/) {
  const TcpLink::Frame* f = link_.Find(key, seq, fingerprint, bytes);
  if (!f) return false;
  arrival->fingerprint = f->fingerprint;
  arrival->bytes = f->wire_bytes;
  arrival->data = f->bytes.empty() ? "" : f->bytes.data();  // non-null: it arrived
  return true;
}

void TcpPeerTransport::RequestJoin(int64_t /*process*/, uint64_t generation,
                                   std::chrono::steady_clock::time_point deadline) {
  // The connection's hello said which process this is.
  link_.Send(kJoinKey, static_cast<int64_t>(generation), 0, {}, deadline);
}

}  // namespace jaxcomm::cpu
