#include "core/flight_recorder.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "core/registry.h"
#include "core/rendezvous.h"
#include "core/thread_name.h"

namespace jaxcomm {

struct FlightRecorder::Ring {
  Ring(int64_t p, size_t s, TraceFile::RingMemory m) : partition(p), slot(s), entries(m.entries), next(*m.next) {}
  const int64_t partition;
  const size_t slot;  // in ring_slots_: part of every handle
  Entry* const entries;  // in the trace file's mapping, or anonymous memory (TraceFile)
  std::atomic<uint64_t>& next;  // calls recorded so far
};

namespace {

// SIGUSR1: only wakes the dumper thread through its self-pipe. The handler is installed
// after the registry exists, so Registry::Get() here is a plain load of an initialized
// static, and write(2) is async-signal-safe (a full pipe drops the byte).
void OnSignal(int) {
  const int fd = Registry::Get().recorder().signal_fd();
  if (fd >= 0) {
    const char c = 's';
    ssize_t ignored = write(fd, &c, 1);
    (void)ignored;
  }
}

int64_t NowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Handles pack (ring slot + 1) above bit 48 and the call number below.
constexpr int kSeqBits = 48;
constexpr uint64_t kSeqMask = (uint64_t{1} << kSeqBits) - 1;

size_t SiteSlot(const void* table, uint64_t instruction, int64_t group_index) {
  uint64_t h = reinterpret_cast<uintptr_t>(table) * 0x9e3779b97f4a7c15ull;
  h ^= instruction + 0x632be59bd9b4e019ull + (h << 6) + (h >> 2);
  h ^= static_cast<uint64_t>(group_index) * 0xff51afd7ed558ccdull;
  return static_cast<size_t>(h >> 20);
}

void JsonString(std::ostringstream& out, const std::string& s) {
  out << '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out << "\\\""; break;
      case '\\': out << "\\\\"; break;
      case '\n': out << "\\n"; break;
      case '\r': out << "\\r"; break;
      case '\t': out << "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out << buf;
        } else {
          out << c;
        }
    }
  }
  out << '"';
}

void JsonInts(std::ostringstream& out, const std::vector<int64_t>& v) {
  out << '[';
  for (size_t i = 0; i < v.size(); ++i) out << (i ? "," : "") << v[i];
  out << ']';
}

void JsonTime(std::ostringstream& out, int64_t us) {
  if (us == 0) {
    out << "null";
  } else {
    out << us;
  }
}

const char* StateName(uint8_t s) {
  switch (static_cast<TraceState>(s)) {
    case TraceState::kPending: return "pending";
    case TraceState::kActive: return "active";
    case TraceState::kDone: return "done";
    case TraceState::kFailed: return "failed";
  }
  return "unknown";
}

std::string HostName() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

char HexDigit(uint64_t v) { return "0123456789abcdef"[v & 15]; }

std::string Hex16(uint64_t v) {
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) out[i] = HexDigit(v);
  return out;
}

// A site as the trace file keeps it: the fields every entry of the site shares, as in
// the JSON dump's entries (jaxcomm/trace/ringfile.py merges them back).
std::string SiteJson(const TraceSite& site) {
  std::ostringstream out;
  out << "{\"id\":" << site.id << ",\"op\":";
  JsonString(out, site.op);
  out << ",\"axis\":";
  JsonString(out, site.axis);
  out << ",\"call_site\":";
  JsonString(out, site.call_site);
  out << ",\"instruction\":\"" << Hex16(site.instruction) << "\",\"group_index\":" << site.group_index
      << ",\"group\":";
  JsonInts(out, site.group);
  out << ",\"processes\":";
  JsonInts(out, site.processes);
  out << ",\"algorithm\":";
  JsonString(out, site.algorithm);
  out << "}";
  return out.str();
}

}  // namespace

