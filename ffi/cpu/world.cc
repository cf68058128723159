#include "cpu/world.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <tuple>

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

// One step of waiting for a peer process that is likely running on another core: a
// burst of pause instructions (the peer's flag shows up within ~100 ns), and every 16th
// step a yield, so that with more runnable threads than cores the peer gets the core.
void SpinStep(int& step) {
  if (++step % 16 == 0) {
    std::this_thread::yield();
    return;
  }
  for (int i = 0; i < 32; ++i) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
}

// Which of a slot's two buffers a round uses.
size_t Parity(int64_t seq) { return static_cast<size_t>(seq & 1); }

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
  std::vector<bool> left_out;  // tolerant exchanges: peers given up on
  bool awaiting_admission = false;  // a restarted process before the survivors readmit it
  bool join_posted = false;
  size_t settled = 0;          // peers gathered or left out
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

std::string World::Link(int64_t process, const std::string& host, const std::string& label,
                        const Endpoint& peer, bool shared_memory, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  if (process_ < 0) return "jaxcomm's endpoint is not open";
  if (Peer(process)) return "";
  auto link = std::make_shared<PeerLink>();
  link->process = process;
  link->host = label;
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
      if (from != process) other->host = "(not yet linked)";
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
  const auto& peers = p->spec.plan->peers;
  p->blobs.assign(peers.size(), nullptr);
  p->left_out.assign(peers.size(), false);
  // Peers usually arrive within microseconds: checking their health (syscalls and a
  // /proc read) before then would cost more than the whole exchange.
  p->next_check = Clock::now() + kLivenessPeriod;
  for (size_t i = 0; i < peers.size(); ++i) {
    auto link = Peer(peers[i]);
    if (!link) {
      p->done("process " + std::to_string(peers[i]) +
                  " is not linked to this one (jaxcomm links the processes of a group when a "
                  "program using it is lowered, through jax.distributed)",
              false, {});
      return;
    }
    if (Excluded(peers[i])) {
      if (!p->spec.tolerant) {
        p->done(link->Describe() + " with " + p->spec.plan->peer_desc[i] +
                    " was left out of the job after it failed in a fault-tolerant collective",
                false, {});
        return;
      }
      p->left_out[i] = true;
      ++p->settled;
    }
    p->links.push_back(std::move(link));
  }
  if (p->spec.tolerant && p->spec.plan->agreement) {
    PollJoins();
    if (joining_ != 0) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = seq_offset_.find(p->spec.plan->key);
      if (it != seq_offset_.end()) {
        p->spec.seq += it->second;
      } else {
        p->awaiting_admission = true;
      }
    }
  }
  if (p->spec.tolerant && p->spec.plan->agreement) {
    // Phase 1 gathers what arrives; phase 2 makes the survivors agree on it.
    auto then = std::move(p->done);
    const auto deadline = p->spec.deadline;
    std::shared_ptr<const ExchangePlan> plan = p->spec.plan;
    Pending* raw = p.get();  // its spec.seq may still change (readmission)
    p->done = [this, then, plan, raw, deadline](const std::string& error, bool timed_out,
                                                const std::vector<const char*>& blobs) {
      if (!error.empty()) return then(error, timed_out, blobs);
      Agree(plan, raw->spec.seq, deadline, blobs, then);
    };
  }
  // The peers are often there already, or within microseconds: finish on this thread.
  const auto spin_until = Clock::now() + Registry::Get().spin();
  int step = 0;
  while (true) {
    if (Advance(*p)) return;
    if (Clock::now() >= spin_until) break;
    SpinStep(step);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(std::move(p));
  }
  Wake();
}

