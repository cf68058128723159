// Streams and events. Each stream is a worker thread that runs its tasks in order,
// asynchronously to the host. A task waits first for its dependencies: events waited on
// (cudaStreamWaitEvent) and the legacy default stream's implicit ordering (work on the
// legacy stream waits for the device's blocking streams, and their work waits for it;
// cudaStreamNonBlocking streams take no part). An event is a pair of counters (recorded,
// completed generations): recording enqueues a task that completes the generation, so a
// query, a host wait or a stream's wait observe exactly the work enqueued before it.
#include <cstdio>

#include "cuda_emu/runtime/emu.h"
#include "cuda_emu/runtime/state.h"

namespace jaxcomm::cuda_emu {
namespace {

// Signalled whenever any task completes, so in-process waits wake at once; waits on
// counters in shared memory (other processes' events) poll every millisecond.
std::mutex progress_mu;
std::condition_variable progress_cv;

void NotifyProgress() {
  std::lock_guard<std::mutex> lock(progress_mu);
  progress_cv.notify_all();
}

bool Reached(const Dependency& d) { return d.counter->load(std::memory_order_acquire) >= d.target; }

// Blocks until every dependency is met or the deadline passes (false, naming the first
// unmet one in *what).
bool WaitAll(const std::vector<Dependency>& deps, std::chrono::steady_clock::time_point deadline,
             std::string* what) {
  for (const Dependency& d : deps) {
    std::unique_lock<std::mutex> lock(progress_mu);
    while (!Reached(d)) {
      if (std::chrono::steady_clock::now() >= deadline) {
        if (what != nullptr) *what = d.what;
        return false;
      }
      progress_cv.wait_for(lock, std::chrono::milliseconds(1));
    }
  }
  return true;
}

void CompleteGeneration(std::atomic<uint64_t>& completed, uint64_t g) {
  uint64_t cur = completed.load();
  while (cur < g && !completed.compare_exchange_weak(cur, g)) {
  }
}

Event* ResolveEvent(cudaEvent_t e) {
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.mu);
  Event* p = reinterpret_cast<Event*>(e);
  return rt.events.count(p) ? p : nullptr;
}

std::chrono::steady_clock::time_point Deadline() {
  return std::chrono::steady_clock::now() + Runtime::Get().timeout;
}

}  // namespace

// ----------------------------------------------------------------------------- Stream

Stream::Stream(int device_, unsigned flags_, int priority_, bool legacy_)
    : device(device_), flags(flags_), priority(priority_), legacy(legacy_), worker_([this] { Run(); }) {}

Stream::~Stream() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

uint64_t Stream::Push(Task task) {
  std::lock_guard<std::mutex> lock(mu_);
  task.seq = ++pushed_;
  queue_.push_back(std::move(task));
  cv_.notify_one();
  return pushed_.load();
}

bool Stream::Drain(std::chrono::steady_clock::time_point deadline) {
  const uint64_t target = pushed_.load();
  std::unique_lock<std::mutex> lock(mu_);
  return done_cv_.wait_until(lock, deadline, [&] { return completed_->load() >= target; });
}

bool Stream::Touches(uintptr_t begin, uintptr_t end) {
  std::lock_guard<std::mutex> lock(mu_);
  auto overlaps = [&](const Range& r) { return r.begin < end && begin < r.end; };
  for (const Range& r : running_touches_) {
    if (overlaps(r)) return true;
  }
  for (const Task& t : queue_) {
    for (const Range& r : t.touches) {
      if (overlaps(r)) return true;
    }
  }
  return false;
}

void Stream::Run() {
  for (;;) {
    Task t;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopped and drained
      t = std::move(queue_.front());
      queue_.pop_front();
      running_touches_ = t.touches;
    }
    // A GPU would wait forever; the emulation gives up after twice its deadline (so that
    // jaxcomm's own deadlines fire first) and poisons the context.
    std::string unmet;
    if (!WaitAll(t.deps, Deadline() + Runtime::Get().timeout, &unmet)) {
      RaiseStickyError(cudaErrorLaunchTimeout,
                       std::string("a stream of device ") + std::to_string(device) + " waited past the deadline for " +
                           unmet + " before " + t.what);
    } else if (CheckSticky() == cudaSuccess && t.work) {
      t.work();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      running_touches_.clear();
      completed_->store(t.seq, std::memory_order_release);
    }
    done_cv_.notify_all();
    NotifyProgress();
  }
}