const char* DtypeName(uint8_t dtype) {
  // Values of XLA_FFI_DataType (xla/ffi/api/c_api.h).
  switch (dtype) {
    case 1: return "bool";
    case 2: return "int8";
    case 3: return "int16";
    case 4: return "int32";
    case 5: return "int64";
    case 6: return "uint8";
    case 7: return "uint16";
    case 8: return "uint32";
    case 9: return "uint64";
    case 10: return "float16";
    case 11: return "float32";
    case 12: return "float64";
    case 15: return "complex64";
    case 16: return "bfloat16";
    case 18: return "complex128";
    default: return "other";
  }
}

FlightRecorder::FlightRecorder(size_t entries_per_rank, std::string dump_dir)
    : entries_(entries_per_rank),
      dump_dir_(std::move(dump_dir)),
      enabled_(entries_per_rank > 0),
      file_(dump_dir_, entries_per_rank) {}

void FlightRecorder::set_tag(const std::string& tag) {
  tag_ = tag;
  file_.set_tag(tag);
}

FlightRecorder::~FlightRecorder() {
  if (dumper_.joinable()) {
    const char c = 'q';
    if (write(wake_write_.load(), &c, 1) == 1) dumper_.join();
    else dumper_.detach();
  }
  if (wake_read_ >= 0) close(wake_read_);
  if (wake_write_.load() >= 0) close(wake_write_.load());
}

FlightRecorder::Ring* FlightRecorder::RingOf(int64_t partition) {
  const size_t home = static_cast<size_t>(partition) % kMaxRings;
  for (size_t i = 0; i < kMaxRings; ++i) {
    Ring* r = ring_slots_[(home + i) % kMaxRings].load(std::memory_order_acquire);
    if (r == nullptr) break;
    if (r->partition == partition) return r;
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < kMaxRings; ++i) {
    auto& slot = ring_slots_[(home + i) % kMaxRings];
    Ring* r = slot.load(std::memory_order_acquire);
    if (r != nullptr && r->partition == partition) return r;
    if (r == nullptr) {
      const TraceFile::RingMemory memory = file_.AddRing(partition, Registry::Get().process_index());
      if (memory.entries == nullptr) return nullptr;  // out of memory: not recorded
      rings_.push_back(std::make_unique<Ring>(partition, (home + i) % kMaxRings, memory));
      slot.store(rings_.back().get(), std::memory_order_release);
      return rings_.back().get();
    }
  }
  return nullptr;  // more local ranks than kMaxRings: not recorded
}

const TraceSite* FlightRecorder::SiteById(uint32_t id) const {
  return id <= kMaxSites ? site_by_id_[id].load(std::memory_order_acquire) : nullptr;
}

const TraceSite* FlightRecorder::FindSite(const void* table, uint64_t instruction,
                                          int64_t group_index) const {
  const size_t home = SiteSlot(table, instruction, group_index);
  // Open addressing with linear probing; slots are only ever filled, never cleared. An
  // executable freed and a new one at the same address has a new instruction key
  // (instruction keys count occurrences), so a stale site never matches.
  for (size_t i = 0; i < kSiteSlots; ++i) {
    const TraceSite* s = site_slots_[(home + i) % kSiteSlots].load(std::memory_order_acquire);
    if (s == nullptr) return nullptr;
    if (s->table == table && s->instruction == instruction && s->group_index == group_index) return s;
  }
  return nullptr;
}

