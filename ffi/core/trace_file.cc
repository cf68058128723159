#include "core/trace_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>

namespace jaxcomm {

struct TraceFile::Header {
  char magic[8];
  uint32_t version;
  uint32_t entry_bytes;
  uint64_t entries_per_ring;
  int64_t pid;
  std::atomic<int64_t> process;
  int64_t created_us;
  std::atomic<int64_t> heartbeat_us;
  std::atomic<uint32_t> rings;
  uint32_t max_rings;
  std::atomic<uint64_t> site_bytes;
  uint64_t dir_offset;
  uint64_t sites_offset;
  uint64_t sites_capacity;
  uint64_t errors_offset;
  uint32_t error_slots;
  uint32_t error_slot_bytes;
  uint64_t rings_offset;
  uint64_t ring_stride;
  char host[64];
  std::atomic<uint64_t> errors;  // errors written so far (slot: errors % error_slots)
};

namespace {

constexpr char kMagic[8] = {'J', 'X', 'C', 'R', 'I', 'N', 'G', '\0'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 4096;
constexpr size_t kPage = 4096;

struct DirEntry {
  int64_t partition;
  std::atomic<uint64_t> next;
};

struct ErrorSlot {
  std::atomic<uint64_t> seq;  // 0 while written
  int64_t partition;
  uint32_t length;
  char text[TraceFile::kErrorSlotBytes - 20];
};

static_assert(sizeof(DirEntry) == 16, "ringfile.py reads 16-byte directory entries");
static_assert(sizeof(ErrorSlot) == TraceFile::kErrorSlotBytes, "one error per slot");
static_assert(offsetof(ErrorSlot, text) == 20, "ringfile.py reads error text at 20");
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free,
              "entries are shared with readers of the file: lock-free atomics only");

constexpr size_t kDirOffset = kHeaderBytes;
constexpr size_t kSitesOffset = kDirOffset + TraceFile::kMaxRings * sizeof(DirEntry);
constexpr size_t kErrorsOffset = kSitesOffset + TraceFile::kSiteBytes;
constexpr size_t kRingsOffset = kErrorsOffset + size_t{TraceFile::kErrorSlots} * TraceFile::kErrorSlotBytes;
static_assert(kRingsOffset % kPage == 0, "rings are mapped at page offsets");

int64_t NowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Constructs `n` entries at `mem` one by one (an array new may put a cookie first).
TraceEntry* Entries(void* mem, size_t n) {
  auto* entries = static_cast<TraceEntry*>(mem);
  for (size_t i = 0; i < n; ++i) new (&entries[i]) TraceEntry();
  return entries;
}

}  // namespace

// The header's layout is what ringfile.py reads: pin every offset.
static_assert(offsetof(TraceFile::Header, process) == 32 && offsetof(TraceFile::Header, heartbeat_us) == 48 &&
                  offsetof(TraceFile::Header, rings) == 56 && offsetof(TraceFile::Header, site_bytes) == 64 &&
                  offsetof(TraceFile::Header, rings_offset) == 112 && offsetof(TraceFile::Header, host) == 128 &&
                  offsetof(TraceFile::Header, errors) == 192 && sizeof(TraceFile::Header) == 200,
              "trace file header layout changed: update jaxcomm/trace/ringfile.py and the version");

TraceFile::TraceFile(std::string dir, size_t entries_per_ring)
    : dir_(std::move(dir)),
      entries_(entries_per_ring),
      ring_stride_(RoundUp(std::max<size_t>(entries_per_ring, 1) * sizeof(TraceEntry), kPage)) {}

TraceFile::~TraceFile() {
  // Only private recorders (MeasureRoundCostNs) get here: the registry's lives as long as
  // the process, since XLA threads may still record during its exit.
  for (const auto& [mem, bytes] : mappings_) munmap(mem, bytes);
  if (char* base = base_.load()) munmap(base, kRingsOffset);
  if (fd_ >= 0) close(fd_);
}

TraceFile::Header* TraceFile::header() const {
  return reinterpret_cast<Header*>(base_.load(std::memory_order_acquire));
}

std::string TraceFile::path() const {
  std::lock_guard<std::mutex> lock(mu_);
  return path_;
}

void TraceFile::set_tag(const std::string& tag) {
  std::lock_guard<std::mutex> lock(mu_);
  tag_ = tag;
}

bool TraceFile::OpenFile(int64_t process) {
  tried_ = true;
  std::error_code ignored;
  std::filesystem::create_directories(dir_, ignored);
  std::string dir = dir_;
  if (dir.back() != '/') dir += '/';
  const std::string path = dir + "jaxcomm-ring-p" + std::to_string(process) + "-" + std::to_string(getpid()) +
                           (tag_.empty() ? "" : "-" + tag_) + ".bin";
  // Only this user: the records name call sites and hosts.
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    std::fprintf(stderr, "jaxcomm: cannot create the flight recorder's file %s (%s); its rings stay in memory\n",
                 path.c_str(), std::strerror(errno));
    return false;
  }
  const size_t bytes = kRingsOffset;
  void* base = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (base == MAP_FAILED) {
    std::fprintf(stderr, "jaxcomm: cannot map the flight recorder's file %s (%s); its rings stay in memory\n",
                 path.c_str(), std::strerror(errno));
    close(fd);
    unlink(path.c_str());
    return false;
  }
  fd_ = fd;
  path_ = path;
  char* const mem = static_cast<char*>(base);
  Header* h = new (mem) Header{};
  h->version = kVersion;
  h->entry_bytes = sizeof(TraceEntry);
  h->entries_per_ring = entries_;
  h->pid = getpid();
  h->process.store(process, std::memory_order_relaxed);
  h->created_us = NowUs();
  h->heartbeat_us.store(h->created_us, std::memory_order_relaxed);
  h->max_rings = kMaxRings;
  h->dir_offset = kDirOffset;
  h->sites_offset = kSitesOffset;
  h->sites_capacity = kSiteBytes;
  h->errors_offset = kErrorsOffset;
  h->error_slots = kErrorSlots;
  h->error_slot_bytes = kErrorSlotBytes;
  h->rings_offset = kRingsOffset;
  h->ring_stride = ring_stride_;
  if (gethostname(h->host, sizeof(h->host) - 1) != 0) std::strcpy(h->host, "unknown");
  // The magic last: a reader never takes a half-written header for a valid one.
  std::atomic_thread_fence(std::memory_order_release);
  std::memcpy(h->magic, kMagic, sizeof(kMagic));
  base_.store(mem, std::memory_order_release);
  return true;
}