uint64_t Submit(Stream* s, Task task) {
  Runtime& rt = Runtime::Get();
  Stream* legacy = s->legacy ? nullptr : rt.LegacyStream(s->device);
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    if (s->legacy) {
      for (Stream* b : rt.streams) {
        if (b != s && !b->legacy && b->device == s->device && !(b->flags & cudaStreamNonBlocking)) {
          task.deps.push_back({b->completed_.get(), b->pushed_.load(), b->completed_, "a blocking stream's work"});
        }
      }
    } else if (!(s->flags & cudaStreamNonBlocking)) {
      task.deps.push_back(
          {legacy->completed_.get(), legacy->pushed_.load(), legacy->completed_, "the legacy stream's work"});
    }
  }
  return s->Push(std::move(task));
}

cudaError_t Enqueue(cudaStream_t stream, std::function<void()> work, const char* what) {
  if (cudaError_t e = CheckSticky()) return e;
  Stream* s = Runtime::Get().Resolve(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  Task t;
  t.work = std::move(work);
  t.what = what;
  Submit(s, std::move(t));
  return cudaSuccess;
}

cudaError_t CheckLaunch(dim3 grid, dim3 block, size_t shared_bytes) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  const bool ok = threads >= 1 && threads <= kMaxThreadsPerBlock && block.z <= kMaxBlockDimZ && grid.x >= 1 &&
                  grid.y >= 1 && grid.z >= 1 && grid.x <= kMaxGridX && grid.y <= kMaxGridYZ &&
                  grid.z <= kMaxGridYZ && shared_bytes <= kMaxSharedPerBlock;
  return ok ? cudaSuccess : cudaErrorInvalidConfiguration;
}

cudaStream_t XlaStream(int ordinal) {
  Runtime& rt = Runtime::Get();
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    auto it = rt.xla_streams.find(ordinal);
    if (it != rt.xla_streams.end()) return it->second;
  }
  auto* s = new Stream(ordinal, cudaStreamDefault, 0, false);
  std::lock_guard<std::mutex> lock(rt.mu);
  auto [it, fresh] = rt.xla_streams.emplace(ordinal, reinterpret_cast<cudaStream_t>(s));
  if (fresh) {
    rt.streams.insert(s);
  } else {
    delete s;
  }
  return it->second;
}

}  // namespace jaxcomm::cuda_emu

using namespace jaxcomm::cuda_emu;

// ------------------------------------------------------------------------------ streams

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int flags, int priority) {
  if (cudaError_t e = CheckSticky()) return e;
  if (stream == nullptr || (flags & ~unsigned{cudaStreamNonBlocking}) != 0) return Fail(cudaErrorInvalidValue);
  auto* s = new Stream(CurrentDevice(), flags, priority, false);
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.mu);
  rt.streams.insert(s);
  *stream = reinterpret_cast<cudaStream_t>(s);
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  return cudaStreamCreateWithPriority(stream, flags, 0);
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithPriority(stream, 0, 0); }

