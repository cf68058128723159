// Where the flight recorder keeps its rings: anonymous memory, or, when JAXCOMM_TRACE_DIR
// is set, a shared mapping of the file jaxcomm-ring-p<process>-<pid>.bin in that
// directory. What a process writes into a shared file mapping is in the kernel's page
// cache the moment it is written, so the file keeps the process's last calls however it
// ends: SIGKILL, _exit, an abort by JAX's coordination service, a crash. Without a dump
// of its own, such a process is read from this file (jaxcomm/trace/ringfile.py).
//
// Layout (little-endian, fixed offsets; version 1; jaxcomm/trace/ringfile.py reads it):
//   [0, 4096)            header (TraceFileHeader)
//   [4096, +16 KiB)      ring directory: per ring {partition, calls so far}
//   sites region         append-only: per call site {u32 length, u32 site id, JSON}
//   errors region        kErrorSlots slots of kErrorSlotBytes: {partition, seq, length, text}
//   rings                ring k at rings_offset + k * ring_stride: entries of 96 bytes
// The file is sparse: only the pages written take space.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace jaxcomm {

// One recorded call as stored: plain relaxed atomics (the dumper reads while ranks write;
// a torn field is impossible). `seq` is 0 while the slot is being (re)claimed, so a
// reader skips an entry that is half old call, half new.
struct TraceEntry {
  std::atomic<uint64_t> seq{0};  // the rank's call number (from 1)
  std::atomic<int64_t> run_id{0};
  std::atomic<int64_t> execution{0};
  std::atomic<int64_t> elements{0};
  std::atomic<int64_t> bytes{0};
  std::atomic<int64_t> enqueue_us{0};
  std::atomic<int64_t> start_us{0};
  std::atomic<int64_t> end_us{0};
  // Ranks (< 64) a fault-tolerant call went on without (their process died or was late).
  std::atomic<uint64_t> left_out{0};
  std::atomic<uint32_t> site{0};  // TraceSite::id
  std::atomic<int32_t> rank{-1};
  std::atomic<uint8_t> dtype{0};
  std::atomic<uint8_t> state{0};
  uint8_t reserved[14] = {};
};
static_assert(sizeof(TraceEntry) == 96, "ringfile.py reads 96-byte entries");

class TraceFile {
 public:
  static constexpr size_t kMaxRings = 1024;  // local ranks of one process
  static constexpr uint32_t kErrorSlots = 512;
  static constexpr uint32_t kErrorSlotBytes = 2048;
  static constexpr size_t kSiteBytes = size_t{4} << 20;

  // `dir` empty: rings in anonymous memory, no file. Otherwise the file is created when
  // the first ring is (a process that never records leaves none); if that fails, one
  // warning and anonymous memory.
  TraceFile(std::string dir, size_t entries_per_ring);
  ~TraceFile();
  TraceFile(const TraceFile&) = delete;
  TraceFile& operator=(const TraceFile&) = delete;

  struct RingMemory {
    TraceEntry* entries = nullptr;
    std::atomic<uint64_t>* next = nullptr;  // calls recorded so far
  };
  // Memory for the ring of `partition` (called once per partition, under the recorder's
  // lock); entries == nullptr when out of memory.
  // `process` names the file when this first ring creates it.
  RingMemory AddRing(int64_t partition, int64_t process);
  // Describes call site `id` in the file (`json`: one object); no-op without a file.
  // Sites come before the first ring: this may create the file.
  void AddSite(uint32_t id, const std::string& json, int64_t process);
  // Keeps the error of (partition, seq) in the file (cut to a slot); no-op without a file.
  void AddError(int64_t partition, uint64_t seq, const std::string& text);
  // Marks the file as written by a live process now (the dumper thread, every second):
  // a reader takes it as the time of the records, like a dump's dumped_at_us.
  void Heartbeat(int64_t process);
  // The file's path ("" without one).
  std::string path() const;
  // A second recorder of one process (the CUDA emulation's module has its own copy of
  // core/) names its file jaxcomm-ring-p<process>-<pid>-<tag>.bin, apart from the first's.
  // Before the file is created (the first recorded call).
  void set_tag(const std::string& tag);

  struct Header;  // trace_file.cc

 private:
  bool OpenFile(int64_t process);  // under mu_
  Header* header() const;

  const std::string dir_;
  const size_t entries_;
  const size_t ring_stride_;
  mutable std::mutex mu_;
  bool tried_ = false;
  int fd_ = -1;
  std::string path_;
  std::string tag_;  // set_tag
  // The header, directory, sites and errors (null without a file): set once.
  std::atomic<char*> base_{nullptr};
  std::vector<std::pair<void*, size_t>> mappings_;  // rings, file-backed or anonymous
  std::mutex errors_mu_;  // slot writes (rare: failures)
};

}  // namespace jaxcomm
