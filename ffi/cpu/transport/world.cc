#include "cpu/transport/world.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "core/cpu_affinity.h"
#include "core/registry.h"
#include "core/thread_name.h"
#include "cpu/transport/factory.h"
#include "cpu/transport/world_internal.h"

namespace jaxcomm::cpu {
namespace {

using Clock = std::chrono::steady_clock;

// The progress thread's longest sleep while exchanges wait: peers ring its doorbell
// (shared memory) or its TCP reader wakes it, so this only paces the liveness checks.
constexpr auto kMaxNap = std::chrono::microseconds(5000);
// ... and while none waits: late connections (rejoining processes) are accepted this often.
constexpr auto kIdleNap = std::chrono::microseconds(50000);

// A pause takes 25 ns on the development VM: bursts of 32 pauses between checks noticed
// a peer's flag 0.4 us late on average, a fifth of a 4 B all_reduce between 2 processes.
constexpr int kPausesPerStep = 2;
// A yield every 128 steps lets a peer on the same core run about every 10-20 us.
constexpr int kStepsPerYield = 128;

}  // namespace

PeerSpin::PeerSpin(ControlBlock* mine, SharesCore shares_core)
    : mine_(mine), shares_core_(std::move(shares_core)) {}

void PeerSpin::Stop() {
  if (shown_) mine_->spinning_cpu.store(0, std::memory_order_relaxed);
  shown_ = false;
  step_ = 0;
}

void PeerSpin::Step() {
  if (++step_ % kStepsPerYield != 0) {
    for (int i = 0; i < kPausesPerStep; ++i) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#elif defined(__aarch64__)
      asm volatile("yield");
#endif
    }
    return;
  }
  // Only where each process can have a core: with more processes than cores, sharing one is
  // unavoidable and the yield hands it over soonest.
  static const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int cpu = mine_ != nullptr && Registry::Get().host_processes() <= cores ? CurrentCore() : -1;
  if (cpu >= 0) {
    mine_->spinning_cpu.store(cpu + 1, std::memory_order_relaxed);
    shown_ = true;
    if (shares_core_ && shares_core_(cpu) && LeaveCore(cpu)) {
      // At once, or the peer could take the stale core for this one's and follow it.
      mine_->spinning_cpu.store(CurrentCore() + 1, std::memory_order_relaxed);
      Registry::Get().core_moves.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  std::this_thread::yield();
}

bool World::AnySpinsOn(const Links& links, int cpu) {
  return std::any_of(links.begin(), links.end(), [cpu](const auto& link) { return link->SpinsOn(cpu); });
}

bool World::Uses(const Links& links, const Transport& transport) {
  return std::any_of(links.begin(), links.end(), [&transport](const auto& link) { return &link->local() == &transport; });
}

World::World() = default;

World::~World() {
  stop_.store(true);
  Wake();
  if (progress_.joinable()) progress_.join();
}

Endpoints World::Open(int64_t process, const std::string& host, const std::string& label,
                       const std::vector<std::pair<std::string, Params>>& transports, std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (process_ >= 0 && process_ != process) {
    *error = "jaxcomm's endpoint was opened as process " + std::to_string(process_) + ", not " +
             std::to_string(process);
    return {};
  }
  if (process_ < 0) {
    if (transports.empty()) {
      *error = "no transport to open";
      return {};
    }
    TransportContext context;
    context.process = process;
    context.wake = [this] { Wake(); };
    std::vector<std::unique_ptr<Transport>> opened;
    for (const auto& [name, settings] : transports) {
      auto transport = OpenTransport(name, context, settings, error);
      if (!transport) {
        *error = "opening its " + name + " transport: " + *error;
        return {};
      }
      opened.push_back(std::move(transport));
    }
    owned_ = std::move(opened);
    for (const auto& t : owned_) {
      transports_.push_back(t.get());
      if (!shm_) shm_ = t->shared_memory();
    }
    process_ = process;
    host_ = host;
    self_ = "process " + std::to_string(process) + " (host " + label + ", pid " + std::to_string(getpid()) + ")";
    progress_ = std::thread([this] {
      NameThisThread("jaxcomm-prog");
      Progress();
    });
  }
  Endpoints endpoints;
  for (Transport* t : transports_) endpoints[t->caps().name] = t->Endpoint();
  return endpoints;
}

std::string World::Link(const PeerIdentity& who, const Endpoints& theirs, std::chrono::milliseconds timeout,
                        bool rejoining) {
  const auto deadline = Clock::now() + timeout;
  if (process_ < 0) return "jaxcomm's endpoint is not open";
  if (auto known = Peer(who.process)) {
    // Linked already; a restarted process's new link (PollJoins) learns who it is here.
    std::lock_guard<std::mutex> lock(mu_);
    if (known->peer.pid == 0) known->peer = who;
    return "";
  }
  std::string tried;
  for (Transport* transport : transports_) {
    const Capabilities& caps = transport->caps();
    auto endpoint = theirs.find(caps.name);
    if (endpoint == theirs.end()) continue;
    if (caps.shared_memory && who.host_key != host_) continue;  // reaches this host only
    std::string error;
    auto link = transport->Link({who, endpoint->second, deadline, rejoining}, &error);
    if (!link) return "linking " + who.Describe() + " through " + caps.name + ": " + error;
    link->peer = who;
    std::lock_guard<std::mutex> lock(mu_);
    peers_[who.process] = link;
    int same_host = 1;
    for (const auto& [q, l] : peers_) same_host += l->shared_memory() != nullptr;
    Registry::Get().set_host_processes(same_host);
    return "";
  }
  std::string mine, its;
  for (Transport* t : transports_) mine += (mine.empty() ? "" : ", ") + t->caps().name;
  for (const auto& [name, params] : theirs) its += (its.empty() ? "" : ", ") + name;
  return "no transport links this process to " + who.Describe() + " (this one opened " + mine + "; it opened " +
         (its.empty() ? "none" : its) + "): the processes were given different JAXCOMM_TRANSPORT settings?";
}

void World::Close() {
  for (Transport* t : transports_) t->Close();
}

int64_t World::refused_connections() const {
  int64_t refused = 0;
  for (Transport* t : transports_) refused += t->refused();
  return refused;
}

std::shared_ptr<PeerTransport> World::Peer(int64_t process) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(process);
  return it == peers_.end() ? nullptr : it->second;
}

World::Links World::Peers(const std::vector<int64_t>& processes) const {
  Links links;
  links.reserve(processes.size());
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t q : processes) {
    if (auto it = peers_.find(q); it != peers_.end()) links.push_back(it->second);
  }
  return links;
}

