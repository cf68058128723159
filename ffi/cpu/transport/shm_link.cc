#include "cpu/transport/shm_link.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>

#include "core/registry.h"

namespace jaxcomm::cpu {
namespace {

constexpr uint64_t kMagic = 0x6a6178636f6d6d33ull;  // "jaxcomm3": the layout's version
// Data segments start at kFirstGeneration and double, up to kMinGeneration (a call that
// needs more gets a segment of its size): a program of many small collectives maps a
// handful of segments, not one per call, and a job whose calls move a few KiB maps 4 MiB,
// not 64.
constexpr size_t kFirstGeneration = size_t{4} << 20;
constexpr size_t kMinGeneration = size_t{64} << 20;
constexpr size_t kAlign = 4096;

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

size_t Slot0(uint64_t key) { return static_cast<size_t>(key % kMaxSlots); }

// A shared (not FUTEX_PRIVATE) futex: the word lives in a MAP_SHARED mapping of a memfd,
// so the kernel keys it by the file page and a peer process's wake reaches the sleeper.
long Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word");
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

}  // namespace

void Ring(Doorbell& bell, bool from_peer) {
  if (from_peer) {
    // Dekker with the sleeper (World::Progress): it raises awaiting_peers, fences, then
    // looks at its exchanges once more before it sleeps. Either that look sees what this
    // process published before ringing, or this load sees the flag. A peer that awaits
    // nothing is not rung at all: no read-modify-write of its cache line per round.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (bell.awaiting_peers.load(std::memory_order_seq_cst) == 0) return;
  }
  bell.rings.fetch_add(1, std::memory_order_seq_cst);
  if (bell.sleeping.load(std::memory_order_seq_cst) != 0) Futex(&bell.rings, FUTEX_WAKE, INT_MAX, nullptr);
}

void SleepOnBell(Doorbell& bell, uint32_t seen, std::chrono::microseconds timeout, bool awaiting_peers) {
  // Ordered against Ring: either the ringer sees the flags and wakes us, or its ring
  // came first and the futex sees `rings` != `seen` and returns at once.
  bell.awaiting_peers.store(awaiting_peers ? 1 : 0, std::memory_order_seq_cst);
  bell.sleeping.store(1, std::memory_order_seq_cst);
  const auto us = timeout.count();
  const timespec ts{static_cast<time_t>(us / 1000000), static_cast<long>(us % 1000000) * 1000};
  Futex(&bell.rings, FUTEX_WAIT, seen, &ts);  // EAGAIN, EINTR, ETIMEDOUT: the caller rechecks
  bell.sleeping.store(0, std::memory_order_relaxed);
}

std::unique_ptr<Segment> Segment::Create(const std::string& name, size_t bytes, std::string* error) {
  int fd = memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0) {
    *error = Errno("memfd_create(" + name + ")");
    return nullptr;
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    *error = Errno("ftruncate(" + name + ", " + std::to_string(bytes) + ")");
    close(fd);
    return nullptr;
  }
  return Map(fd, bytes, name, error);
}

std::unique_ptr<Segment> Segment::Open(int pid, int fd, size_t bytes, std::string* error) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  int mine = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (mine < 0) {
    *error = Errno("open(" + path + ")");
    return nullptr;
  }
  return Map(mine, bytes, path, error);
}

std::unique_ptr<Segment> Segment::Map(int fd, size_t bytes, const std::string& what, std::string* error) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *error = Errno("mmap(" + what + ")");
    close(fd);
    return nullptr;
  }
  return std::unique_ptr<Segment>(new Segment(fd, static_cast<char*>(p), bytes));
}

Segment::~Segment() {
  munmap(data_, size_);
  close(fd_);
}

std::unique_ptr<ShmOwner> ShmOwner::Create(int64_t process, std::string* error) {
  auto owner = std::unique_ptr<ShmOwner>(new ShmOwner());
  owner->control_ = Segment::Create("jaxcomm-control", sizeof(ControlBlock), error);
  if (!owner->control_) return nullptr;
  ControlBlock& b = owner->block();
  b.magic = kMagic;
  b.pid = static_cast<int32_t>(getpid());
  b.process = static_cast<int32_t>(process);
  b.self_address = reinterpret_cast<uint64_t>(owner->control_->data());
  return owner;
}