const TraceSite* FlightRecorder::AddSite(std::unique_ptr<TraceSite> site) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t home = SiteSlot(site->table, site->instruction, site->group_index);
  for (size_t i = 0; i < kSiteSlots && sites_.size() < kMaxSites; ++i) {
    auto& slot = site_slots_[(home + i) % kSiteSlots];
    const TraceSite* s = slot.load(std::memory_order_acquire);
    if (s == nullptr) {
      site->id = static_cast<uint32_t>(sites_.size());
      sites_.push_back(std::move(site));
      const TraceSite* added = sites_.back().get();
      site_by_id_[added->id].store(added, std::memory_order_release);
      file_.AddSite(added->id, SiteJson(*added), Registry::Get().process_index());
      slot.store(added, std::memory_order_release);
      return added;
    }
    if (s->table == site->table && s->instruction == site->instruction &&
        s->group_index == site->group_index) {
      return s;  // another rank described it first
    }
  }
  // Sites are never freed (entries point at them). A program recompiled without end
  // shares one catch-all site once the table is half full, instead of growing memory.
  if (!overflow_) {
    overflow_ = std::move(site);
    overflow_->id = static_cast<uint32_t>(kMaxSites);
    overflow_->op = overflow_->axis = overflow_->call_site = "<flight recorder site table full>";
    site_by_id_[kMaxSites].store(overflow_.get(), std::memory_order_release);
    file_.AddSite(overflow_->id, SiteJson(*overflow_), Registry::Get().process_index());
  }
  return overflow_.get();
}

const TraceSite* FlightRecorder::SiteOf(const RoundTable& table, const CallContext& ctx, bool streamed,
                                        bool phased, bool scatters) {
  const int g = static_cast<int>(ctx.group_index);
  if (const TraceSite* s = FindSite(&table, table.instruction_key(), g)) return s;
  auto site = std::make_unique<TraceSite>();
  site->table = &table;
  site->instruction = table.instruction_key();
  site->group_index = g;
  site->op = std::string(ctx.op);
  site->axis = std::string(ctx.axis);
  site->call_site = std::string(ctx.call_site);
  site->group = table.group(g);
  const std::vector<int64_t>& remote = table.remote_processes(g);
  site->processes = remote;
  site->processes.push_back(Registry::Get().process_index());
  std::sort(site->processes.begin(), site->processes.end());
  bool stream = false, hierarchical = false, scatter_gather = false;
  // The names of the transports that link this process to the others (LinkCapabilities),
  // shared-memory ones first: "shm", "tcp", "shm+mpi".
  std::vector<std::string> shared, other;
  if (const CrossProcess* world = Registry::Get().cross_process()) {
    stream = streamed && world->CanStream(remote);
    hierarchical = phased && SpansHostsHierarchically(*world, site->processes);
    scatter_gather = scatters && !hierarchical && ScattersAndGathers(*world, remote);
    for (int64_t p : remote) {
      const LinkCapabilities* link = world->LinkOf(p);
      if (link == nullptr) continue;
      auto& names = link->shared_memory ? shared : other;
      if (std::find(names.begin(), names.end(), link->name) == names.end()) names.push_back(link->name);
    }
  }
  const auto join = [](const std::vector<std::string>& a, const std::vector<std::string>& b) {
    std::string out;
    for (const auto* names : {&a, &b}) {
      for (const std::string& n : *names) out += (out.empty() ? "" : "+") + n;
    }
    return out;
  };
  const std::string links = join(shared, other);
  site->algorithm = remote.empty()                     ? "in-process zero-copy"
                    : links.empty()                    ? "cross-process (not linked)"
                    : hierarchical                     ? "hierarchical " + links
                    : scatter_gather                   ? join({}, other) + " reduce-scatter+all-gather"
                    : !shared.empty() && !other.empty() ? links
                    : stream                           ? links + " stream"
                                                       : links;
  return AddSite(std::move(site));
}

