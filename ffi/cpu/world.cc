#include "cpu/world.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/registry.h"

namespace jaxcomm::cpu {
namespace {

using Clock = std::chrono::steady_clock;

// How often a waiting exchange checks that its peers still live.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(100);
// The progress thread's longest sleep between polls once spinning stopped paying off.
constexpr auto kMaxNap = std::chrono::microseconds(1000);

// Why process `pid` on this host is gone, or "" while it runs.
std::string ProcessGone(int pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return "it exited";
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (std::getline(stat, line)) {
    auto close = line.rfind(')');
    if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z') {
      return "it exited";
    }
  }
  return "";
}

}  // namespace

struct World::PeerLink {
  int64_t process = -1;
  std::string host;
  int pid = 0;
  std::mutex mu;  // the ShmPeer's lookup cache
  std::unique_ptr<ShmPeer> shm;
  std::unique_ptr<TcpLink> tcp;
  Clock::time_point checked{};
  std::string gone;  // set once the peer is known dead

  std::string Describe() const {
    return "process " + std::to_string(process) + " (host " + host + ", pid " + std::to_string(pid) + ")";
  }
};

struct World::Pending {
  ExchangeSpec spec;
  ExchangeDone done;
  std::vector<std::shared_ptr<PeerLink>> links;
  std::vector<const char*> blobs;
  size_t gathered = 0;
  bool published = false;
  Clock::time_point next_check{};
};

World::World() = default;

World::~World() {
  stop_.store(true);
  Wake();
  if (progress_.joinable()) progress_.join();
}

Endpoint World::Open(int64_t process, bool shared_memory, std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (process_ >= 0 && process_ != process) {
    *error = "jaxcomm's endpoint was opened as process " + std::to_string(process_) + ", not " +
             std::to_string(process);
    return {};
  }
  if (process_ < 0) {
    if (shared_memory) {
      shm_ = ShmOwner::Create(process, error);
      if (!shm_) return {};
    }
    listener_ = TcpListener::Create(error);
    if (!listener_) return {};
    process_ = process;
    progress_ = std::thread([this] { Progress(); });
  }
  Endpoint e;
  e.pid = static_cast<int>(getpid());
  e.port = listener_->port();
  if (shm_) {
    e.control_fd = shm_->control_fd();
    e.control_bytes = shm_->control_bytes();
  }
  return e;
}

std::string World::Link(int64_t process, const std::string& host, const Endpoint& peer,
                        bool shared_memory, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  if (process_ < 0) return "jaxcomm's endpoint is not open";
  if (Peer(process)) return "";
  auto link = std::make_shared<PeerLink>();
  link->process = process;
  link->host = host;
  link->pid = peer.pid;
  std::string error;
  if (shared_memory) {
    if (!shm_ || peer.control_fd < 0) return "shared memory was not set up at both ends";
    link->shm = ShmPeer::Open(peer.pid, peer.control_fd, peer.control_bytes, &error);
    if (!link->shm) return "mapping the shared memory of " + link->Describe() + ": " + error;
  } else if (process_ < process) {
    int fd = TcpLink::Connect(host, peer.port, process_, deadline, &error);
    if (fd < 0) return "connecting to " + link->Describe() + ": " + error;
    link->tcp = std::make_unique<TcpLink>(fd, [this] { Wake(); });
  } else {
    // The peer connects to us; connections from other peers that come first are kept.
    while (!Peer(process)) {
      int fd = listener_->Accept(deadline, &error);
      if (fd < 0) return "waiting for " + link->Describe() + " to connect: " + error;
      const int64_t from = TcpLink::ReadHello(fd, deadline, &error);
      if (from < 0) {
        close(fd);
        continue;
      }
      auto other = from == process ? link : std::make_shared<PeerLink>();
      other->process = from;
      other->tcp = std::make_unique<TcpLink>(fd, [this] { Wake(); });
      std::lock_guard<std::mutex> lock(mu_);
      peers_[from] = other;
    }
    return "";
  }
  std::lock_guard<std::mutex> lock(mu_);
  peers_[process] = link;
  return "";
}