SlotEntry* ShmOwner::Slot(uint64_t key, uint64_t fingerprint, size_t bytes, std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = slots_.find(key); it != slots_.end()) {
    if (it->second->bytes != bytes || it->second->fingerprint != fingerprint) {
      *error = "the call's operands changed size between executions (" +
               std::to_string(it->second->bytes) + " then " + std::to_string(bytes) + " bytes)";
      return nullptr;
    }
    return it->second;
  }
  ControlBlock& b = block();
  size_t index = Slot0(key);
  for (int probe = 0; probe < kMaxSlots; ++probe, index = (index + 1) % kMaxSlots) {
    if (b.slots[index].key.load(std::memory_order_relaxed) == 0) break;
    if (probe == kMaxSlots - 1) {
      *error = "more than " + std::to_string(kMaxSlots) +
               " distinct cross-process collective calls in this process";
      return nullptr;
    }
  }
  // Two buffers: a round may be written while the peers still read the previous one.
  const size_t need = (2 * std::max<size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
  if (generations_.empty() || used_ + need > generations_.back()->size()) {
    if (generations_.size() == kMaxGenerations) {
      *error = "shared memory for cross-process collectives exhausted";
      return nullptr;
    }
    // Bounded by JAXCOMM_COMM_MEMORY_MB with the control block: a smaller segment when
    // the next would pass it, an error when this call's buffers alone would.
    const size_t limit = static_cast<size_t>(Registry::Get().comm_memory_limit());
    const size_t held = control_->size() + data_bytes_;
    const size_t room = limit > held ? limit - held : 0;
    if (need > room) {
      *error = "this call's shared-memory buffers (" + std::to_string(need) + " bytes) would take this process past "
               "JAXCOMM_COMM_MEMORY_MB=" + std::to_string(limit >> 20) + " (it holds " + std::to_string(held) +
               " bytes for " + std::to_string(slots_.size()) + " calls; see jaxcomm.memory())";
      return nullptr;
    }
    const size_t grown = std::min(kFirstGeneration << std::min<size_t>(generations_.size(), 8), kMinGeneration);
    auto seg = Segment::Create("jaxcomm-data", std::min(std::max(need, grown), room), error);
    if (!seg) return nullptr;
    data_bytes_ += seg->size();
    GenerationEntry& g = b.generations[generations_.size()];
    g.bytes = seg->size();
    g.fd_plus_one.store(seg->fd() + 1, std::memory_order_release);
    generations_.push_back(std::move(seg));
    used_ = 0;
  }
  SlotEntry& s = b.slots[index];
  s.fingerprint = fingerprint;
  s.offset = used_;
  s.bytes = bytes;
  s.generation = static_cast<uint32_t>(generations_.size() - 1);
  s.published.store(0, std::memory_order_relaxed);
  s.done.store(0, std::memory_order_relaxed);
  s.key.store(key, std::memory_order_release);
  used_ += need;
  data_used_ += need;
  slots_.emplace(key, &s);
  return &s;
}

ShmOwner::Held ShmOwner::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {control_->size(), data_bytes_, data_used_, slots_.size()};
}

SlotEntry* ShmOwner::Find(uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(key);
  return it == slots_.end() ? nullptr : it->second;
}

char* ShmOwner::Data(const SlotEntry& slot) const {
  return generations_[slot.generation]->data() + slot.offset;
}

void ShmOwner::ShowWaits(const std::vector<WaitNotice>& notices) {
  WaitBoard& board = block().waits;
  const uint64_t v = board.version.load(std::memory_order_relaxed);
  board.version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  const size_t n = std::min<size_t>(notices.size(), kMaxWaitNotices);
  std::memcpy(static_cast<void*>(board.notices), notices.data(), n * sizeof(WaitNotice));
  board.count = static_cast<uint32_t>(n);
  board.version.store(v + 2, std::memory_order_release);
}