TraceFile::RingMemory TraceFile::AddRing(int64_t partition, int64_t process) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!dir_.empty() && !tried_) OpenFile(process);
  RingMemory ring;
  if (Header* h = header()) {
    char* const base = reinterpret_cast<char*>(h);
    const uint32_t k = h->rings.load(std::memory_order_relaxed);
    const size_t offset = kRingsOffset + k * ring_stride_;
    void* mem = MAP_FAILED;
    if (k < kMaxRings && ftruncate(fd_, static_cast<off_t>(offset + ring_stride_)) == 0) {
      mem = mmap(nullptr, ring_stride_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, static_cast<off_t>(offset));
    }
    if (mem != MAP_FAILED) {
      mappings_.emplace_back(mem, ring_stride_);
      ring.entries = Entries(mem, entries_);
      auto* dir = reinterpret_cast<DirEntry*>(base + kDirOffset) + k;
      dir->partition = partition;
      ring.next = new (&dir->next) std::atomic<uint64_t>(0);
      h->process.store(process, std::memory_order_relaxed);
      h->rings.store(k + 1, std::memory_order_release);
      return ring;
    }
    // Out of file space or rings: this ring lives in memory (not in the file).
  }
  void* mem = mmap(nullptr, ring_stride_ + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return ring;
  mappings_.emplace_back(mem, ring_stride_ + kPage);
  ring.entries = Entries(mem, entries_);
  ring.next = new (static_cast<char*>(mem) + ring_stride_) std::atomic<uint64_t>(0);
  return ring;
}

void TraceFile::AddSite(uint32_t id, const std::string& json, int64_t process) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!dir_.empty() && !tried_) OpenFile(process);
  Header* h = header();
  if (h == nullptr) return;
  const uint64_t used = h->site_bytes.load(std::memory_order_relaxed);
  const size_t record = 8 + json.size();
  if (used + record > kSiteBytes) return;  // full: the reader shows these calls' site as unknown
  char* at = reinterpret_cast<char*>(h) + kSitesOffset + used;
  const uint32_t length = static_cast<uint32_t>(json.size());
  std::memcpy(at, &length, 4);
  std::memcpy(at + 4, &id, 4);
  std::memcpy(at + 8, json.data(), json.size());
  h->site_bytes.store(used + RoundUp(record, 8), std::memory_order_release);
}

void TraceFile::AddError(int64_t partition, uint64_t seq, const std::string& text) {
  Header* h = header();
  if (h == nullptr || seq == 0) return;
  std::lock_guard<std::mutex> lock(errors_mu_);
  const uint64_t n = h->errors.load(std::memory_order_relaxed);
  auto* slot = reinterpret_cast<ErrorSlot*>(reinterpret_cast<char*>(h) + kErrorsOffset) + n % kErrorSlots;
  slot->seq.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  slot->partition = partition;
  const size_t length = std::min(text.size(), sizeof(slot->text));
  std::memcpy(slot->text, text.data(), length);
  slot->length = static_cast<uint32_t>(length);
  slot->seq.store(seq, std::memory_order_release);
  h->errors.store(n + 1, std::memory_order_relaxed);
}

void TraceFile::Heartbeat(int64_t process) {
  if (Header* h = header()) {
    h->process.store(process, std::memory_order_relaxed);
    h->heartbeat_us.store(NowUs(), std::memory_order_relaxed);
  }
}

}  // namespace jaxcomm
