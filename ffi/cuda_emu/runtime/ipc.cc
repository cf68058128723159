// CUDA IPC between processes: a memory handle names the exporting process and the memfd
// behind a cudaMalloc'd block (and a serial: descriptors are reused, handles never are) (opened through /proc/<pid>/fd, so the processes must be
// able to see each other's descriptors, as same-user processes on one host can); an event
// handle names the memfd holding an interprocess event's counters. Closing an IPC mapping
// leaves its addresses reserved and inaccessible, so that a late use faults or, through
// the runtime's calls, fails a strict check instead of reading another block.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "cuda_emu/runtime/emu.h"
#include "cuda_emu/runtime/state.h"

namespace jaxcomm::cuda_emu {
namespace {

constexpr char kMemMagic[8] = "JCEMU-M";
constexpr char kEventMagic[8] = "JCEMU-E";

struct HandleBody {
  char magic[8];
  int32_t pid;
  int32_t fd;
  uint64_t size;
  int32_t device;  // physical
  uint64_t serial;  // the block's or event's (state.h): descriptors are reused
};
static_assert(sizeof(HandleBody) <= CUDA_IPC_HANDLE_SIZE, "an IPC handle is 64 bytes");

template <typename H>
void Write(H* h, const HandleBody& body) {
  std::memset(h, 0, sizeof(*h));
  std::memcpy(h->reserved, &body, sizeof(body));
}

template <typename H>
bool Read(const H& h, const char* magic, HandleBody* body) {
  std::memcpy(body, h.reserved, sizeof(*body));
  return std::memcmp(body->magic, magic, sizeof(body->magic)) == 0;
}

int OpenPeerFd(int pid, int fd) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  return open(path.c_str(), O_RDWR | O_CLOEXEC);
}

}  // namespace

std::shared_ptr<EventCounters> SharedEventCounters(int* fd) {
  const int f = memfd_create("jaxcomm-emu-ipc-event", MFD_CLOEXEC);
  if (f < 0 || ftruncate(f, sizeof(EventCounters)) != 0) {
    if (f >= 0) close(f);
    return nullptr;
  }
  void* p = mmap(nullptr, sizeof(EventCounters), PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  if (p == MAP_FAILED) {
    close(f);
    return nullptr;
  }
  *fd = f;
  return std::shared_ptr<EventCounters>(new (p) EventCounters(), [f](EventCounters* c) {
    munmap(c, sizeof(EventCounters));
    close(f);
  });
}

std::shared_ptr<EventCounters> OpenSharedEventCounters(int pid, int fd) {
  const int f = OpenPeerFd(pid, fd);
  if (f < 0) return nullptr;
  void* p = mmap(nullptr, sizeof(EventCounters), PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  close(f);
  if (p == MAP_FAILED) return nullptr;
  // The exporter constructed the counters; this process only maps them.
  return std::shared_ptr<EventCounters>(static_cast<EventCounters*>(p),
                                        [](EventCounters* c) { munmap(c, sizeof(EventCounters)); });
}

}  // namespace jaxcomm::cuda_emu

using namespace jaxcomm::cuda_emu;

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* ptr) {
  if (cudaError_t e = CheckSticky()) return e;
  if (handle == nullptr) return Fail(cudaErrorInvalidValue);
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.mu);
  uintptr_t base = 0;
  const Allocation* a = FindAllocation(reinterpret_cast<uintptr_t>(ptr), &base);
  // Only cudaMalloc'd blocks of this process export (not XLA:CPU's buffers, not imports).
  if (a == nullptr || a->imported) return Fail(cudaErrorInvalidValue);
  HandleBody body{};
  std::memcpy(body.magic, kMemMagic, sizeof(body.magic));
  body.pid = getpid();
  body.fd = a->fd;
  body.size = a->size;
  body.device = PhysicalDevice(a->device);  // ordinals differ between processes
  body.serial = a->serial;
  Write(handle, body);
  return cudaSuccess;
}

cudaError_t cudaIpcOpenMemHandle(void** ptr, cudaIpcMemHandle_t handle, unsigned int flags) {
  if (cudaError_t e = CheckSticky()) return e;
  if (ptr == nullptr || (flags & ~unsigned{cudaIpcMemLazyEnablePeerAccess}) != 0) return Fail(cudaErrorInvalidValue);
  HandleBody body{};
  if (!Read(handle, kMemMagic, &body)) return Fail(cudaErrorInvalidValue);
  // As CUDA: a process cannot open its own handles.
  if (body.pid == getpid()) return Fail(cudaErrorInvalidResourceHandle);
  const int f = OpenPeerFd(body.pid, body.fd);
  if (f < 0) return Fail(cudaErrorInvalidResourceHandle);
  void* p = mmap(nullptr, body.size, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  close(f);
  if (p == MAP_FAILED) return Fail(cudaErrorMemoryAllocation);
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.mu);
  int device = -1;  // this process's ordinal of the exporter's GPU, if it sees it
  for (size_t d = 0; d < rt.visible.size(); ++d) {
    if (rt.visible[d] == body.device) device = static_cast<int>(d);
  }
  rt.allocations[reinterpret_cast<uintptr_t>(p)] = Allocation{body.size, device, -1, true};
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaIpcCloseMemHandle(void* ptr) {
  if (cudaError_t e = CheckSticky()) return e;
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.mu);
  auto it = rt.allocations.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == rt.allocations.end() || !it->second.imported) return Fail(cudaErrorInvalidValue);
  const size_t size = it->second.size;
  rt.allocations.erase(it);
  // Reserved and inaccessible from now on (never reused by another mapping).
  mmap(ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  rt.closed_ipc[reinterpret_cast<uintptr_t>(ptr)] = size;
  return cudaSuccess;
}

cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t* handle, cudaEvent_t event) {
  if (cudaError_t e = CheckSticky()) return e;
  if (handle == nullptr) return Fail(cudaErrorInvalidValue);
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.mu);
  Event* ev = reinterpret_cast<Event*>(event);
  if (!rt.events.count(ev)) return Fail(cudaErrorInvalidResourceHandle);
  if (!(ev->flags & cudaEventInterprocess) || ev->imported) return Fail(cudaErrorInvalidResourceHandle);
  HandleBody body{};
  std::memcpy(body.magic, kEventMagic, sizeof(body.magic));
  body.pid = getpid();
  body.fd = ev->shm_fd;
  body.serial = ev->serial;
  Write(handle, body);
  return cudaSuccess;
}

cudaError_t cudaIpcOpenEventHandle(cudaEvent_t* event, cudaIpcEventHandle_t handle) {
  if (cudaError_t e = CheckSticky()) return e;
  if (event == nullptr) return Fail(cudaErrorInvalidValue);
  HandleBody body{};
  if (!Read(handle, kEventMagic, &body)) return Fail(cudaErrorInvalidValue);
  if (body.pid == getpid()) return Fail(cudaErrorInvalidResourceHandle);
  auto counters = OpenSharedEventCounters(body.pid, body.fd);
  if (!counters) return Fail(cudaErrorInvalidResourceHandle);
  auto* ev = new Event();
  ev->flags = cudaEventInterprocess | cudaEventDisableTiming;
  ev->counters = std::move(counters);
  ev->imported = true;
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.mu);
  rt.events.insert(ev);
  *event = reinterpret_cast<cudaEvent_t>(ev);
  return cudaSuccess;
}