uint64_t FlightRecorder::Enqueue(int64_t partition, const TraceSite* site, int rank, int64_t run_id,
                                 uint8_t dtype, int64_t elements, int64_t bytes) {
  if (!enabled()) return 0;
  Ring* ring = RingOf(partition);
  if (ring == nullptr) return 0;
  const uint64_t seq = ring->next.fetch_add(1, std::memory_order_relaxed) + 1;
  Entry& e = ring->entries[(seq - 1) % entries_];
  e.seq.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  e.site.store(site != nullptr ? site->id : UINT32_MAX, std::memory_order_relaxed);
  e.run_id.store(run_id, std::memory_order_relaxed);
  e.execution.store(0, std::memory_order_relaxed);
  e.elements.store(elements, std::memory_order_relaxed);
  e.bytes.store(bytes, std::memory_order_relaxed);
  e.enqueue_us.store(NowUs(), std::memory_order_relaxed);
  e.start_us.store(0, std::memory_order_relaxed);
  e.end_us.store(0, std::memory_order_relaxed);
  e.left_out.store(0, std::memory_order_relaxed);
  e.rank.store(rank, std::memory_order_relaxed);
  e.dtype.store(dtype, std::memory_order_relaxed);
  e.state.store(static_cast<uint8_t>(TraceState::kPending), std::memory_order_relaxed);
  e.seq.store(seq, std::memory_order_release);
  return (static_cast<uint64_t>(ring->slot + 1) << kSeqBits) | seq;
}

FlightRecorder::Entry* FlightRecorder::Resolve(uint64_t handle) const {
  if (handle == 0) return nullptr;
  const size_t slot = (handle >> kSeqBits) - 1;
  const uint64_t seq = handle & kSeqMask;
  if (slot >= kMaxRings) return nullptr;
  Ring* ring = ring_slots_[slot].load(std::memory_order_acquire);
  if (ring == nullptr) return nullptr;
  Entry* e = &ring->entries[(seq - 1) % entries_];
  // The rank made `entries_` newer calls while this one was in flight: its slot is gone.
  return e->seq.load(std::memory_order_relaxed) == seq ? e : nullptr;
}

void FlightRecorder::Arrived(uint64_t handle, int64_t execution) {
  if (Entry* e = Resolve(handle)) e->execution.store(execution, std::memory_order_relaxed);
}

void FlightRecorder::Start(const std::vector<Peer>& peers) {
  int64_t now = 0;
  for (const Peer& p : peers) {
    Entry* e = Resolve(p.trace);
    if (e == nullptr) continue;
    if (now == 0) now = NowUs();
    e->start_us.store(now, std::memory_order_relaxed);
    e->state.store(static_cast<uint8_t>(TraceState::kActive), std::memory_order_relaxed);
  }
}

void FlightRecorder::Finish(const std::vector<Peer>& peers, const std::string& error, bool dump, bool counted) {
  int64_t now = 0, start = 0, first = 0, bytes = 0;
  const TraceSite* site = nullptr;
  const auto state = static_cast<uint8_t>(error.empty() ? TraceState::kDone : TraceState::kFailed);
  uint64_t left_out = 0;  // a completed call whose remote rank has no input left it out
  if (error.empty()) {
    for (size_t r = 0; r < peers.size() && r < 64; ++r) {
      if (peers[r].in == nullptr && peers[r].out == nullptr) left_out |= uint64_t{1} << r;
    }
  }
  for (const Peer& p : peers) {
    Entry* e = Resolve(p.trace);
    if (e == nullptr) continue;
    if (now == 0) now = NowUs();
    e->end_us.store(now, std::memory_order_relaxed);
    e->left_out.store(left_out, std::memory_order_relaxed);
    e->state.store(state, std::memory_order_relaxed);
    if (!error.empty()) Fail(p.trace, 0, error);
    const int64_t enq = e->enqueue_us.load(std::memory_order_relaxed);
    first = first == 0 ? enq : std::min(first, enq);
    start = e->start_us.load(std::memory_order_relaxed);
    site = SiteById(e->site.load(std::memory_order_relaxed));
    bytes = e->bytes.load(std::memory_order_relaxed);
  }
  if (site != nullptr && counted) {
    // Statistics are counters of the site, shared by every rank of the group: cheap
    // relaxed adds, and a site is mutable only through them.
    auto& s = const_cast<TraceSite&>(*site);
    s.calls.fetch_add(1, std::memory_order_relaxed);
    if (!error.empty()) {
      s.failed.fetch_add(1, std::memory_order_relaxed);
    } else {
      s.bytes.fetch_add(bytes, std::memory_order_relaxed);
      if (start != 0) {
        s.busy_us.fetch_add(now - start, std::memory_order_relaxed);
        s.wait_us.fetch_add(start - first, std::memory_order_relaxed);
      }
    }
  }
  if (dump && !error.empty()) RequestDump('t');
}

