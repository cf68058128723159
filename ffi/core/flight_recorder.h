// The flight recorder: per rank (partition), the last N collective calls, always on.
//
// When a job hangs or slows down, the question is which rank, which op, which call. Each
// rank keeps a ring of fixed-size entries (JAXCOMM_TRACE_ENTRIES, default 2048; 0 turns
// the recorder off) that a dump (JSON, see DumpJson) writes out: on request, on a timeout
// or transport error, on SIGUSR1 and at exit (the last two driven from Python and a
// dumper thread). `python -m jaxcomm.trace analyze` merges the dumps of all processes.
//
// Cost: a 4-byte all_reduce takes ~10-20 us, so the hot path allocates nothing and takes
// no lock. A call claims a slot of its rank's ring with one atomic increment and writes
// plain relaxed atomics; what every call of one instruction and group shares (op, call
// site, group, algorithm) is described once in a TraceSite, found again lock-free.
// Failed calls keep their error text in a small side table (failures are rare).
//
// Storage (core/trace_file.h): with JAXCOMM_TRACE_DIR set, the rings, the sites'
// descriptions and the error texts also live in a file mapping that survives the
// process however it ends; the JSON dump is then one more view of the same records.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/trace_file.h"

namespace jaxcomm {

struct Peer;
struct CallContext;
class RoundTable;

enum class TraceState : uint8_t { kPending = 0, kActive = 1, kDone = 2, kFailed = 3 };

// What all calls of one instruction by one group share, described once. Also holds the
// cumulative statistics of those calls (jaxcomm.stats()), which outlive the ring.
struct TraceSite {
  uint32_t id = 0;              // entries name their site by it (TraceEntry::site)
  const void* table = nullptr;  // the instruction's RoundTable, for lookup only
  uint64_t instruction = 0;     // the instruction key: the same in every process
  int64_t group_index = 0;
  std::string op, axis, call_site, algorithm;
  std::vector<int64_t> group;      // partitions, in rank order
  std::vector<int64_t> processes;  // the processes those partitions live in, ascending

  std::atomic<int64_t> calls{0};    // rounds completed or failed in this process
  std::atomic<int64_t> failed{0};
  std::atomic<int64_t> bytes{0};    // operand bytes of one rank, summed over rounds
  std::atomic<int64_t> busy_us{0};  // last local arrival (start of the work) to completion
  std::atomic<int64_t> wait_us{0};  // first local arrival to start of the work
};

class FlightRecorder {
 public:
  // `entries_per_rank` == 0 disables recording (nothing is allocated).
  FlightRecorder(size_t entries_per_rank, std::string dump_dir);
  ~FlightRecorder();
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  // Runtime switch (benchmarks compare on and off in one process); no-op when the ring
  // size is 0.
  void set_enabled(bool on) { enabled_.store(on && entries_ > 0, std::memory_order_relaxed); }
  size_t entries_per_rank() const { return entries_; }
  const std::string& dump_dir() const { return dump_dir_; }
  // Names this recorder apart from another of the same process: the CUDA emulation's
  // module (_jaxcomm_emu) has its own copy of core/ beside _jaxcomm's, so its dump is
  // jaxcomm-trace-p<I>-<pid>-<tag>.json, its rings jaxcomm-ring-p<I>-<pid>-<tag>.bin, and
  // its dumps say "recorder": tag (the analyzer reads both as records of one process).
  // Call before the first recorded call.
  void set_tag(const std::string& tag);
  const std::string& tag() const { return tag_; }

  // The site of (table, instruction, group), or null when not described yet. Lock-free.
  const TraceSite* FindSite(const void* table, uint64_t instruction, int64_t group_index) const;
  // Adds a described site (once per instruction and group; takes a lock).
  const TraceSite* AddSite(std::unique_ptr<TraceSite> site);
  // The site of a call (ctx: op, axis, call site, group index) of `table`'s instruction:
  // found lock-free, or described (group, processes, algorithm) and added. `streamed`:
  // the call's rounds stream if the transport can (Streamable, CrossProcess::CanStream);
  // `hierarchical`: across hosts they run in phases (SpansHostsHierarchically);
  // `scatters`: over TCP they run as a reduce-scatter then an all-gather
  // (MayScatterGather, ScattersAndGathers).
  const TraceSite* SiteOf(const RoundTable& table, const CallContext& ctx, bool streamed = false,
                          bool hierarchical = false, bool scatters = false);