std::shared_ptr<World::PeerLink> World::Peer(int64_t process) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(process);
  return it == peers_.end() ? nullptr : it->second;
}

bool World::Linked(int64_t p) const { return Peer(p) != nullptr; }

std::string World::LinkKind(int64_t p) const {  // [trace]
  auto link = Peer(p);
  return !link ? "" : link->shm ? "shm" : "tcp";
}

void World::Exchange(ExchangeSpec spec, ExchangeDone done) {
  auto p = std::make_unique<Pending>();
  p->spec = std::move(spec);
  p->done = std::move(done);
  p->blobs.assign(p->spec.peers.size(), nullptr);
  for (int64_t q : p->spec.peers) {
    auto link = Peer(q);
    if (!link) {
      p->done("process " + std::to_string(q) +
                  " is not linked to this one (jaxcomm links the processes of a group when a "
                  "program using it is lowered, through jax.distributed)",
              false, {});
      return;
    }
    p->links.push_back(std::move(link));
  }
  // The peers are often there already, or within microseconds: finish on this thread.
  const auto spin_until = Clock::now() + Registry::Get().spin();
  while (true) {
    if (Advance(*p)) return;
    if (Clock::now() >= spin_until) break;
    std::this_thread::yield();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(std::move(p));
  }
  Wake();
}

bool World::Advance(Pending& p) {
  const ExchangeSpec& s = p.spec;
  std::string error;
  if (!p.published) {
    bool any_shm = false;
    for (auto& link : p.links) any_shm |= link->shm != nullptr;
    if (any_shm) {
      size_t bytes = 0;
      for (const auto& [ptr, n] : s.mine) bytes += n;
      SlotEntry* slot = shm_->Slot(s.key, s.fingerprint, bytes, &error);
      if (!slot) {
        p.done(error, false, {});
        return true;
      }
      // The peers must have read the previous round before it is overwritten.
      if (s.seq > 1) {
        for (auto& link : p.links) {
          if (!link->shm) continue;
          std::lock_guard<std::mutex> lock(link->mu);
          const SlotEntry* theirs = link->shm->Find(s.key);
          if (!theirs || theirs->done.load(std::memory_order_acquire) < s.seq - 1) {
            error = Failure(p);
            if (!error.empty()) {
              p.done(error, Clock::now() >= s.deadline, {});
              return true;
            }
            return false;
          }
        }
      }
      char* dst = shm_->Data(*slot);
      for (const auto& [ptr, n] : s.mine) {
        if (n > 0) std::memcpy(dst, ptr, n);
        dst += n;
      }
      slot->published.store(s.seq, std::memory_order_release);
    }
    for (auto& link : p.links) {
      if (!link->tcp) continue;
      error = link->tcp->Send(s.key, s.seq, s.fingerprint, s.mine, s.deadline);
      if (!error.empty()) {
        p.done("sending to " + link->Describe() + " " + s.peer_desc[&link - p.links.data()] + ": " + error,
               false, {});
        return true;
      }
    }
    p.published = true;
  }
  for (size_t i = 0; i < p.links.size(); ++i) {
    if (p.blobs[i]) continue;
    PeerLink& link = *p.links[i];
    uint64_t fingerprint = 0, bytes = 0;
    const char* data = nullptr;
    if (link.shm) {
      std::lock_guard<std::mutex> lock(link.mu);
      const SlotEntry* e = link.shm->Find(s.key);
      if (!e || e->published.load(std::memory_order_acquire) < s.seq) continue;
      fingerprint = e->fingerprint;
      bytes = e->bytes;
      data = link.shm->Data(*e, &error);
      if (!data) {
        p.done("reading the shared memory of " + link.Describe() + ": " + error, false, {});
        return true;
      }
    } else {
      const TcpLink::Frame* f = link.tcp->Find(s.key, s.seq);
      if (!f) continue;
      fingerprint = f->fingerprint;
      bytes = f->bytes.size();
      data = f->bytes.data();
    }
    if (fingerprint != s.fingerprint || bytes != s.peer_bytes[i]) {
      p.done(link.Describe() + " with " + s.peer_desc[i] +
                 " runs a different collective at this call (op, dtype or shape differ: " +
                 std::to_string(bytes) + " bytes of operands where this process expects " +
                 std::to_string(s.peer_bytes[i]) + "); the processes run different programs",
             false, {});
      return true;
    }
    p.blobs[i] = data == nullptr ? "" : data;
    ++p.gathered;
  }
  if (p.gathered == p.links.size()) {
    p.done("", false, p.blobs);
    return true;
  }
  error = Failure(p);
  if (!error.empty()) {
    p.done(error, Clock::now() >= s.deadline, {});
    return true;
  }
  return false;
}