void World::Agree(std::shared_ptr<const ExchangePlan> plan, int64_t seq,
                  std::chrono::steady_clock::time_point deadline, std::vector<const char*> blobs,
                  ExchangeDone then) {
  // Every process states whom it heard from, over the group's processes in one order
  // (sorted, this one included); a process counts when every survivor heard from it.
  std::vector<int64_t> all = plan->peers;
  all.push_back(process_);
  std::sort(all.begin(), all.end());
  // The message: one byte per process (heard from it), then per process the generation of
  // the rejoin request this process has seen from it (0: none).
  const size_t P = all.size();
  auto message = std::make_shared<std::vector<char>>(P * (1 + sizeof(uint64_t)), 0);
  PollJoins();
  for (size_t k = 0; k < P; ++k) {
    uint64_t seen = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = seen_join_.find(all[k]); it != seen_join_.end()) seen = it->second;
    }
    std::memcpy(message->data() + P + k * sizeof(uint64_t), &seen, sizeof(seen));
    if (all[k] == process_) {
      (*message)[k] = 1;
      continue;
    }
    const size_t i = std::find(plan->peers.begin(), plan->peers.end(), all[k]) - plan->peers.begin();
    (*message)[k] = blobs[i] != nullptr;
    if (!blobs[i]) Exclude(all[k]);
  }
  ExchangeSpec spec;
  spec.plan = plan->agreement;
  spec.seq = seq;
  spec.tolerant = true;
  spec.mine = {{message->data(), message->size()}};
  // The survivors are all here already, or gone: a second full timeout is not needed,
  // but a slow one gets the same margin as the first phase had.
  spec.deadline = std::max(deadline, Clock::now()) + std::chrono::seconds(1);
  Exchange(std::move(spec), [this, plan, blobs, message, all, then](
                                const std::string& error, bool timed_out,
                                const std::vector<const char*>& views) mutable {
    if (!error.empty()) return then(error, timed_out, {});
    const size_t me = std::find(all.begin(), all.end(), process_) - all.begin();
    for (const char* v : views) {
      if (v != nullptr && v[me] == 0) {
        // The others did not hear from this process in time and went on without it.
        return then("the other processes left this process out of this call (it arrived after "
                    "their deadline); it stays out until it rejoins (jaxcomm.ft.rejoin)",
                    false, {});
      }
    }
    for (size_t i = 0; i < plan->peers.size(); ++i) {
      const size_t k = std::find(all.begin(), all.end(), plan->peers[i]) - all.begin();
      bool counted = blobs[i] != nullptr && views[i] != nullptr;
      for (size_t j = 0; j < views.size() && counted; ++j) {
        if (views[j] != nullptr && views[j][k] == 0) counted = false;
      }
      if (!counted) {
        blobs[i] = nullptr;
        Exclude(plan->peers[i]);
      }
    }
    // After the exclusions above: a process readmitted now takes part from the next round.
    Admit(all, *message, views);
    then("", false, blobs);
  });
}

void World::Admit(const std::vector<int64_t>& all, const std::vector<char>& mine,
                  const std::vector<const char*>& views) {
  // A process left out comes back from the next round when every survivor that answered
  // has seen its request: they all decide alike, from the same messages.
  const size_t P = all.size();
  auto seen_in = [P](const char* message, size_t k) {
    uint64_t g;
    std::memcpy(&g, message + P + k * sizeof(uint64_t), sizeof(g));
    return g;
  };
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t k = 0; k < P; ++k) {
    if (!excluded_.count(all[k])) continue;
    uint64_t g = seen_in(mine.data(), k);
    for (const char* v : views) {
      if (v != nullptr) g = std::min(g, seen_in(v, k));
    }
    if (g != 0 && g > admitted_join_[all[k]]) {
      admitted_join_[all[k]] = g;
      excluded_.erase(all[k]);
    }
  }
}

void World::PollJoins() {
  if (!shm_) return;
  std::vector<int64_t> candidates;
  {
    std::lock_guard<std::mutex> lock(mu_);
    candidates.assign(excluded_.begin(), excluded_.end());
  }
  for (int64_t q : candidates) {
    if (q < 0 || q >= kMaxJoinProcesses) continue;
    const JoinRequest& j = shm_->block().joins[q];
    const uint64_t g = j.generation.load(std::memory_order_acquire);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (g == 0 || g <= seen_join_[q]) continue;
    }
    std::string error;
    auto link = std::make_shared<PeerLink>();
    link->process = q;
    link->pid = j.pid;
    link->shm = ShmPeer::Open(j.pid, j.control_fd, j.control_bytes, &error);
    if (!link->shm) continue;  // it died again before we could map it: stays out
    std::lock_guard<std::mutex> lock(mu_);
    if (auto old = peers_.find(q); old != peers_.end()) link->host = old->second->host;
    peers_[q] = link;
    seen_join_[q] = g;
  }
}