void FlightRecorder::Fail(uint64_t handle, int64_t execution, const std::string& error) {
  Entry* e = Resolve(handle);
  if (e == nullptr) return;
  if (execution != 0) e->execution.store(execution, std::memory_order_relaxed);
  if (e->end_us.load(std::memory_order_relaxed) == 0) e->end_us.store(NowUs(), std::memory_order_relaxed);
  e->state.store(static_cast<uint8_t>(TraceState::kFailed), std::memory_order_relaxed);
  if (Ring* ring = ring_slots_[(handle >> kSeqBits) - 1].load(std::memory_order_acquire)) {
    file_.AddError(ring->partition, handle & kSeqMask, error);
  }
  std::lock_guard<std::mutex> lock(errors_mu_);
  if (errors_.emplace(handle, error).second) error_order_.push_back(handle);
  while (error_order_.size() > kMaxErrors) {
    errors_.erase(error_order_.front());
    error_order_.pop_front();
  }
}

std::string FlightRecorder::DumpJson(const std::string& reason) const {
  std::vector<Ring*> rings;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& r : rings_) rings.push_back(r.get());
  }
  std::sort(rings.begin(), rings.end(), [](Ring* a, Ring* b) { return a->partition < b->partition; });
  std::map<uint64_t, std::string> errors;
  {
    std::lock_guard<std::mutex> lock(errors_mu_);
    errors = errors_;
  }
  std::ostringstream out;
  out << "{\"format\":\"jaxcomm-trace\",\"version\":1,\"reason\":";
  JsonString(out, reason);
  if (!tag_.empty()) {
    out << ",\"recorder\":";
    JsonString(out, tag_);
  }
  out << ",\"process_index\":" << Registry::Get().process_index() << ",\"pid\":" << getpid()
      << ",\"host\":";
  JsonString(out, HostName());
  out << ",\"dumped_at_us\":" << NowUs() << ",\"entries_per_rank\":" << entries_
      << ",\"enabled\":" << (enabled() ? "true" : "false") << ",\"ranks\":[";
  for (size_t i = 0; i < rings.size(); ++i) {
    out << (i ? "," : "") << "{\"partition\":" << rings[i]->partition
        << ",\"calls\":" << rings[i]->next.load(std::memory_order_relaxed) << "}";
  }
  out << "],\"entries\":[";
  bool first_entry = true;
  for (size_t ri = 0; ri < rings.size(); ++ri) {
    Ring* ring = rings[ri];
    const uint64_t total = ring->next.load(std::memory_order_acquire);
    const uint64_t from = total > entries_ ? total - entries_ + 1 : 1;
    for (uint64_t seq = from; seq <= total; ++seq) {
      const Entry& e = ring->entries[(seq - 1) % entries_];
      if (e.seq.load(std::memory_order_acquire) != seq) continue;
      const TraceSite* site = SiteById(e.site.load(std::memory_order_relaxed));
      const int64_t execution = e.execution.load(std::memory_order_relaxed);
      const int64_t run_id = e.run_id.load(std::memory_order_relaxed);
      const int64_t elements = e.elements.load(std::memory_order_relaxed);
      const int64_t bytes = e.bytes.load(std::memory_order_relaxed);
      const int64_t enq = e.enqueue_us.load(std::memory_order_relaxed);
      const int64_t start = e.start_us.load(std::memory_order_relaxed);
      const int64_t end = e.end_us.load(std::memory_order_relaxed);
      const int rank = e.rank.load(std::memory_order_relaxed);
      const uint8_t dtype = e.dtype.load(std::memory_order_relaxed);
      const uint8_t state = e.state.load(std::memory_order_relaxed);
      const uint64_t left_out = e.left_out.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (e.seq.load(std::memory_order_relaxed) != seq || site == nullptr) continue;  // reclaimed
      const std::string instruction = Hex16(site->instruction);
      out << (first_entry ? "" : ",") << "\n{\"partition\":" << ring->partition << ",\"seq\":" << seq
          << ",\"op\":";
      first_entry = false;
      JsonString(out, site->op);
      out << ",\"axis\":";
      JsonString(out, site->axis);
      out << ",\"call_site\":";
      JsonString(out, site->call_site);
      out << ",\"instruction\":\"" << instruction << "\",\"group_index\":" << site->group_index
          << ",\"group\":";
      JsonInts(out, site->group);
      out << ",\"processes\":";
      JsonInts(out, site->processes);
      out << ",\"rank\":" << rank << ",\"execution\":" << execution << ",\"run_id\":" << run_id
          << ",\"dtype\":\"" << DtypeName(dtype) << "\",\"elements\":" << elements
          << ",\"bytes\":" << bytes << ",\"algorithm\":";
      JsonString(out, site->algorithm);
      out << ",\"left_out\":[";
      for (int r = 0, n = 0; r < 64; ++r) {
        if (left_out >> r & 1) out << (n++ ? "," : "") << r;
      }
      out << "],\"state\":\"" << StateName(state) << "\",\"error\":";
      const uint64_t handle = (static_cast<uint64_t>(ring->slot + 1) << kSeqBits) | seq;
      if (auto it = errors.find(handle); it != errors.end()) {
        JsonString(out, it->second);
      } else {
        out << "null";
      }
      out << ",\"enqueue_us\":";
      JsonTime(out, enq);
      out << ",\"start_us\":";
      JsonTime(out, start);
      out << ",\"end_us\":";
      JsonTime(out, end);
      out << "}";
    }
  }
  out << "\n]}\n";
  return out.str();
}

