#include "cpu/transport/tcp_transport.h"

#include <algorithm>
#include <exception>
#include <stdexcept>

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

std::unique_ptr<Transport> TcpTransport::Make(const TransportContext& context, const Params& settings,
                                              std::string* error) {
  TcpJob job;
  job.me = context.process;
  job.listen_address = Field(settings, "listen_address");
  const std::string secret = Field(settings, "secret");
  if (secret.size() != 2 * job.secret.size()) {
    *error = "the job secret must be " + std::to_string(job.secret.size()) + " bytes (hex digits: " +
             std::to_string(secret.size()) + ")";
    return nullptr;
  }
  for (size_t i = 0; i < job.secret.size(); ++i) {
    try {
      size_t used = 0;
      job.secret[i] = static_cast<uint8_t>(std::stoul(secret.substr(2 * i, 2), &used, 16));
      if (used != 2) throw std::invalid_argument("hex");
    } catch (const std::exception&) {
      *error = "the job secret is not hex digits";
      return nullptr;
    }
  }
  int64_t wait_ms = 0;
  if (!IntField(settings, "processes", &job.processes, error) || !IntField(settings, "early_wait_ms", &wait_ms, error)) {
    return nullptr;
  }
  job.early_wait = std::chrono::milliseconds(wait_ms);
  auto t = Create(job, context.wake, error);
  if (t) t->address_ = Field(settings, "address").empty() ? job.listen_address : Field(settings, "address");
  return t;
}

const Capabilities& TcpTransport::caps() const {
  static const Capabilities caps = [] {
    Capabilities c;
    c.name = "tcp";
    c.per_peer_sends = true;
    return c;
  }();
  return caps;
}

Params TcpTransport::Endpoint() const { return {{"address", address_}, {"port", std::to_string(port())}}; }

std::shared_ptr<PeerTransport> TcpTransport::Link(const LinkRequest& request, std::string* error) {
  const int64_t process = request.who.process;
  std::shared_ptr<TcpPeerTransport> link;
  if (job_.me < process || request.rejoining) {
    int64_t port = 0;
    if (!IntField(request.endpoint, "port", &port, error)) return nullptr;
    link = Connect(Field(request.endpoint, "address"), static_cast<int>(port), request.deadline, error);
    if (!link) return nullptr;
  } else {
    // The peer connects to this process (this thread or the progress thread, Poll, takes
    // the connection).
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (auto it = accepted_.find(process); it != accepted_.end()) {
          link = std::move(it->second);
          accepted_.erase(it);
          break;
        }
      }
      if (std::chrono::steady_clock::now() >= request.deadline) {
        *error = "waiting for it to connect: timed out";
        return nullptr;
      }
      Accept(std::min(request.deadline, std::chrono::steady_clock::now() + std::chrono::milliseconds(50)));
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  linked_.insert(process);
  return link;
}

void TcpTransport::Poll() { Accept(std::chrono::steady_clock::now()); }

void TcpTransport::Accept(std::chrono::steady_clock::time_point deadline) {
  // The listener checked the job's secret and the process index.
  const TcpHello hello = listener_->Accept(deadline);
  if (hello.fd < 0) return;
  auto link = Wrap(hello.fd, hello.process);
  link->peer.host = "(not yet linked)";
  std::lock_guard<std::mutex> lock(mu_);
  (linked_.count(hello.process) ? held_ : accepted_)[hello.process] = std::move(link);
}

std::shared_ptr<TcpPeerTransport> TcpTransport::Wrap(int fd, int64_t process) {
  auto link = std::make_shared<TcpPeerTransport>(*this, fd, job_, wake_);
  link->peer.process = process;
  return link;
}

std::shared_ptr<TcpPeerTransport> TcpTransport::Connect(const std::string& host, int port,
                                                        std::chrono::steady_clock::time_point deadline,
                                                        std::string* error) {
  const int fd = TcpLink::Connect(host, port, job_, deadline, error);
  if (fd < 0) return nullptr;
  return Wrap(fd, -1);
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
