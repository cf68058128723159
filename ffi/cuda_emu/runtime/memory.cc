// Device memory: each cudaMalloc'd block is a memfd mapping (shared memory, so that
// cudaIpcGetMemHandle can hand it to another process), poisoned with kPoison. Copies and
// memsets are stream work; their bounds are checked against the block they touch, and a
// strict check reports freeing memory that queued work still uses, touching an IPC
// mapping after cudaIpcCloseMemHandle, and legacy-stream copies (a host read) racing a
// non-blocking stream's queued work on the same memory. XLA:CPU's buffers (which the emulation treats as
// device memory it did not allocate) are not in the table and are not checked.
#include <cuda.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <sstream>

#include "cuda_emu/runtime/emu.h"
#include "cuda_emu/runtime/state.h"

namespace jaxcomm::cuda_emu {
namespace {

std::string Hex(uintptr_t p) {
  std::ostringstream os;
  os << "0x" << std::hex << p;
  return os.str();
}

// Checks [p, p + n) against the allocation table: inside one block, or outside them all;
// never in a closed IPC mapping. `what` names the call in the report.
cudaError_t CheckRange(const void* ptr, size_t n, const char* what) {
  if (n == 0) return cudaSuccess;
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  Runtime& rt = Runtime::Get();
  std::string problem;
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    uintptr_t base = 0;
    if (const Allocation* a = FindAllocation(p, &base)) {
      if (p + n > base + a->size) {
        problem = std::string(what) + ": " + std::to_string(n) + " bytes at " + Hex(p) + " overrun the " +
                  std::to_string(a->size) + "-byte device block at " + Hex(base);
      }
    } else {
      auto it = rt.closed_ipc.upper_bound(p);
      if (it != rt.closed_ipc.begin() && p < std::prev(it)->first + std::prev(it)->second) {
        problem = std::string(what) + " on " + Hex(p) + ": an IPC mapping used after cudaIpcCloseMemHandle";
      }
    }
  }
  return problem.empty() ? cudaSuccess : Violation(cudaErrorInvalidValue, problem);
}

std::vector<Range> Touching(const void* a, size_t n, const void* b = nullptr, size_t m = 0) {
  std::vector<Range> r;
  if (a != nullptr && n > 0) r.push_back({reinterpret_cast<uintptr_t>(a), reinterpret_cast<uintptr_t>(a) + n});
  if (b != nullptr && m > 0) r.push_back({reinterpret_cast<uintptr_t>(b), reinterpret_cast<uintptr_t>(b) + m});
  return r;
}

bool Known(const void* p) {
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.mu);
  uintptr_t base = 0;
  return FindAllocation(reinterpret_cast<uintptr_t>(p), &base) != nullptr;
}

cudaError_t CheckKind(const void* dst, const void* src, cudaMemcpyKind kind) {
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return Fail(cudaErrorInvalidMemcpyDirection);
  // A device block named as host memory: the direction is wrong.
  if ((kind == cudaMemcpyHostToDevice && Known(src)) || (kind == cudaMemcpyDeviceToHost && Known(dst)) ||
      (kind == cudaMemcpyHostToHost && (Known(src) || Known(dst)))) {
    return Violation(cudaErrorInvalidValue, "a cudaMemcpy whose kind names device memory as host memory");
  }
  return cudaSuccess;
}

// Legacy-stream work (cudaMemcpy, cudaMemset, stream 0) is not ordered after a
// non-blocking stream's: touching memory that such a stream's queued work still uses is a
// race on a GPU (the host reads stale data, or the writes interleave). Only the copies and
// memsets of the other stream are known here (kernels do not declare what they touch).
// And the other way round: a non-blocking stream's copy or memset is not ordered after
// queued legacy-stream work (issue 30's defect 2: setup copies on the legacy stream).
cudaError_t CheckUnordered(Stream* s, const void* ptr, size_t n, const char* what) {
  const bool nonblocking = (s->flags & cudaStreamNonBlocking) != 0;
  if ((!s->legacy && !nonblocking) || n == 0) return cudaSuccess;
  const uintptr_t b = reinterpret_cast<uintptr_t>(ptr);
  Runtime& rt = Runtime::Get();
  bool racing = false;
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    for (Stream* other : rt.streams) {
      const bool unordered = s->legacy ? (other->flags & cudaStreamNonBlocking) != 0 : other->legacy;
      if (other != s && unordered && other->device == s->device && other->Touches(b, b + n)) racing = true;
    }
  }
  if (!racing) return cudaSuccess;
  return Violation(cudaErrorIllegalState,
                   std::string(what) +
                       (s->legacy ? " on the legacy stream touches device memory that a non-blocking stream's "
                                    "queued work still uses, without synchronizing with it"
                                  : " on a non-blocking stream touches device memory that queued legacy-stream "
                                    "work (cudaMemcpy, cudaMemset) still uses, without synchronizing with it"));
}