std::string FlightRecorder::FileIn(const std::string& dir) const {
  std::string d = dir.empty() ? "." : dir;
  if (d.back() != '/') d += '/';
  return d + "jaxcomm-trace-p" + std::to_string(Registry::Get().process_index()) + "-" +
         std::to_string(getpid()) + (tag_.empty() ? "" : "-" + tag_) + ".json";
}

std::string FlightRecorder::DumpToFile(const std::string& path, const std::string& reason) const {
  const std::string json = DumpJson(reason);
  // JAXCOMM_TRACE_DIR may name a directory nobody created yet.
  std::error_code ignored;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ignored);
  const std::string tmp = path + ".tmp" + std::to_string(getpid());
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return "cannot write " + tmp + ": " + std::strerror(errno);
  const bool ok = std::fwrite(json.data(), 1, json.size(), f) == json.size();
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed) {
    std::remove(tmp.c_str());
    return "writing " + tmp + " failed";
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return "cannot rename " + tmp + " to " + path + ": " + std::strerror(errno);
  }
  return "";
}

std::vector<const TraceSite*> FlightRecorder::Sites() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<const TraceSite*> out;
  for (const auto& s : sites_) out.push_back(s.get());
  return out;
}

void FlightRecorder::ResetStats() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& s : sites_) {
    s->calls.store(0);
    s->failed.store(0);
    s->bytes.store(0);
    s->busy_us.store(0);
    s->wait_us.store(0);
  }
}

