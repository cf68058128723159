// Error state as the CUDA runtime keeps it: a last error per host thread (cudaGetLastError
// returns and clears it, cudaPeekAtLastError only returns it), and sticky errors (a fault
// in device work corrupts the context: every later call returns the error, and
// cudaGetLastError does not clear it). Strict-check violations are collected here too.
#include <cstdio>

#include "cuda_emu/runtime/emu.h"
#include "cuda_emu/runtime/state.h"

namespace jaxcomm::cuda_emu {
namespace {
thread_local cudaError_t last_error = cudaSuccess;
}  // namespace

cudaError_t CheckSticky() {
  return static_cast<cudaError_t>(Runtime::Get().sticky.load(std::memory_order_acquire));
}

cudaError_t Fail(cudaError_t error) {
  const cudaError_t sticky = CheckSticky();
  if (sticky != cudaSuccess) return sticky;
  if (error != cudaSuccess) last_error = error;
  return error;
}

void SetLastError(cudaError_t error) { Fail(error); }

void RaiseStickyError(cudaError_t error, const std::string& why) {
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.sticky_mu);
  int expected = cudaSuccess;
  if (rt.sticky.compare_exchange_strong(expected, error)) {
    rt.sticky_why = why;
    std::fprintf(stderr, "jaxcomm CUDA emulation: sticky error %s: %s\n", cudaGetErrorName(error), why.c_str());
  }
}

std::string StickyErrorWhy() {
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.sticky_mu);
  return rt.sticky_why;
}

void ResetStickyErrorForTests() {
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.sticky_mu);
  rt.sticky.store(cudaSuccess);
  rt.sticky_why.clear();
}

cudaError_t Violation(cudaError_t error, const std::string& what) {
  Runtime& rt = Runtime::Get();
  if (!rt.strict.load()) return cudaSuccess;
  {
    std::lock_guard<std::mutex> lock(rt.violations_mu);
    rt.violations.push_back(what);
  }
  std::fprintf(stderr, "jaxcomm CUDA emulation, strict check: %s\n", what.c_str());
  return Fail(error);
}

std::vector<std::string> TakeStrictViolations() {
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> lock(rt.violations_mu);
  std::vector<std::string> out;
  out.swap(rt.violations);
  return out;
}

bool Strict() { return Runtime::Get().strict.load(); }
void SetStrict(bool on) { Runtime::Get().strict.store(on); }

}  // namespace jaxcomm::cuda_emu

using namespace jaxcomm::cuda_emu;

cudaError_t cudaGetLastError(void) {
  const cudaError_t sticky = CheckSticky();
  if (sticky != cudaSuccess) return sticky;
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) {
  const cudaError_t sticky = CheckSticky();
  return sticky != cudaSuccess ? sticky : last_error;
}

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
#define JAXCOMM_EMU_NAME(e) \
  case e:                   \
    return #e;
    JAXCOMM_EMU_NAME(cudaSuccess)
    JAXCOMM_EMU_NAME(cudaErrorInvalidValue)
    JAXCOMM_EMU_NAME(cudaErrorMemoryAllocation)
    JAXCOMM_EMU_NAME(cudaErrorInitializationError)
    JAXCOMM_EMU_NAME(cudaErrorInvalidConfiguration)
    JAXCOMM_EMU_NAME(cudaErrorInvalidPitchValue)
    JAXCOMM_EMU_NAME(cudaErrorInvalidDevicePointer)
    JAXCOMM_EMU_NAME(cudaErrorInvalidMemcpyDirection)
    JAXCOMM_EMU_NAME(cudaErrorInvalidResourceHandle)
    JAXCOMM_EMU_NAME(cudaErrorIllegalState)
    JAXCOMM_EMU_NAME(cudaErrorNotReady)
    JAXCOMM_EMU_NAME(cudaErrorIllegalAddress)
    JAXCOMM_EMU_NAME(cudaErrorLaunchOutOfResources)
    JAXCOMM_EMU_NAME(cudaErrorLaunchTimeout)
    JAXCOMM_EMU_NAME(cudaErrorPeerAccessAlreadyEnabled)
    JAXCOMM_EMU_NAME(cudaErrorPeerAccessNotEnabled)
    JAXCOMM_EMU_NAME(cudaErrorSetOnActiveProcess)
    JAXCOMM_EMU_NAME(cudaErrorAssert)
    JAXCOMM_EMU_NAME(cudaErrorPeerAccessUnsupported)
    JAXCOMM_EMU_NAME(cudaErrorInvalidDevice)
    JAXCOMM_EMU_NAME(cudaErrorNoDevice)
    JAXCOMM_EMU_NAME(cudaErrorLaunchFailure)
    JAXCOMM_EMU_NAME(cudaErrorUnknown)
#undef JAXCOMM_EMU_NAME
  }
  return "cudaErrorUnknown";
}

// The real runtime's wording, so that messages read the same under emulation.
const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidPitchValue: return "invalid pitch argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchTimeout: return "the launch timed out and was terminated";
    case cudaErrorPeerAccessAlreadyEnabled: return "peer access is already enabled";
    case cudaErrorPeerAccessNotEnabled: return "peer access has not been enabled";
    case cudaErrorSetOnActiveProcess: return "cannot set while device is active in this process";
    case cudaErrorAssert: return "device-side assert triggered";
    case cudaErrorPeerAccessUnsupported: return "peer access is not supported between these two devices";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorUnknown: return "unknown error";
  }
  return "unrecognized error code";
}
