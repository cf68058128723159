// The emulated runtime's state, shared by its parts (errors.cc, devices.cc, memory.cc,
// streams.cc, ipc.cc). One process-wide instance (a GPU context is process-wide too),
// never destroyed: stream workers may still be parked when the process exits.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace jaxcomm::cuda_emu {

// An event's progress: generation `recorded` is complete once `completed` reaches it.
// Heap memory, or shared memory for interprocess events.
struct EventCounters {
  std::atomic<uint64_t> recorded{0};
  std::atomic<uint64_t> completed{0};
};

// Work runs once each dependency's counter reached its target.
struct Dependency {
  const std::atomic<uint64_t>* counter = nullptr;
  uint64_t target = 0;
  std::shared_ptr<const void> keep_alive;  // the counter's owner
  std::string what;                        // for the deadline's message
};

// Device memory a task touches (strict check: freeing memory a stream still uses).
struct Range {
  uintptr_t begin = 0, end = 0;
};

struct Task {
  std::function<void()> work;
  std::vector<Dependency> deps;
  std::vector<Range> touches;
  const char* what = "";
  uint64_t seq = 0;
};

class Stream {
 public:
  Stream(int device, unsigned flags, int priority, bool legacy);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // Appends a task (its deps extended with the implicit legacy-stream ordering by the
  // caller); returns its sequence number.
  uint64_t Push(Task task);
  // Blocks until every task pushed so far ran (or the deadline passed: false).
  bool Drain(std::chrono::steady_clock::time_point deadline);
  bool Idle() const { return completed_->load() >= pushed_.load(); }
  // Whether an unfinished task touches [begin, end).
  bool Touches(uintptr_t begin, uintptr_t end);

  const int device;
  const unsigned flags;
  const int priority;
  const bool legacy;
  std::shared_ptr<std::atomic<uint64_t>> completed_ = std::make_shared<std::atomic<uint64_t>>(0);
  std::atomic<uint64_t> pushed_{0};

 private:
  void Run();
  std::mutex mu_;
  std::condition_variable cv_;       // work arrived / stop
  std::condition_variable done_cv_;  // a task finished
  std::deque<Task> queue_;
  std::vector<Range> running_touches_;
  bool stop_ = false;
  std::thread worker_;
};

struct Event {
  unsigned flags = 0;
  std::shared_ptr<EventCounters> counters;  // heap, or a shared-memory view (IPC)
  bool ever_recorded = false;               // in this process (strict: wait on never recorded)
  bool imported = false;                    // opened from another process's handle
  int shm_fd = -1;                          // interprocess events: the counters' memfd
  uint64_t serial = 0;                      // interprocess events: names it in handles
  std::chrono::steady_clock::time_point recorded_at{};
  std::chrono::steady_clock::time_point completed_at{};  // set by the recording stream
  std::shared_ptr<std::atomic<int64_t>> completed_ns = std::make_shared<std::atomic<int64_t>>(0);
};

struct Allocation {
  size_t size = 0;
  int device = 0;
  int fd = -1;          // memfd backing the block (IPC export opens it through /proc)
  bool imported = false;  // mapped from another process's IPC handle
  // Names the block in IPC handles: descriptors are reused once closed, and a handle of a
  // freed block must not name a later one (a peer's cache of opened handles would map
  // the old one again, as CUDA's handles, unique, never do).
  uint64_t serial = 0;
};

class Runtime {
 public:
  static Runtime& Get();

  // Physical devices this process sees (CUDA_VISIBLE_DEVICES), by ordinal; their count.
  const std::vector<int> visible;
  const int device_count;
  std::atomic<bool> strict{true};

  std::mutex mu;
  std::set<Stream*> streams;                        // live, including legacy ones
  std::map<int, std::unique_ptr<Stream>> legacy;    // per device
  std::map<int, cudaStream_t> xla_streams;          // per device (the seam's)
  std::set<Event*> events;
  std::map<uintptr_t, Allocation> allocations;      // by base address
  std::map<uintptr_t, size_t> closed_ipc;           // ranges of closed IPC mappings
  std::set<std::pair<int, int>> peer_enabled;       // (device, peer)

  std::mutex sticky_mu;
  std::atomic<int> sticky{cudaSuccess};
  std::string sticky_why;

  std::mutex violations_mu;
  std::vector<std::string> violations;

  // The deadline of a host wait inside the emulation (a stream's wait on its dependencies
  // gets twice as long): longer than jaxcomm's default deadline (300 s), whose waits are
  // the ones meant to fire. SetWaitDeadline changes it.
  std::chrono::seconds timeout{600};

  Stream* LegacyStream(int device);
  // The stream a cudaStream_t names (nullptr, cudaStreamLegacy: the current device's
  // legacy stream); nullptr when the handle is not a live stream.
  Stream* Resolve(cudaStream_t s);

 private:
  Runtime();
};

// The emulated machine's GPUs (CUDA_VISIBLE_DEVICES picks a process's among them).
constexpr int kPhysicalDevices = 8;

// The calling thread's current device.
int CurrentDevice();

// The physical devices that CUDA_VISIBLE_DEVICES (`env`, nullptr when unset) makes
// visible, in ordinal order (devices.cc's rules).
std::vector<int> VisibleDevices(const char* env, int physical);

// Records `error` as the calling thread's last error and returns it (or the sticky
// error, which takes precedence).
cudaError_t Fail(cudaError_t error);
// The sticky error if any, else cudaSuccess: every API entry point starts with it.
cudaError_t CheckSticky();
// A strict-check violation: reported, and the call fails with `error` when strict.
cudaError_t Violation(cudaError_t error, const std::string& what);

// Pushes `task` on `s` with the legacy stream's implicit ordering.
uint64_t Submit(Stream* s, Task task);

// Interprocess event counters: fresh ones in a memfd of their own (its descriptor in *fd,
// owned by the returned pointer's deleter), or another process's, opened from its handle.
std::shared_ptr<EventCounters> SharedEventCounters(int* fd);
std::shared_ptr<EventCounters> OpenSharedEventCounters(int pid, int fd);

// A number never handed out before in this process (IPC handles' serials).
uint64_t NextSerial();

// Lookups into the allocation table (under Runtime::mu).
const Allocation* FindAllocation(uintptr_t p, uintptr_t* base);

}  // namespace jaxcomm::cuda_emu