bool World::Linked(int64_t p) const {
  // A peer that connected on its own (TCP, taken by the progress thread) is linked once
  // the bootstrap told us who it is (pid, host), not before.
  auto link = Peer(p);
  std::lock_guard<std::mutex> lock(mu_);
  return link && link->peer.pid != 0;
}

std::string World::HostOf(int64_t p) const {
  if (p == process_) return host_;
  auto link = Peer(p);
  return link ? link->peer.host_key : "";
}

const LinkCapabilities* World::LinkOf(int64_t p) const {
  auto link = Peer(p);
  return link ? &link->local().caps() : nullptr;
}

void World::Exchange(ExchangeSpec spec, ExchangeDone done) {
  if (any_refused_.load(std::memory_order_relaxed)) {
    if (std::string why = Refused(spec.plan->key, spec.seq); !why.empty()) return done(why, false, {});
  }
  auto p = std::make_unique<Pending>();
  p->spec = std::move(spec);
  p->done = std::move(done);
  const auto& peers = p->spec.plan->peers;
  p->blobs.assign(peers.size(), nullptr);
  p->left_out.assign(peers.size(), false);
  p->published = p->spec.published;
  // Peers usually arrive within microseconds: checking their health (syscalls and a
  // /proc read) before then would cost more than the whole exchange. A dead peer is
  // still noticed within milliseconds, then every kLivenessPeriod.
  const auto start = Clock::now();
  p->next_check = start + kFirstLivenessCheck;
  p->start = start;
  if (!p->spec.tolerant) {
    p->grace = MismatchGrace(std::chrono::duration_cast<std::chrono::milliseconds>(p->spec.deadline - start));
  }
  p->links.reserve(peers.size());
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
  const auto spin_until = start + Registry::Get().spin();
  PeerSpin spin(Block(), [links = &p->links](int cpu) { return AnySpinsOn(*links, cpu); });
  while (true) {
    if (Advance(*p)) return;
    if (Clock::now() >= spin_until) break;
    spin.Step();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(std::move(p));
  }
  Wake();
}