double FlightRecorder::MeasureRoundCostNs(int ranks, int rounds, size_t entries, const std::string& dir) {
  FlightRecorder probe(std::max<size_t>(entries, 1), dir);
  const int table = 0;  // any address: identifies the probe's one instruction
  std::vector<Peer> peers(static_cast<size_t>(std::max(ranks, 1)));
  const std::string no_error;
  // Steady state: every slot of every ring written once before the clock starts (a
  // fresh ring's first touch of each page is a page fault, dearer in a file mapping).
  const int warmup = static_cast<int>(std::max<size_t>(entries, 1));
  auto t0 = std::chrono::steady_clock::now();
  for (int i = -warmup; i < rounds; ++i) {
    if (i == 0) t0 = std::chrono::steady_clock::now();
    for (size_t r = 0; r < peers.size(); ++r) {
      // What Launch does per rank: find the site (lock-free after the first round), enqueue.
      const TraceSite* site = probe.FindSite(&table, 1, 0);
      if (site == nullptr) {
        auto s = std::make_unique<TraceSite>();
        s->table = &table;
        s->instruction = 1;
        site = probe.AddSite(std::move(s));
      }
      peers[r].trace = probe.Enqueue(static_cast<int64_t>(r), site, static_cast<int>(r), i, 11, 1, 4);
      probe.Arrived(peers[r].trace, i + warmup + 1);
    }
    probe.Start(peers);
    probe.Finish(peers, no_error, false);
  }
  const auto t1 = std::chrono::steady_clock::now();
  if (const std::string file = probe.RingFile(); !file.empty()) unlink(file.c_str());
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / std::max(rounds, 1);
}

void FlightRecorder::RequestDump(char reason) {
  const int fd = wake_write_.load(std::memory_order_acquire);
  if (fd < 0) return;  // no dumper thread
  ssize_t ignored = write(fd, &reason, 1);
  (void)ignored;
}

void FlightRecorder::StartDumper(bool handle_signal) {
  if (entries_ == 0) return;  // recorder off: no thread, SIGUSR1 keeps its default
  std::call_once(dumper_once_, [this, handle_signal] {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) return;
    wake_read_ = fds[0];
    wake_write_.store(fds[1], std::memory_order_release);
    dumper_ = std::thread([this] {
      NameThisThread("jaxcomm-trace");
      DumperLoop();
    });
    // Only where nobody else handles SIGUSR1: a program's own handler stays in charge.
    struct sigaction old {};
    if (handle_signal && this == &Registry::Get().recorder() && sigaction(SIGUSR1, nullptr, &old) == 0 &&
        old.sa_handler == SIG_DFL) {
      struct sigaction sa {};
      sa.sa_handler = OnSignal;
      sigemptyset(&sa.sa_mask);
      sa.sa_flags = SA_RESTART;
      sigaction(SIGUSR1, &sa, nullptr);
    }
  });
}

void FlightRecorder::DumperLoop() {
  while (true) {
    pollfd p{wake_read_, POLLIN, 0};
    // Bounded wait: the loop re-checks every second even if a wake-up were lost.
    const int ready = poll(&p, 1, 1000);
    // The trace file shows when its process last lived (a reader's "dumped at").
    file_.Heartbeat(Registry::Get().process_index());
    if (ready <= 0) continue;
    char buf[64];
    bool signal = false, error = false;
    ssize_t n;
    while ((n = read(wake_read_, buf, sizeof(buf))) > 0) {
      for (ssize_t i = 0; i < n; ++i) {
        if (buf[i] == 'q') return;
        signal |= buf[i] == 's';
        error |= buf[i] == 't';
      }
    }
    if (!signal && (!error || dump_dir_.empty())) continue;
    // Timeouts and transport errors dump only where asked to (JAXCOMM_TRACE_DIR); a
    // signal is an explicit request and falls back to the current directory.
    const std::string err = DumpToFile(FileIn(dump_dir_), signal ? "signal" : "error");
    if (!err.empty()) std::fprintf(stderr, "jaxcomm: flight recorder dump failed: %s\n", err.c_str());
    auto_dumps_.fetch_add(1);
  }
}

size_t FlightRecorder::MemoryBytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rings_.size() * entries_ * sizeof(Entry) + sites_.size() * sizeof(TraceSite);
}

}  // namespace jaxcomm