cudaError_t Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                   cudaMemcpyKind kind, cudaStream_t stream, const char* what) {
  if (cudaError_t e = CheckSticky()) return e;
  if (width == 0 || height == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return Fail(cudaErrorInvalidValue);
  if (width > dpitch || width > spitch || dpitch > kMaxPitch || spitch > kMaxPitch) {
    return Fail(cudaErrorInvalidPitchValue);
  }
  if (cudaError_t e = CheckKind(dst, src, kind)) return e;
  const size_t dspan = dpitch * (height - 1) + width, sspan = spitch * (height - 1) + width;
  if (cudaError_t e = CheckRange(dst, dspan, what)) return e;
  if (cudaError_t e = CheckRange(src, sspan, what)) return e;
  Stream* s = Runtime::Get().Resolve(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  if (cudaError_t e = CheckUnordered(s, dst, dspan, what)) return e;
  if (cudaError_t e = CheckUnordered(s, src, sspan, what)) return e;
  Task t;
  t.what = what;
  t.touches = Touching(dst, dspan, src, sspan);
  t.work = [=] {
    for (size_t r = 0; r < height; ++r) {
      std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
    }
  };
  Submit(s, std::move(t));
  return cudaSuccess;
}

}  // namespace

uint64_t NextSerial() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

const Allocation* FindAllocation(uintptr_t p, uintptr_t* base) {
  auto& table = Runtime::Get().allocations;
  auto it = table.upper_bound(p);
  if (it == table.begin()) return nullptr;
  --it;
  if (p >= it->first + it->second.size) return nullptr;
  *base = it->first;
  return &it->second;
}

bool IsDeviceAllocation(const void* p, size_t bytes) {
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.mu);
  uintptr_t base = 0;
  const Allocation* a = FindAllocation(reinterpret_cast<uintptr_t>(p), &base);
  return a != nullptr && reinterpret_cast<uintptr_t>(p) + bytes <= base + a->size;
}

}  // namespace jaxcomm::cuda_emu

using namespace jaxcomm::cuda_emu;

CUresult cuMemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) {
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.mu);
  uintptr_t b = 0;
  const Allocation* a = FindAllocation(static_cast<uintptr_t>(ptr), &b);
  if (a == nullptr) return CUDA_ERROR_NOT_FOUND;
  if (base != nullptr) *base = b;
  if (size != nullptr) *size = a->size;
  return CUDA_SUCCESS;
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (cudaError_t e = CheckSticky()) return e;
  if (ptr == nullptr) return Fail(cudaErrorInvalidValue);
  *ptr = nullptr;
  if (size == 0) return cudaSuccess;
  const int fd = memfd_create("jaxcomm-emu-device-memory", MFD_CLOEXEC);
  if (fd < 0) return Fail(cudaErrorMemoryAllocation);
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    return Fail(cudaErrorMemoryAllocation);
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return Fail(cudaErrorMemoryAllocation);
  }
  // cudaMalloc'd memory holds whatever was there before: never zeros to rely on.
  uint32_t* words = static_cast<uint32_t*>(p);
  for (size_t i = 0; i < size / 4; ++i) words[i] = kPoison;
  std::memset(static_cast<char*>(p) + size / 4 * 4, 0xBA, size % 4);
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.mu);
  rt.allocations[reinterpret_cast<uintptr_t>(p)] = Allocation{size, CurrentDevice(), fd, false, NextSerial()};
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (cudaError_t e = CheckSticky()) return e;
  if (ptr == nullptr) return cudaSuccess;
  Runtime& rt = Runtime::Get();
  Allocation a;
  std::vector<Stream*> users;
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    auto it = rt.allocations.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == rt.allocations.end() || it->second.imported) return Fail(cudaErrorInvalidValue);
    a = it->second;
    const uintptr_t b = it->first;
    for (Stream* s : rt.streams) {
      if (s->Touches(b, b + a.size)) users.push_back(s);
    }
    if (users.empty() || !rt.strict.load()) rt.allocations.erase(it);
  }
  if (!users.empty()) {
    if (cudaError_t e = Violation(cudaErrorIllegalState,
                                  "cudaFree of a device block that queued stream work still uses")) {
      return e;
    }
    for (Stream* s : users) s->Drain(std::chrono::steady_clock::now() + rt.timeout);
  }
  munmap(ptr, a.size);
  close(a.fd);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  if (cudaError_t e = CheckSticky()) return e;
  Runtime& rt = Runtime::Get();
  const size_t capacity = size_t{80} << 30;
  size_t used = 0;
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    for (auto& [base, a] : rt.allocations) {
      if (a.device == CurrentDevice() && !a.imported) used += a.size;
    }
  }
  if (free != nullptr) *free = capacity > used ? capacity - used : 0;
  if (total != nullptr) *total = capacity;
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t stream) {
  if (cudaError_t e = CheckSticky()) return e;
  if (count == 0) return cudaSuccess;
  if (ptr == nullptr) return Fail(cudaErrorInvalidValue);
  if (cudaError_t e = CheckRange(ptr, count, "cudaMemsetAsync")) return e;
  Stream* s = Runtime::Get().Resolve(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  if (cudaError_t e = CheckUnordered(s, ptr, count, "cudaMemset")) return e;
  Task t;
  t.what = "cudaMemsetAsync";
  t.touches = Touching(ptr, count);
  t.work = [=] { std::memset(ptr, value, count); };
  Submit(s, std::move(t));
  return cudaSuccess;
}

// As documented, cudaMemset may return before the memory is set: it is legacy-stream
// work (which a cudaStreamNonBlocking stream does not wait for).
cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  return cudaMemsetAsync(ptr, value, count, nullptr);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream) {
  return Copy2D(dst, count, src, count, count, 1, kind, stream, "cudaMemcpyAsync");
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t stream) {
  return Copy2D(dst, dpitch, src, spitch, width, height, kind, stream, "cudaMemcpy2DAsync");
}

// Synchronous: legacy-stream work the host waits for.
cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  if (cudaError_t e = Copy2D(dst, count, src, count, count, 1, kind, nullptr, "cudaMemcpy")) return e;
  return cudaStreamSynchronize(nullptr);
}