// An inline exchange (core/cross_process.h) over shared memory: the slot protocol of
// ShmTransport (shm_transport.h), with every lookup done once when it is opened (this
// process's slot, the peers' links), the peers' slots and data found on first use, and
// the wait a spin of the calling thread. It never fails a round: whatever is not plainly the peers'
// contributions arriving (a mismatch, a dead peer, a deadline) is left to Exchange.
class World::ShmInline final : public InlineExchange {
 public:
  ShmInline(World& world, std::shared_ptr<const ExchangePlan> plan, SlotEntry* slot, char* data, Links links,
            std::vector<ShmPeerTransport*> shm)
      : world_(world), plan_(std::move(plan)), slot_(slot), data_(data), links_(std::move(links)),
        shm_peers_(std::move(shm)), theirs_(links_.size()), their_data_(links_.size()) {}

  Status Run(int64_t seq, const std::vector<std::pair<const void*, size_t>>& mine, Clock::time_point until,
             std::vector<const char*>& theirs) override {
    // Exchange knows what to do about a process left out, or a call refused.
    if (world_.ever_excluded_.load(std::memory_order_relaxed) || world_.any_refused_.load(std::memory_order_relaxed)) {
      return Status::kNotYet;
    }
    const size_t n = links_.size();
    PeerSpin spin(world_.Block(), [this](int cpu) { return AnySpinsOn(links_, cpu); });
    int steps = 0;
    // Each check of the clock costs about as much as a look at the peers' flags.
    const auto expired = [&steps, until] { return (++steps & 31) == 0 && Clock::now() >= until; };
    // The buffer of round seq - 2 is reused: every peer must have read that round.
    if (seq > 2) {
      for (size_t i = 0; i < n; ++i) {
        while (true) {
          const SlotEntry* t = Theirs(i);
          if (t != nullptr && t->done.load(std::memory_order_acquire) >= seq - 2) break;
          if (expired()) return Status::kNotYet;
          spin.Step();
        }
      }
    }
    ShmTransport::PublishInto(*slot_, data_, seq, mine);
    for (ShmPeerTransport* peer : shm_peers_) peer->Ring();
    theirs.assign(n, nullptr);
    size_t arrived = 0;
    while (true) {
      for (size_t i = 0; i < n; ++i) {
        if (theirs[i] != nullptr) continue;
        const SlotEntry* t = Theirs(i);
        if (t == nullptr || t->published.load(std::memory_order_acquire) < seq) continue;
        // Another program, or a restarted peer: Exchange names the mismatch.
        if (t->fingerprint != plan_->fingerprint || t->bytes != plan_->peer_bytes[i]) return Status::kPublished;
        const char* data = TheirData(i, *t);
        if (data == nullptr) return Status::kPublished;
        theirs[i] = data + Parity(seq) * t->bytes;
        ++arrived;
      }
      if (arrived == n) return Status::kDone;
      if (expired()) return Status::kPublished;
      spin.Step();
    }
  }

  void Release(int64_t seq) override {
    slot_->done.store(seq, std::memory_order_release);
    // A peer whose round waits on its progress thread may wait for this.
    for (ShmPeerTransport* peer : shm_peers_) peer->Ring();
  }