std::string World::Failure(Pending& p) {
  const auto now = Clock::now();
  const ExchangeSpec& s = p.spec;
  if (now < p.next_check && now < s.deadline) return "";
  p.next_check = now + kLivenessPeriod;
  for (size_t i = 0; i < p.links.size(); ++i) {
    PeerLink& link = *p.links[i];
    std::string gone;
    if (link.tcp) gone = link.tcp->failure();
    if (gone.empty() && link.shm) gone = ProcessGone(link.pid);
    if (!gone.empty()) {
      return link.Describe() + " with " + s.peer_desc[i] + " failed: " + gone +
             (p.blobs[i] ? " after it arrived at this call" : " before it arrived at this call");
    }
  }
  if (now < s.deadline) return "";
  std::ostringstream msg;
  msg << "timed out (timeout_s / JAXCOMM_TIMEOUT_S) waiting for ";
  bool first = true;
  for (size_t i = 0; i < p.links.size(); ++i) {
    if (p.blobs[i]) continue;
    msg << (first ? "" : "; ") << p.links[i]->Describe() << " with " << s.peer_desc[i];
    first = false;
  }
  if (first) {
    msg << "the peers to finish reading this process's previous round of this call";
  } else {
    msg << ", which did not arrive at this call";
  }
  return msg.str();
}

void World::Release(uint64_t key, int64_t seq, const std::vector<int64_t>& peers) {
  bool any_shm = false;
  for (int64_t q : peers) {
    auto link = Peer(q);
    if (!link) continue;
    if (link->tcp) link->tcp->Drop(key, seq);
    any_shm |= link->shm != nullptr;
  }
  if (any_shm) {
    // The slot exists: this process published into it for this round.
    if (SlotEntry* slot = shm_->Find(key)) {
      slot->done.store(seq, std::memory_order_release);
    }
  }
}

void World::Wake() {
  wakes_.fetch_add(1, std::memory_order_release);
  cv_.notify_one();
}

void World::Progress() {
  std::vector<std::unique_ptr<Pending>> mine;
  auto last_progress = Clock::now();
  auto nap = std::chrono::microseconds(20);
  while (!stop_.load()) {
    const int wakes = wakes_.load(std::memory_order_acquire);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& p : pending_) mine.push_back(std::move(p));
      pending_.clear();
    }
    bool progressed = false;
    for (auto& p : mine) {
      const size_t before = p->gathered;
      if (Advance(*p)) {
        p.reset();
        progressed = true;
      } else {
        progressed |= p->gathered != before;
      }
    }
    mine.erase(std::remove(mine.begin(), mine.end(), nullptr), mine.end());
    const auto now = Clock::now();
    if (progressed) {
      last_progress = now;
      nap = std::chrono::microseconds(20);
      continue;
    }
    if (!mine.empty() && now - last_progress < Registry::Get().spin()) {
      std::this_thread::yield();
      continue;
    }
    // Sleep until woken (a new exchange, a TCP frame) or, with exchanges waiting on
    // shared memory, a short nap that grows while nothing happens. Never unbounded.
    std::unique_lock<std::mutex> lock(mu_);
    auto limit = mine.empty() ? std::chrono::microseconds(1000000) : nap;
    cv_.wait_for(lock, limit, [&] { return stop_.load() || wakes_.load() != wakes; });
    nap = std::min(nap * 2, std::chrono::duration_cast<std::chrono::microseconds>(kMaxNap));
  }
}

}  // namespace jaxcomm::cpu