std::string World::Rejoin(uint64_t generation) {
  std::lock_guard<std::mutex> lock(mu_);
  if (process_ < 0 || !shm_) return "rejoining needs this process's shared-memory endpoint open";
  for (const auto& [q, link] : peers_) {
    if (link->tcp) {
      return "rejoining over TCP is not supported (process " + std::to_string(q) +
             " is linked by TCP); it works between processes of one host";
    }
  }
  joining_ = generation;
  return "";
}

bool World::TryAdmission(Pending& p, std::string* error) {
  const ExchangePlan& plan = *p.spec.plan;
  const ExchangePlan& agreement = *plan.agreement;
  std::vector<int64_t> all = plan.peers;
  all.push_back(process_);
  std::sort(all.begin(), all.end());
  const size_t P = all.size();
  const size_t me = std::find(all.begin(), all.end(), process_) - all.begin();
  for (auto& link : p.links) {
    if (!link->shm) {
      *error = "rejoining needs shared memory with every peer; " + link->Describe() + " is linked by TCP";
      return true;
    }
  }
  if (!p.join_posted) {
    // Posted on the first fault-tolerant call, when this process is ready to take part.
    for (auto& link : p.links) {
      std::lock_guard<std::mutex> lock(link->mu);
      link->shm->RequestJoin(process_, joining_, getpid(), shm_->control_fd(), shm_->control_bytes());
    }
    p.join_posted = true;
  }
  // The survivors' newest agreement messages: they say who took part and what they saw.
  std::vector<std::pair<int64_t, std::vector<char>>> snaps;
  for (auto& link : p.links) {
    std::lock_guard<std::mutex> lock(link->mu);
    snaps.push_back(link->shm->Snapshot(agreement.key));
  }
  int64_t newest = 0;
  const std::vector<char>* reference = nullptr;
  for (const auto& [seq, bytes] : snaps) {
    if (seq > newest && bytes.size() == P * (1 + sizeof(uint64_t))) {
      newest = seq;
      reference = &bytes;
    }
  }
  if (reference == nullptr) return false;
  for (size_t i = 0; i < p.links.size(); ++i) {
    const size_t k = std::find(all.begin(), all.end(), plan.peers[i]) - all.begin();
    if ((*reference)[k] == 0) continue;  // not a participant of that round
    const auto& [seq, bytes] = snaps[i];
    if (seq != newest) return false;  // not all there yet: look again
    uint64_t seen;
    std::memcpy(&seen, bytes.data() + P + me * sizeof(uint64_t), sizeof(seen));
    if (seen < joining_) return false;  // readmitted at a later round
  }
  // Readmitted from round newest + 1 of this call: adopt its numbering, take the
  // survivors' view of who is out, and mark this process's slots as read up to there,
  // so that the survivors never wait on rounds it did not take part in.
  const int64_t join = newest + 1;
  size_t bytes = 0;
  for (const auto& [ptr, n] : p.spec.mine) bytes += n;
  for (const auto& [key, fp, n] : {std::make_tuple(plan.key, plan.fingerprint, bytes),
                                   std::make_tuple(agreement.key, agreement.fingerprint,
                                                   P * (1 + sizeof(uint64_t)))}) {
    SlotEntry* slot = shm_->Slot(key, fp, n, error);
    if (!slot) return true;
    slot->published.store(join - 1, std::memory_order_release);
    slot->done.store(join - 1, std::memory_order_release);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    seq_offset_[plan.key] = join - p.spec.seq;
    for (size_t k = 0; k < P; ++k) {
      if (k != me && (*reference)[k] == 0) excluded_.insert(all[k]);
    }
  }
  for (size_t i = 0; i < p.links.size(); ++i) {
    if (Excluded(plan.peers[i]) && !p.left_out[i]) {
      p.left_out[i] = true;
      ++p.settled;
    }
  }
  p.spec.seq = join;
  p.awaiting_admission = false;
  return true;
}

