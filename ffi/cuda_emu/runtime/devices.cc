// Emulated devices: their count, the per-thread current device, properties and limits
// (an H100's), peer access (refused to the device itself, as a real GPU does), versions,
// and the one driver entry point ffi/cuda/ looks up.
#include <cuda.h>

#include <cstdio>
#include <cstring>

#include "cuda_emu/runtime/emu.h"
#include "cuda_emu/runtime/state.h"

namespace jaxcomm::cuda_emu {
namespace {
thread_local int current_device = 0;

bool ValidDevice(int d) { return d >= 0 && d < Runtime::Get().device_count; }
}  // namespace

int CurrentDevice() { return current_device; }
int DeviceCount() { return Runtime::Get().device_count; }

Runtime& Runtime::Get() {
  static Runtime* rt = new Runtime();  // never destroyed: workers may be parked at exit
  return *rt;
}

Runtime::Runtime() = default;

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
  return cudaSuccess;
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
  std::snprintf(prop->name, sizeof(prop->name), "jaxcomm emulated GPU %d", device);
  // The same device has the same UUID in every process (processes may share a GPU).
  const char tag[] = "jaxcomm-emu-gpu";
  std::memcpy(prop->uuid.bytes, tag, sizeof(tag) - 1);
  prop->uuid.bytes[15] = static_cast<char>(device);
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
  prop->pciBusID = device;
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