 private:
  // Peer i's slot of this exchange, once it made it (slots never move).
  const SlotEntry* Theirs(size_t i) {
    const SlotEntry* t = theirs_[i].load(std::memory_order_acquire);
    if (t != nullptr) return t;
    t = shm_peers_[i]->Slot(plan_->key);
    if (t != nullptr) theirs_[i].store(t, std::memory_order_release);
    return t;
  }
  // Where peer i's slot's data is mapped here (mapped on first use).
  const char* TheirData(size_t i, const SlotEntry& t) {
    const char* d = their_data_[i].load(std::memory_order_acquire);
    if (d != nullptr) return d;
    std::string error;
    d = shm_peers_[i]->Data(t, &error);
    if (d != nullptr) their_data_[i].store(d, std::memory_order_release);
    return d;
  }

  World& world_;
  const std::shared_ptr<const ExchangePlan> plan_;
  SlotEntry* const slot_;
  char* const data_;
  const Links links_;                               // keep shm_peers_ alive
  const std::vector<ShmPeerTransport*> shm_peers_;  // their shared_memory()
  std::vector<std::atomic<const SlotEntry*>> theirs_;
  std::vector<std::atomic<const char*>> their_data_;
};

std::unique_ptr<InlineExchange> World::OpenInline(std::shared_ptr<const ExchangePlan> plan, size_t my_bytes) {
  if (!shm_ || plan->agreement || plan->arrival || plan->peers.empty()) return nullptr;
  Links links;
  std::vector<ShmPeerTransport*> shm;
  for (int64_t q : plan->peers) {
    auto link = Peer(q);
    ShmPeerTransport* peer = link ? link->shared_memory() : nullptr;
    if (!peer) return nullptr;
    shm.push_back(peer);
    links.push_back(std::move(link));
  }
  std::string error;
  SlotEntry* slot = shm_->owner().Slot(plan->key, plan->fingerprint, my_bytes, &error);
  if (slot == nullptr) return nullptr;  // the first Exchange reports why
  return std::make_unique<ShmInline>(*this, std::move(plan), slot, shm_->owner().Data(*slot), std::move(links),
                                     std::move(shm));
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
    // A peer may still read what publishing this round overwrites: wait for it.
    for (size_t i = 0; i < p.links.size(); ++i) {
      if (p.left_out[i] || p.links[i]->MayPublish(plan.key, s.seq)) continue;
      if (Failure(p, &error)) {
        p.done(error, Clock::now() >= s.deadline, {});
        return true;
      }
      return false;
    }
    // Through each transport that links a peer of the round (left out or not: a
    // restarted process reads the shared copy of a round it is not in), publish once,
    // then send to each of its peers.
    const Outgoing round{plan.key, plan.fingerprint, s.seq, s.deadline};
    for (Transport* transport : transports_) {
      if (!Uses(p.links, *transport)) continue;
      error = transport->Publish(round, s.mine);
      if (!error.empty()) {
        p.done(error, false, {});
        return true;
      }
      for (size_t i = 0; i < p.links.size(); ++i) {
        PeerTransport& link = *p.links[i];
        if (&link.local() != transport || p.left_out[i]) continue;
        error = link.Send(round, s.per_peer.empty() ? s.mine : s.per_peer[i]);
        if (error.empty()) continue;
        if (s.tolerant) {
          p.left_out[i] = true;
          ++p.settled;
          continue;
        }
        p.done("sending to " + link.Describe() + " with " + plan.peer_desc[i] + ": " + error, false, {});
        return true;
      }
    }
    p.published = true;
  }
  for (size_t i = 0; i < p.links.size(); ++i) {
    if (p.blobs[i] || p.left_out[i]) continue;
    PeerTransport& link = *p.links[i];
    Arrival arrival;
    std::string unreadable;
    if (!link.Find(plan.key, s.seq, plan.fingerprint, plan.peer_bytes[i], &arrival, &unreadable)) continue;
    if (!unreadable.empty()) {
      // A peer's shared memory vanishes with it: say that it exited, not what is missing.
      const std::string gone = link.Failure();
      p.done(gone.empty() ? unreadable
                          : link.Describe() + " with " + plan.peer_desc[i] + " failed: " + gone +
                                " after it arrived at this call",
             false, {});
      return true;
    }
    if (arrival.fingerprint != plan.fingerprint || arrival.bytes != plan.peer_bytes[i]) {
      p.done(link.Describe() + " with " + plan.peer_desc[i] +
                 " runs a different collective at this call (op, dtype or shape differ: " +
                 std::to_string(arrival.bytes) + " bytes of operands where this process expects " +
                 std::to_string(plan.peer_bytes[i]) + "); the processes run different programs",
             false, {});
      return true;
    }
    p.blobs[i] = arrival.data;
    ++p.settled;
  }
  if (p.settled == p.links.size() && SendsDone(p)) {
    p.done("", false, p.blobs);
    return true;
  }
  if (Failure(p, &error)) {
    p.done(error, Clock::now() >= s.deadline, {});
    return true;
  }
  // A tolerant exchange may have given up on its last missing peer just now.
  if (p.settled == p.links.size() && SendsDone(p)) {
    p.done("", false, p.blobs);
    return true;
  }
  return false;
}