bool World::Excluded(int64_t process) const {
  std::lock_guard<std::mutex> lock(mu_);
  return excluded_.count(process) > 0;
}

void World::Exclude(int64_t process) {
  std::lock_guard<std::mutex> lock(mu_);
  excluded_.insert(process);
}

std::vector<int64_t> World::excluded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::vector<int64_t>(excluded_.begin(), excluded_.end());
}

bool World::Advance(Pending& p) {
  const ExchangeSpec& s = p.spec;
  const ExchangePlan& plan = *s.plan;
  std::string error;
  if (p.awaiting_admission) {
    if (!TryAdmission(p, &error)) {
      if (Clock::now() < s.deadline) return false;
      error = "the other processes did not readmit this restarted process before the deadline";
    }
    if (!error.empty()) {
      p.done(error, true, {});
      return true;
    }
  }
  if (!p.published) {
    bool any_shm = false;
    for (auto& link : p.links) any_shm |= link->shm != nullptr;
    if (any_shm) {
      size_t bytes = 0;
      for (const auto& [ptr, n] : s.mine) bytes += n;
      SlotEntry* slot = shm_->Slot(plan.key, plan.fingerprint, bytes, &error);
      if (!slot) {
        p.done(error, false, {});
        return true;
      }
      // Slots are double-buffered by the round's parity: the peers must have read the
      // round before the previous one before its buffer is overwritten.
      if (s.seq > 2) {
        for (size_t i = 0; i < p.links.size(); ++i) {
          PeerLink& link = *p.links[i];
          if (!link.shm || p.left_out[i]) continue;
          std::lock_guard<std::mutex> lock(link.mu);
          const SlotEntry* theirs = link.shm->Find(plan.key);
          if (!theirs || theirs->done.load(std::memory_order_acquire) < s.seq - 2) {
            if (Failure(p, &error)) {
              p.done(error, Clock::now() >= s.deadline, {});
              return true;
            }
            return false;
          }
        }
      }
      char* dst = shm_->Data(*slot) + Parity(s.seq) * bytes;
      for (const auto& [ptr, n] : s.mine) {
        if (n > 0) std::memcpy(dst, ptr, n);
        dst += n;
      }
      slot->published.store(s.seq, std::memory_order_release);
    }
    for (size_t i = 0; i < p.links.size(); ++i) {
      PeerLink& link = *p.links[i];
      if (!link.tcp || p.left_out[i]) continue;
      error = link.tcp->Send(plan.key, s.seq, plan.fingerprint, s.mine, s.deadline);
      if (error.empty()) continue;
      if (s.tolerant) {
        p.left_out[i] = true;
        ++p.settled;
        continue;
      }
      p.done("sending to " + link.Describe() + " with " + plan.peer_desc[i] + ": " + error, false, {});
      return true;
    }
    p.published = true;
  }
  for (size_t i = 0; i < p.links.size(); ++i) {
    if (p.blobs[i] || p.left_out[i]) continue;
    PeerLink& link = *p.links[i];
    uint64_t fingerprint = 0, bytes = 0;
    const char* data = nullptr;
    if (link.shm) {
      std::lock_guard<std::mutex> lock(link.mu);
      const SlotEntry* e = link.shm->Find(plan.key);
      if (!e || e->published.load(std::memory_order_acquire) < s.seq) continue;
      fingerprint = e->fingerprint;
      bytes = e->bytes;
      data = link.shm->Data(*e, &error);
      if (!data) {
        p.done("reading the shared memory of " + link.Describe() + ": " + error, false, {});
        return true;
      }
      data += Parity(s.seq) * bytes;
    } else {
      const TcpLink::Frame* f = link.tcp->Find(plan.key, s.seq);
      if (!f) continue;
      fingerprint = f->fingerprint;
      bytes = f->bytes.size();
      data = f->bytes.empty() ? "" : f->bytes.data();  // non-null: it arrived
    }
    if (fingerprint != plan.fingerprint || bytes != plan.peer_bytes[i]) {
      p.done(link.Describe() + " with " + plan.peer_desc[i] +
                 " runs a different collective at this call (op, dtype or shape differ: " +
                 std::to_string(bytes) + " bytes of operands where this process expects " +
                 std::to_string(plan.peer_bytes[i]) + "); the processes run different programs",
             false, {});
      return true;
    }
    p.blobs[i] = data;
    ++p.settled;
  }
  if (p.settled == p.links.size()) {
    p.done("", false, p.blobs);
    return true;
  }
  if (Failure(p, &error)) {
    p.done(error, Clock::now() >= s.deadline, {});
    return true;
  }
  // A tolerant exchange may have given up on its last missing peer just now.
  if (p.settled == p.links.size()) {
    p.done("", false, p.blobs);
    return true;
  }
  return false;
}