  // Records a call of `partition` entering jaxcomm (pending); returns its handle for the
  // updates below (0 when recording is off). Called on the device thread.
  uint64_t Enqueue(int64_t partition, const TraceSite* site, int rank, int64_t run_id, uint8_t dtype,
                   int64_t elements, int64_t bytes);
  // The rendezvous numbered the call: which execution of the instruction it is.
  void Arrived(uint64_t handle, int64_t execution);
  // Every local rank arrived (and, across processes, every process's inputs are here):
  // the data movement starts.
  void Start(const std::vector<Peer>& peers);
  // The round finished: done, or failed with `error`. `dump` asks for an automatic dump
  // (timeouts and transport errors) when a dump directory is configured. `counted`: the
  // round enters the site's statistics (jaxcomm.stats(): one per round of the group). The
  // CUDA backend finishes each local rank's entry on its own, and counts the round with one
  // of them only.
  void Finish(const std::vector<Peer>& peers, const std::string& error, bool dump, bool counted = true);
  // One call failed on its own (e.g. arrived after its peers gave up).
  void Fail(uint64_t handle, int64_t execution, const std::string& error);

  // This process's rings as the JSON document described in docs/tracing.md ("Dumps").
  std::string DumpJson(const std::string& reason) const;
  // Writes DumpJson to `path` atomically (temporary file, then rename); "" or an error.
  std::string DumpToFile(const std::string& path, const std::string& reason) const;
  // The file name of this process's dump in a directory: jaxcomm-trace-p<I>-<pid>.json.
  std::string FileIn(const std::string& dir) const;
  // The file-backed rings' path (JAXCOMM_TRACE_DIR/jaxcomm-ring-p<I>-<pid>.bin), once the
  // first call was recorded; "" before, or without JAXCOMM_TRACE_DIR.
  std::string RingFile() const { return file_.path(); }

  // Bytes the recorder holds: the rings of the ranks that recorded a call (each
  // entries_per_rank() entries) and the call sites (jaxcomm.memory()).
  size_t MemoryBytes() const;

  // Per-site statistics, and their reset.
  std::vector<const TraceSite*> Sites() const;
  void ResetStats();

  // Starts the dumper thread and installs the SIGUSR1 handler (unless the signal already
  // has one, or `handle_signal` is false: a second recorder of the process leaves the
  // signal to the first). Dumps go to dump_dir(), else the current directory. Nothing
  // when the recorder is off (JAXCOMM_TRACE_ENTRIES=0).
  void StartDumper(bool handle_signal = true);
  // The recorder's own CPU cost of one round of `ranks` ranks (every hook, as the
  // rendezvous calls them), in nanoseconds, measured on a private recorder: the part of
  // the overhead that does not drown in a shared machine's noise.
  // `dir`: a directory for the probe's rings file ("": memory), so the cost of the
  // file-backed rings can be measured too.
  static double MeasureRoundCostNs(int ranks, int rounds, size_t entries = 2048, const std::string& dir = "");

  // The self-pipe's write end, for the SIGUSR1 handler (-1 before StartDumper).
  int signal_fd() const { return wake_write_.load(std::memory_order_relaxed); }

  // How many automatic dumps (timeouts, errors, SIGUSR1) were written; tests wait on it.
  int64_t auto_dumps() const { return auto_dumps_.load(); }

 private:
  using Entry = TraceEntry;
  struct Ring;
  static constexpr size_t kMaxRings = TraceFile::kMaxRings;  // local ranks of one process
  static constexpr size_t kSiteSlots = 1 << 14;     // open addressing: at most half full
  static constexpr size_t kMaxSites = kSiteSlots / 2;
  static constexpr size_t kMaxErrors = 1024;

  Ring* RingOf(int64_t partition);
  const TraceSite* SiteById(uint32_t id) const;
  Entry* Resolve(uint64_t handle) const;
  void RequestDump(char reason);
  void DumperLoop();

  const size_t entries_;
  const std::string dump_dir_;
  std::string tag_;  // set_tag: "" for the process's first recorder
  std::atomic<bool> enabled_;

  std::array<std::atomic<Ring*>, kMaxRings> ring_slots_{};
  std::array<std::atomic<const TraceSite*>, kSiteSlots> site_slots_{};
  std::array<std::atomic<const TraceSite*>, kMaxSites + 1> site_by_id_{};  // last: overflow_
  TraceFile file_;
  mutable std::mutex mu_;  // owners of rings and sites; taken on first use only
  std::vector<std::unique_ptr<Ring>> rings_;
  std::deque<std::unique_ptr<TraceSite>> sites_;
  std::unique_ptr<TraceSite> overflow_;

  mutable std::mutex errors_mu_;
  std::map<uint64_t, std::string> errors_;  // handle -> error text, bounded
  std::deque<uint64_t> error_order_;

  std::once_flag dumper_once_;
  int wake_read_ = -1;
  std::atomic<int> wake_write_{-1};  // self-pipe: signal handler and RequestDump (lock-free)
  std::atomic<int64_t> auto_dumps_{0};
  std::thread dumper_;
};

// "float32", "int8", ... for an XLA FFI DataType value.
const char* DtypeName(uint8_t dtype);

}  // namespace jaxcomm