bool World::SendsDone(const Pending& p) {
  const ExchangeSpec& s = p.spec;
  for (size_t i = 0; i < p.links.size(); ++i) {
    PeerTransport& link = *p.links[i];
    if (!p.left_out[i] && link.local().caps().sends_complete_later &&
        !link.Delivered(s.plan->key, s.seq)) {
      return false;
    }
  }
  return true;
}

bool World::Failure(Pending& p, std::string* error) {
  const auto now = Clock::now();
  const ExchangeSpec& s = p.spec;
  const ExchangePlan& plan = *s.plan;
  // A TCP link that failed (its receiver saw the peer's connection close) is looked at
  // at once: only the checks that cost system calls wait for their period.
  bool link_failed = false;
  for (size_t i = 0; i < p.links.size(); ++i) {
    link_failed |= !p.left_out[i] && p.links[i]->Failed();
  }
  if (now < p.next_check && now < s.deadline && !link_failed) return false;
  p.next_check = now + kLivenessPeriod;
  // Before the peers' health: a peer that found the mismatch first may have exited.
  if (p.grace.count() > 0 && now - p.start >= p.grace && Mismatch(p, error)) return true;
  for (size_t i = 0; i < p.links.size(); ++i) {
    if (p.left_out[i]) continue;
    PeerTransport& link = *p.links[i];
    const std::string gone = link.Failure();
    if (gone.empty()) continue;
    if (s.tolerant) {
      // Its contribution counts if it arrived before the end (shared memory outlives it).
      if (!p.blobs[i]) {
        p.left_out[i] = true;
        ++p.settled;
      }
      continue;
    }
    // A peer that failed as one side of a mismatch may exit at once: the mismatch, if
    // the other peers show it, is what this call fails of, not that exit.
    if (p.grace.count() > 0 && Mismatch(p, error)) return true;
    *error = link.Describe() + " with " + plan.peer_desc[i] + " failed: " + gone +
             (p.blobs[i] ? " after it arrived at this call" : " before it arrived at this call");
    return true;
  }
  for (size_t i = 0; i < plan.watched.size(); ++i) {
    auto link = Peer(plan.watched[i]);
    if (!link) continue;
    const std::string gone = link->Failure();
    if (gone.empty()) continue;
    *error = link->Describe() + " with " + plan.watched_desc[i] + " failed: " + gone +
             " (it takes part in this call through the other phases of a hierarchical round)";
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
  const Links links = Peers(plan.peers);
  for (Transport* transport : transports_) {
    if (!Uses(links, *transport)) continue;
    transport->Release(plan.key, seq);
    for (const auto& link : links) {
      if (&link->local() == transport) link->Release(plan.key, seq);
    }
  }
  if (plan.agreement) ReleaseRound(*plan.agreement, seq);
}

void World::Wake() {
  wakes_.fetch_add(1, std::memory_order_seq_cst);
  if (shm_) {
    Ring(shm_->block().bell, /*from_peer=*/false);
  } else {
    cv_.notify_one();
  }
}

bool World::AdvanceSafely(Pending& p) {
  // An exception escaping the progress thread would end the process: it fails the
  // exchange instead.
  std::string error;
  try {
    return Advance(p);
  } catch (const std::exception& e) {
    error = std::string("jaxcomm's progress thread failed on this exchange: ") + e.what();
  } catch (...) {
    error = "jaxcomm's progress thread failed on this exchange (unknown exception)";
  }
  try {
    p.done(error, false, {});
  } catch (...) {
    std::fprintf(stderr, "jaxcomm: %s; reporting it failed too\n", error.c_str());
  }
  return true;
}

void World::Progress() {
  // No exception may escape this thread (it would end the process): one that escapes an
  // exchange fails that exchange (AdvanceSafely); any other is logged, and the thread
  // goes on with the exchanges it holds.
  std::vector<std::unique_ptr<Pending>> mine;
  int logged = 0;
  while (!stop_.load()) {
    try {
      ProgressLoop(mine);
    } catch (const std::exception& e) {
      if (logged++ < 8) std::fprintf(stderr, "jaxcomm: the progress thread recovered from an error: %s\n", e.what());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    } catch (...) {
      if (logged++ < 8) std::fprintf(stderr, "jaxcomm: the progress thread recovered from an unknown error\n");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
}

void World::ProgressLoop(std::vector<std::unique_ptr<Pending>>& mine) {
  auto last_progress = Clock::now();
  PeerSpin spin(Block(), [&mine](int cpu) {
    return std::any_of(mine.begin(), mine.end(), [cpu](const auto& p) { return AnySpinsOn(p->links, cpu); });
  });
  auto next_accept = Clock::now();
  // With shared memory the thread sleeps on its doorbell, which the peers ring; it is
  // read before looking for work, so a ring during the look is never lost.
  Doorbell* bell = shm_ ? &shm_->block().bell : nullptr;
  while (!stop_.load()) {
    const uint32_t rings = bell ? bell->rings.load(std::memory_order_seq_cst) : 0;
    const int wakes = wakes_.load(std::memory_order_acquire);
    if (Clock::now() >= next_accept) {
      for (Transport* t : transports_) t->Poll();
      next_accept = Clock::now() + std::chrono::milliseconds(50);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& p : pending_) mine.push_back(std::move(p));
      pending_.clear();
    }
    bool progressed = false;
    for (auto& p : mine) {
      const size_t before = p->settled;
      if (AdvanceSafely(*p)) {
        p.reset();
        progressed = true;
      } else {
        progressed |= p->settled != before;
      }
    }
    mine.erase(std::remove(mine.begin(), mine.end(), nullptr), mine.end());
    const auto now = Clock::now();
    ShowWaits(mine, now);
    if (progressed) {
      last_progress = now;
      spin.Stop();
      continue;
    }
    if (!mine.empty() && now - last_progress < Registry::Get().spin()) {
      spin.Step();
      continue;
    }
    spin.Stop();
    if (bell && !mine.empty() && bell->awaiting_peers.load(std::memory_order_relaxed) == 0) {
      // Peers ring only a process that awaits them (Ring): say so, then look once more,
      // for what they published before they could see it.
      bell->awaiting_peers.store(1, std::memory_order_seq_cst);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      continue;
    }
    // Sleep until woken: a peer published or released a round (doorbell), a new
    // exchange or TCP frame arrived (Wake), or the nap ends. Never unbounded.
    const auto limit = mine.empty() ? kIdleNap : kMaxNap;
    if (bell) {
      if (wakes_.load() == wakes && !stop_.load()) SleepOnBell(*bell, rings, limit, !mine.empty());
    } else {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, limit, [&] { return stop_.load() || wakes_.load() != wakes; });
    }
  }
}

}  // namespace jaxcomm::cpu
