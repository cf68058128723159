#include "cpu/transport/shm_transport.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "core/registry.h"

namespace jaxcomm::cpu {

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

// ------------------------------------------------------------------ this process's side

std::unique_ptr<ShmTransport> ShmTransport::Create(int64_t process, std::string* error) {
  auto owner = ShmOwner::Create(process, error);
  if (!owner) return nullptr;
  // Under Yama's ptrace_scope 1, only a process's ancestors may read its memory; the
  // peers are its siblings. (OpenMPI's shared-memory transport does the same for its
  // single-copy reads.) Failure only leaves the streamed rounds on their ring.
  if (Registry::Get().single_copy()) prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  return std::unique_ptr<ShmTransport>(new ShmTransport(std::move(owner)));
}

std::unique_ptr<Transport> ShmTransport::Make(const TransportContext& context, const Params& /*settings*/,
                                               std::string* error) {
  return Create(context.process, error);
}

const Capabilities& ShmTransport::caps() const {
  static const Capabilities caps = [] {
    Capabilities c;
    c.name = "shm";
    c.shared_memory = true;
    return c;
  }();
  return caps;
}

Params ShmTransport::Endpoint() const {
  return {{"control_fd", std::to_string(owner_->control_fd())},
          {"control_bytes", std::to_string(owner_->control_bytes())}};
}

std::shared_ptr<PeerTransport> ShmTransport::Link(const LinkRequest& request, std::string* error) {
  int64_t fd = -1, bytes = 0;
  if (!IntField(request.endpoint, "control_fd", &fd, error) ||
      !IntField(request.endpoint, "control_bytes", &bytes, error)) {
    return nullptr;
  }
  if (request.who.pid <= 0) {
    *error = "its process id is unknown";
    return nullptr;
  }
  return Link(request.who.pid, static_cast<int>(fd), static_cast<size_t>(bytes), error);
}

std::shared_ptr<ShmPeerTransport> ShmTransport::Link(int pid, int control_fd, size_t control_bytes,
                                                     std::string* error, bool probe) {
  auto peer = ShmPeer::Open(pid, control_fd, control_bytes, error);
  if (!peer) return nullptr;
  bool direct = false;
  if (probe && Registry::Get().single_copy()) {
    // Containers' seccomp filters and ptrace policies may forbid it: try once.
    const ControlBlock& theirs = peer->block();
    uint64_t magic = 0;
    iovec here{&magic, sizeof(magic)};
    iovec there{reinterpret_cast<void*>(theirs.self_address), sizeof(magic)};
    direct = process_vm_readv(pid, &here, 1, &there, 1, 0) == static_cast<ssize_t>(sizeof(magic)) &&
             magic == theirs.magic;
  }
  return std::make_shared<ShmPeerTransport>(*this, std::move(peer), direct);
}

std::string ShmTransport::Publish(const Outgoing& round, const Parts& mine) {
  size_t bytes = 0;
  for (const auto& [ptr, n] : mine) bytes += n;
  std::string error;
  SlotEntry* slot = owner_->Slot(round.key, round.fingerprint, bytes, &error);
  if (!slot) return error;
  PublishInto(*slot, owner_->Data(*slot), round.seq, mine);
  return "";
}

void ShmTransport::Release(uint64_t key, int64_t seq) {
  // The slot exists: this process published into it for this round.
  if (SlotEntry* slot = owner_->Find(key)) slot->done.store(seq, std::memory_order_release);
}

void ShmTransport::ShowWaits(const std::vector<WaitNotice>& notices) { owner_->ShowWaits(notices); }

std::string ShmTransport::SkipRounds(uint64_t key, uint64_t fingerprint, size_t bytes, int64_t last) {
  std::string error;
  SlotEntry* slot = owner_->Slot(key, fingerprint, bytes, &error);
  if (!slot) return error;
  slot->published.store(last, std::memory_order_release);
  slot->done.store(last, std::memory_order_release);
  return "";
}

std::vector<Rejoiner> ShmTransport::Joins(const std::vector<int64_t>& candidates,
                                          const std::function<bool(int64_t, uint64_t)>& wanted) {
  std::vector<Rejoiner> joins;
  for (int64_t q : candidates) {
    if (q < 0 || q >= kMaxJoinProcesses) continue;
    const JoinRequest& j = block().joins[q];
    const uint64_t g = j.generation.load(std::memory_order_acquire);
    if (g == 0 || !wanted(q, g)) continue;
    // Not probed: this process does not read a restarted peer's memory directly (its
    // streamed rounds with it keep the ring).
    std::string error;
    auto link = Link(j.pid, j.control_fd, j.control_bytes, &error, /*probe=*/false);
    if (!link) continue;  // it died again before we could map it: stays out
    link->peer.process = q;
    link->peer.pid = j.pid;
    joins.push_back({std::move(link), g});
  }
  return joins;
}

// ------------------------------------------------------------------------- a peer's link

const SlotEntry* ShmPeerTransport::Slot(uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  return peer_->Find(key);
}

const char* ShmPeerTransport::Data(const SlotEntry& slot, std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  return peer_->Data(slot, error);
}

bool ShmPeerTransport::MayPublish(uint64_t key, int64_t seq) {
  // Slots are double-buffered by the round's parity: the peer must have read the round
  // before the previous one before its buffer is overwritten.
  if (seq <= 2) return true;
  const SlotEntry* theirs = Slot(key);
  return theirs != nullptr && theirs->done.load(std::memory_order_acquire) >= seq - 2;
}

std::string ShmPeerTransport::Send(const Outgoing& /*round*/, const Parts& /*parts*/) {
  Ring();  // it reads the copy ShmTransport::Publish made
  return "";
}

bool ShmPeerTransport::Delivered(uint64_t key, int64_t seq) {
  const SlotEntry* slot = local_.owner().Find(key);
  return slot != nullptr && slot->published.load(std::memory_order_acquire) >= seq;
}

bool ShmPeerTransport::Find(uint64_t key, int64_t seq, uint64_t /*fingerprint*/, uint64_t /*bytes*/,
                            Arrival* arrival, std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  const SlotEntry* e = peer_->Find(key);
  if (!e || e->published.load(std::memory_order_acquire) < seq) return false;
  arrival->fingerprint = e->fingerprint;
  arrival->bytes = e->bytes;
  std::string why;
  const char* data = peer_->Data(*e, &why);
  if (!data) {
    *error = "reading the shared memory of " + Describe() + ": " + why;
    return true;
  }
  arrival->data = data + Parity(seq) * e->bytes;
  return true;
}

void ShmPeerTransport::Release(uint64_t /*key*/, int64_t /*seq*/) {
  // The peer may wait for this (ShmTransport::Release) to reuse its buffer of the round.
  Ring();
}

std::pair<int64_t, std::vector<char>> ShmPeerTransport::Newest(uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  return peer_->Snapshot(key);
}

std::string ShmPeerTransport::ShowWaits(const std::vector<WaitNotice>& /*notices*/,
                                        std::chrono::steady_clock::time_point /*deadline*/) {
  return "";  // the peer reads this process's board (ShmTransport::ShowWaits)
}

bool ShmPeerTransport::SpinsOn(int cpu) const {
  return peer_->block().spinning_cpu.load(std::memory_order_relaxed) == cpu + 1;
}

void ShmPeerTransport::RequestJoin(int64_t process, uint64_t generation,
                                   std::chrono::steady_clock::time_point /*deadline*/) {
  std::lock_guard<std::mutex> lock(mu_);
  peer_->RequestJoin(process, generation, getpid(), local_.owner().control_fd(), local_.owner().control_bytes());
}

}  // namespace jaxcomm::cpu