std::vector<WaitNotice> ShmPeer::Waits() const {
  const WaitBoard& board = block().waits;
  std::vector<WaitNotice> out;
  // The owner rewrites its board at most every 100 ms: a few tries always succeed.
  for (int attempt = 0; attempt < 64; ++attempt) {
    const uint64_t v = board.version.load(std::memory_order_acquire);
    if (v & 1) {
      std::this_thread::yield();
      continue;
    }
    const size_t n = std::min<size_t>(board.count, kMaxWaitNotices);
    out.resize(n);
    std::memcpy(static_cast<void*>(out.data()), board.notices, n * sizeof(WaitNotice));
    std::atomic_thread_fence(std::memory_order_acquire);
    if (board.version.load(std::memory_order_relaxed) == v) {
      for (WaitNotice& notice : out) notice.Terminate();
      return out;
    }
  }
  return {};
}

std::unique_ptr<ShmPeer> ShmPeer::Open(int pid, int fd, size_t bytes, std::string* error) {
  auto peer = std::unique_ptr<ShmPeer>(new ShmPeer());
  peer->pid_ = pid;
  peer->control_ = Segment::Open(pid, fd, bytes, error);
  if (!peer->control_) return nullptr;
  if (peer->block().magic != kMagic || peer->block().pid != pid) {
    *error = "the shared control block of process pid " + std::to_string(pid) + " is not jaxcomm's";
    return nullptr;
  }
  return peer;
}

const SlotEntry* ShmPeer::Find(uint64_t key) {
  if (auto it = found_.find(key); it != found_.end()) return it->second;
  const ControlBlock& b = block();
  size_t index = Slot0(key);
  for (int probe = 0; probe < kMaxSlots; ++probe, index = (index + 1) % kMaxSlots) {
    const uint64_t k = b.slots[index].key.load(std::memory_order_acquire);
    if (k == 0) return nullptr;
    if (k == key) {
      found_.emplace(key, &b.slots[index]);
      return &b.slots[index];
    }
  }
  return nullptr;
}

const char* ShmPeer::Data(const SlotEntry& slot, std::string* error) {
  const uint32_t g = slot.generation;
  if (g >= kMaxGenerations) {
    *error = "corrupt shared slot";
    return nullptr;
  }
  if (g >= generations_.size()) generations_.resize(g + 1);
  if (!generations_[g]) {
    const GenerationEntry& e = block().generations[g];
    const int fd = e.fd_plus_one.load(std::memory_order_acquire) - 1;
    if (fd < 0) {
      *error = "shared data segment not published";
      return nullptr;
    }
    generations_[g] = Segment::Open(pid_, fd, e.bytes, error);
    if (!generations_[g]) return nullptr;
  }
  return generations_[g]->data() + slot.offset;
}

std::pair<int64_t, std::vector<char>> ShmPeer::Snapshot(uint64_t key) {
  const SlotEntry* e = Find(key);
  if (e == nullptr) return {0, {}};
  std::string error;
  const char* base = Data(*e, &error);
  if (base == nullptr) return {0, {}};
  for (int attempt = 0; attempt < 8; ++attempt) {
    const int64_t seq = e->published.load(std::memory_order_acquire);
    if (seq <= 0) return {0, {}};
    std::vector<char> bytes(base + (seq & 1) * e->bytes, base + (seq & 1) * e->bytes + e->bytes);
    std::atomic_thread_fence(std::memory_order_acquire);
    // Buffer seq % 2 is rewritten at seq + 2 at the earliest.
    if (e->published.load(std::memory_order_acquire) < seq + 2) return {seq, std::move(bytes)};
  }
  return {0, {}};
}

void ShmPeer::RequestJoin(int64_t process, uint64_t generation, int pid, int control_fd,
                          size_t control_bytes) {
  if (process < 0 || process >= kMaxJoinProcesses) return;
  JoinRequest& j = block().joins[process];
  j.pid = pid;
  j.control_fd = control_fd;
  j.control_bytes = control_bytes;
  j.generation.store(generation, std::memory_order_release);
  Ring(block().bell);
}

}  // namespace jaxcomm::cpu