bool World::Failure(Pending& p, std::string* error) {
  const auto now = Clock::now();
  const ExchangeSpec& s = p.spec;
  const ExchangePlan& plan = *s.plan;
  if (now < p.next_check && now < s.deadline) return false;
  p.next_check = now + kLivenessPeriod;
  for (size_t i = 0; i < p.links.size(); ++i) {
    if (p.left_out[i]) continue;
    PeerLink& link = *p.links[i];
    std::string gone;
    if (link.tcp) gone = link.tcp->failure();
    if (gone.empty() && link.shm) gone = ProcessGone(link.pid);
    if (gone.empty()) continue;
    if (s.tolerant) {
      // Its contribution counts if it arrived before the end (shared memory outlives it).
      if (!p.blobs[i]) {
        p.left_out[i] = true;
        ++p.settled;
      }
      continue;
    }
    *error = link.Describe() + " with " + plan.peer_desc[i] + " failed: " + gone +
             (p.blobs[i] ? " after it arrived at this call" : " before it arrived at this call");
    return true;
  }
  if (now < s.deadline) return false;
  if (s.tolerant) {
    for (size_t i = 0; i < p.links.size(); ++i) {
      if (!p.blobs[i] && !p.left_out[i]) {
        p.left_out[i] = true;
        ++p.settled;
      }
    }
    return false;
  }
  std::ostringstream msg;
  msg << "timed out (timeout_s / JAXCOMM_TIMEOUT_S) waiting for ";
  bool first = true;
  for (size_t i = 0; i < p.links.size(); ++i) {
    if (p.blobs[i]) continue;
    msg << (first ? "" : "; ") << p.links[i]->Describe() << " with " << plan.peer_desc[i];
    first = false;
  }
  if (first) {
    msg << "the peers to finish reading this process's previous round of this call";
  } else {
    msg << ", which did not arrive at this call";
  }
  *error = msg.str();
  return true;
}

void World::Release(const ExchangePlan& plan, int64_t seq) {
  if (plan.agreement && joining_ != 0) {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = seq_offset_.find(plan.key); it != seq_offset_.end()) seq += it->second;
  }
  ReleaseRound(plan, seq);
}

void World::ReleaseRound(const ExchangePlan& plan, int64_t seq) {
  const uint64_t key = plan.key;
  bool any_shm = false;
  for (int64_t q : plan.peers) {
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
  if (plan.agreement) ReleaseRound(*plan.agreement, seq);
}

void World::Wake() {
  wakes_.fetch_add(1, std::memory_order_release);
  cv_.notify_one();
}

void World::Progress() {
  std::vector<std::unique_ptr<Pending>> mine;
  auto last_progress = Clock::now();
  auto nap = std::chrono::microseconds(20);
  int spin_step = 0;
  while (!stop_.load()) {
    const int wakes = wakes_.load(std::memory_order_acquire);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& p : pending_) mine.push_back(std::move(p));
      pending_.clear();
    }
    bool progressed = false;
    for (auto& p : mine) {
      const size_t before = p->settled;
      if (Advance(*p)) {
        p.reset();
        progressed = true;
      } else {
        progressed |= p->settled != before;
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
      SpinStep(spin_step);
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
