// Emulated devices: their count, the per-thread current device, properties and limits
// (an H100's), peer access (refused to the device itself, as a real GPU does), versions,
// and the one driver entry point ffi/cuda/ looks up.
//
// The machine has kPhysicalDevices emulated GPUs; a process sees those CUDA_VISIBLE_DEVICES
// names, as with CUDA: unset, all of them; else a comma-separated list of indices, ordinal
// k being the k-th listed, and the list ends at its first entry that is not a valid index
// (out of range, not a number, a repeat); set but empty (or starting with an invalid
// entry), none (cudaGetDeviceCount: cudaErrorNoDevice). A device's identity (UUID, PCI bus
// id, name) is its physical one, the same in every process that sees it: how the mock
// NCCL and jaxcomm's routes tell processes sharing a GPU from processes on distinct GPUs.
// (CUDA also takes UUIDs, "GPU-...", and MIG ids there; the emulation takes indices only.)
#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "cuda_emu/runtime/emu.h"
#include "cuda_emu/runtime/state.h"

namespace jaxcomm::cuda_emu {
namespace {
thread_local int current_device = 0;

bool ValidDevice(int d) { return d >= 0 && d < Runtime::Get().device_count; }
}  // namespace

int CurrentDevice() { return current_device; }
int DeviceCount() { return Runtime::Get().device_count; }

std::vector<int> VisibleDevices(const char* env, int physical) {
  std::vector<int> out;
  if (env == nullptr) {
    for (int d = 0; d < physical; ++d) out.push_back(d);
    return out;
  }
  std::set<int> seen;
  const std::string list(env);
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string item = list.substr(start, end - start);
    const size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    item = b == std::string::npos ? "" : item.substr(b, e - b + 1);
    char* rest = nullptr;
    const long d = item.empty() ? -1 : std::strtol(item.c_str(), &rest, 10);
    if (item.empty() || *rest != '\0' || d < 0 || d >= physical || !seen.insert(static_cast<int>(d)).second) break;
    out.push_back(static_cast<int>(d));
    start = end + 1;
  }
  return out;
}

int PhysicalDevice(int ordinal) {
  const Runtime& rt = Runtime::Get();
  return ordinal >= 0 && ordinal < rt.device_count ? rt.visible[ordinal] : -1;
}

Runtime& Runtime::Get() {
  static Runtime* rt = new Runtime();  // never destroyed: workers may be parked at exit
  return *rt;
}

Runtime::Runtime()
    : visible(VisibleDevices(std::getenv("CUDA_VISIBLE_DEVICES"), kPhysicalDevices)),
      device_count(static_cast<int>(visible.size())) {}

void SetWaitDeadline(std::chrono::seconds limit) { Runtime::Get().timeout = limit; }

Stream* Runtime::LegacyStream(int device) {
  std::lock_guard<std::mutex> lock(mu);
  auto& s = legacy[device];
  if (!s) {
    s = std::make_unique<Stream>(device, cudaStreamDefault, 0, /*legacy=*/true);
    streams.insert(s.get());
  }
  return s.get();
}

Stream* Runtime::Resolve(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return LegacyStream(CurrentDevice());
  std::lock_guard<std::mutex> lock(mu);
  Stream* p = reinterpret_cast<Stream*>(s);
  return streams.count(p) ? p : nullptr;
}

}  // namespace jaxcomm::cuda_emu

using namespace jaxcomm::cuda_emu;

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return Fail(cudaErrorInvalidValue);
  *count = Runtime::Get().device_count;
  return *count == 0 ? Fail(cudaErrorNoDevice) : cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (cudaError_t e = CheckSticky()) return e;
  if (!ValidDevice(device)) return Fail(cudaErrorInvalidDevice);
  current_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return Fail(cudaErrorInvalidValue);
  *device = current_device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (cudaError_t e = CheckSticky()) return e;
  if (prop == nullptr) return Fail(cudaErrorInvalidValue);
  if (!ValidDevice(device)) return Fail(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof(*prop));
  const int physical = PhysicalDevice(device);
  std::snprintf(prop->name, sizeof(prop->name), "jaxcomm emulated GPU %d", physical);
  // The same device has the same UUID in every process (processes may share a GPU).
  const char tag[] = "jaxcomm-emu-gpu";
  std::memcpy(prop->uuid.bytes, tag, sizeof(tag) - 1);
  prop->uuid.bytes[15] = static_cast<char>(physical);
  prop->totalGlobalMem = size_t{80} << 30;
  prop->sharedMemPerBlock = kMaxSharedPerBlock;
  prop->warpSize = 32;
  prop->memPitch = kMaxPitch;
  prop->maxThreadsPerBlock = kMaxThreadsPerBlock;
  prop->maxThreadsDim[0] = prop->maxThreadsDim[1] = kMaxThreadsPerBlock;
  prop->maxThreadsDim[2] = kMaxBlockDimZ;
  prop->maxGridSize[0] = static_cast<int>(kMaxGridX);
  prop->maxGridSize[1] = prop->maxGridSize[2] = static_cast<int>(kMaxGridYZ);
  prop->multiProcessorCount = 132;
  prop->major = 9;
  prop->minor = 0;
  prop->pciBusID = physical;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (cudaError_t e = CheckSticky()) return e;
  if (value == nullptr) return Fail(cudaErrorInvalidValue);
  if (!ValidDevice(device)) return Fail(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = kMaxThreadsPerBlock; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = static_cast<int>(kMaxSharedPerBlock); return cudaSuccess;
    case cudaDevAttrWarpSize: *value = 32; return cudaSuccess;
    case cudaDevAttrMaxPitch: *value = static_cast<int>(kMaxPitch); return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = 132; return cudaSuccess;
  }
  return Fail(cudaErrorInvalidValue);
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  if (least != nullptr) *least = 0;
  if (greatest != nullptr) *greatest = -5;
  return CheckSticky();
}

cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  if (cudaError_t e = CheckSticky()) return e;
  if (can == nullptr) return Fail(cudaErrorInvalidValue);
  if (!ValidDevice(device) || !ValidDevice(peer)) return Fail(cudaErrorInvalidDevice);
  *can = device != peer;  // a device is never its own peer
  return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
  if (cudaError_t e = CheckSticky()) return e;
  if (flags != 0) return Fail(cudaErrorInvalidValue);
  const int device = current_device;
  // As on a GPU: enabling access to the current device itself fails.
  if (!ValidDevice(peer) || peer == device) return Fail(cudaErrorInvalidDevice);
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.mu);
  if (!rt.peer_enabled.insert({device, peer}).second) return Fail(cudaErrorPeerAccessAlreadyEnabled);
  return cudaSuccess;
}

cudaError_t cudaDeviceDisablePeerAccess(int peer) {
  if (cudaError_t e = CheckSticky()) return e;
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.mu);
  if (rt.peer_enabled.erase({current_device, peer}) == 0) return Fail(cudaErrorPeerAccessNotEnabled);
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  if (version == nullptr) return Fail(cudaErrorInvalidValue);
  *version = 13000;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* version) {
  if (version == nullptr) return Fail(cudaErrorInvalidValue);
  *version = 13000;
  return cudaSuccess;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int,
                                             unsigned long long,
                                             cudaDriverEntryPointQueryResult* status) {
  if (symbol == nullptr || fn == nullptr) return Fail(cudaErrorInvalidValue);
  *fn = nullptr;
  if (std::strcmp(symbol, "cuMemGetAddressRange") == 0) *fn = reinterpret_cast<void*>(&cuMemGetAddressRange);
  if (status != nullptr) *status = *fn != nullptr ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}