// The real call returns at once and lets queued work finish; the emulation lets it
// finish first (the worker thread must be joined).
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (cudaError_t e = CheckSticky()) return e;
  Runtime& rt = Runtime::Get();
  Stream* s = nullptr;
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    s = reinterpret_cast<Stream*>(stream);
    if (stream == nullptr || s->legacy || !rt.streams.count(s)) return Fail(cudaErrorInvalidResourceHandle);
    for (auto& [dev, xs] : rt.xla_streams) {
      if (xs == stream) return Fail(cudaErrorInvalidResourceHandle);
    }
    rt.streams.erase(s);
  }
  s->Drain(Deadline());
  delete s;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (cudaError_t e = CheckSticky()) return e;
  Stream* s = Runtime::Get().Resolve(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  if (!s->Drain(Deadline())) return Fail(cudaErrorLaunchTimeout);
  return CheckSticky();
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  if (cudaError_t e = CheckSticky()) return e;
  Stream* s = Runtime::Get().Resolve(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  return s->Idle() ? cudaSuccess : Fail(cudaErrorNotReady);
}

cudaError_t cudaDeviceSynchronize(void) {
  if (cudaError_t e = CheckSticky()) return e;
  Runtime& rt = Runtime::Get();
  const int device = CurrentDevice();
  rt.LegacyStream(device);
  std::vector<Stream*> mine;
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    for (Stream* s : rt.streams) {
      if (s->device == device) mine.push_back(s);
    }
  }
  for (Stream* s : mine) {
    if (!s->Drain(Deadline())) return Fail(cudaErrorLaunchTimeout);
  }
  return CheckSticky();
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data) {
  if (fn == nullptr) return Fail(cudaErrorInvalidValue);
  return Enqueue(stream, [fn, user_data] { fn(user_data); }, "a host function");
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  if (cudaError_t e = CheckSticky()) return e;
  if (flags != 0) return Fail(cudaErrorInvalidValue);
  Stream* s = Runtime::Get().Resolve(stream);
  Event* ev = ResolveEvent(event);
  if (s == nullptr || ev == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  const uint64_t target = ev->counters->recorded.load(std::memory_order_acquire);
  if (target == 0) {
    // CUDA treats it as a no-op: the usual symptom of a missing record or a race with it.
    if (cudaError_t e = Violation(cudaErrorInvalidResourceHandle,
                                  "cudaStreamWaitEvent on an event that was never recorded")) {
      return e;
    }
    return cudaSuccess;
  }
  Task t;
  t.what = "an event wait";
  t.deps.push_back({&ev->counters->completed, target, ev->counters, "a waited event"});
  Submit(s, std::move(t));
  return cudaSuccess;
}

// ------------------------------------------------------------------------------- events

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (cudaError_t e = CheckSticky()) return e;
  const unsigned known = cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
  if (event == nullptr || (flags & ~known) != 0) return Fail(cudaErrorInvalidValue);
  // As CUDA: an interprocess event must disable timing.
  if ((flags & cudaEventInterprocess) && !(flags & cudaEventDisableTiming)) return Fail(cudaErrorInvalidValue);
  auto* ev = new Event();
  ev->flags = flags;
  if (!(flags & cudaEventInterprocess)) {
    ev->counters = std::make_shared<EventCounters>();
  } else {
    ev->counters = SharedEventCounters(&ev->shm_fd);
    ev->serial = NextSerial();
    if (!ev->counters) {
      delete ev;
      return Fail(cudaErrorMemoryAllocation);
    }
  }
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.mu);
  rt.events.insert(ev);
  *event = reinterpret_cast<cudaEvent_t>(ev);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  Runtime& rt = Runtime::Get();
  Event* ev = nullptr;
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    ev = reinterpret_cast<Event*>(event);
    if (event == nullptr || !rt.events.erase(ev)) return Fail(cudaErrorInvalidResourceHandle);
  }
  delete ev;  // pending records and waits hold the counters
  return CheckSticky();
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (cudaError_t e = CheckSticky()) return e;
  Event* ev = ResolveEvent(event);
  Stream* s = Runtime::Get().Resolve(stream);
  if (ev == nullptr || s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  ev->ever_recorded = true;
  const uint64_t g = ev->counters->recorded.fetch_add(1) + 1;
  Task t;
  t.what = "an event record";
  t.work = [counters = ev->counters, g, ns = ev->completed_ns] {
    ns->store(std::chrono::duration_cast<std::chrono::nanoseconds>(
                  std::chrono::steady_clock::now().time_since_epoch())
                  .count());
    CompleteGeneration(counters->completed, g);
  };
  Submit(s, std::move(t));
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (cudaError_t e = CheckSticky()) return e;
  Event* ev = ResolveEvent(event);
  if (ev == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  const uint64_t target = ev->counters->recorded.load(std::memory_order_acquire);
  if (ev->counters->completed.load(std::memory_order_acquire) >= target) return cudaSuccess;
  // As the real runtime: NotReady also becomes the thread's last error.
  return Fail(cudaErrorNotReady);
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (cudaError_t e = CheckSticky()) return e;
  Event* ev = ResolveEvent(event);
  if (ev == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  const uint64_t target = ev->counters->recorded.load(std::memory_order_acquire);
  if (target == 0) {
    return Violation(cudaErrorInvalidResourceHandle, "cudaEventSynchronize on an event that was never recorded");
  }
  std::vector<Dependency> deps{{&ev->counters->completed, target, ev->counters, "the event"}};
  if (!WaitAll(deps, Deadline(), nullptr)) return Fail(cudaErrorLaunchTimeout);
  return CheckSticky();
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (cudaError_t e = CheckSticky()) return e;
  Event* a = ResolveEvent(start);
  Event* b = ResolveEvent(end);
  if (ms == nullptr) return Fail(cudaErrorInvalidValue);
  if (a == nullptr || b == nullptr || (a->flags & cudaEventDisableTiming) || (b->flags & cudaEventDisableTiming)) {
    return Fail(cudaErrorInvalidResourceHandle);
  }
  for (Event* ev : {a, b}) {
    const uint64_t target = ev->counters->recorded.load();
    if (target == 0) return Fail(cudaErrorInvalidResourceHandle);
    if (ev->counters->completed.load() < target) return Fail(cudaErrorNotReady);
  }
  *ms = static_cast<float>(b->completed_ns->load() - a->completed_ns->load()) * 1e-6f;
  return cudaSuccess;
}
