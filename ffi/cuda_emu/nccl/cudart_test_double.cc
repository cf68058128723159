// TEST DOUBLE of the CUDA runtime, for tests/emulation/test_nccl_mock.py only: just the
// functions that the mock NCCL and its test call, so that the mock can be tested before
// (and apart from) the emulated runtime of ffi/cuda_emu/runtime. Not a CUDA emulation:
// "device" memory is host memory, each stream is one worker thread running host
// functions in order, and device d of every process is the host's GPU d (PCI bus d + 1),
// as when each process of one machine picks its GPU with cudaSetDevice.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

extern "C" {
typedef struct CUstream_st* cudaStream_t;
typedef int cudaError_t;
typedef void (*cudaHostFn_t)(void*);
}

struct CUstream_st {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  bool busy = false, stop = false;
  std::thread worker{[this] { Run(); }};

  void Run() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;  // stopped and drained
      auto fn = std::move(queue.front());
      queue.pop_front();
      busy = true;
      lock.unlock();
      fn();
      lock.lock();
      busy = false;
      cv.notify_all();
    }
  }
  ~CUstream_st() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    worker.join();
  }
};

namespace {
constexpr int kDevices = 8;
constexpr cudaError_t kInvalidValue = 1, kInvalidDevice = 101, kTimeout = 702;
thread_local int current_device = 0;

CUstream_st* Resolve(cudaStream_t s) {
  static CUstream_st* legacy = new CUstream_st;  // the default stream; lives to the end
  return s == nullptr ? legacy : s;
}
}  // namespace

extern "C" {

__attribute__((visibility("default"))) cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= kDevices) return kInvalidDevice;
  current_device = device;
  return 0;
}

__attribute__((visibility("default"))) cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return 0;
}

__attribute__((visibility("default"))) cudaError_t cudaDeviceGetPCIBusId(char* bus, int len, int device) {
  if (device < 0 || device >= kDevices) return kInvalidDevice;
  std::snprintf(bus, static_cast<size_t>(len), "0000:%02x:00.0", device + 1);
  return 0;
}

__attribute__((visibility("default"))) const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case 0: return "no error";
    case kInvalidValue: return "invalid argument";
    case kInvalidDevice: return "invalid device ordinal";
    case kTimeout: return "the launch timed out and was terminated";
    default: return "unknown error";
  }
}

__attribute__((visibility("default"))) cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  *stream = new CUstream_st;
  return 0;
}

__attribute__((visibility("default"))) cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete stream;
  return 0;
}

__attribute__((visibility("default"))) cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn,
                                                                      void* data) {
  if (fn == nullptr) return kInvalidValue;
  CUstream_st* s = Resolve(stream);
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->queue.push_back([fn, data] { fn(data); });
  }
  s->cv.notify_all();
  return 0;
}

// Every host function has a deadline of its own (the mock NCCL's); this one only keeps a
// broken test from hanging.
__attribute__((visibility("default"))) cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  CUstream_st* s = Resolve(stream);
  std::unique_lock<std::mutex> lock(s->mu);
  const bool done = s->cv.wait_for(lock, std::chrono::seconds(600), [&] { return s->queue.empty() && !s->busy; });
  return done ? 0 : kTimeout;
}

__attribute__((visibility("default"))) cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  *ptr = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
  if (*ptr == nullptr) return 2;  // cudaErrorMemoryAllocation
  std::memset(*ptr, 0xCD, bytes);  // poisoned, as fresh device memory is garbage
  return 0;
}

__attribute__((visibility("default"))) cudaError_t cudaFree(void* ptr) {
  std::free(ptr);
  return 0;
}

// Synchronous, like cudaMemcpy on the legacy stream: waits for the default stream first.
__attribute__((visibility("default"))) cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, int) {
  const cudaError_t e = cudaStreamSynchronize(nullptr);
  if (e != 0) return e;
  std::memcpy(dst, src, bytes);
  return 0;
}

}  // extern "C"
