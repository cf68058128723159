// What the emulated CUDA runtime offers beyond the CUDA API: for the SIMT layer (kernel
// launches), the XLA seam (a stream per device, device scratch), and tests (strict-check
// reports, injected faults). Nothing in ffi/cuda/ includes this header.
//
// The runtime itself (ffi/cuda_emu/runtime/*.cc) emulates, on the host:
//  - devices: 8 physical ones, of which CUDA_VISIBLE_DEVICES picks the process's, as
//    with CUDA (devices.cc), with a per-thread current device;
//  - device memory: cudaMalloc'd blocks are shared memory (so that IPC handles work
//    between processes) poisoned with kPoison when allocated;
//  - streams: each one a worker thread that runs its work in order, asynchronously to the
//    host; the legacy default stream synchronizes with the device's blocking streams as
//    CUDA's does, and non-blocking streams do not wait for it;
//  - events: record/query/synchronize/wait across streams and processes (IPC events live
//    in shared memory);
//  - errors: the per-thread last error (cudaGetLastError clears it, cudaPeekAtLastError
//    does not, cudaEventQuery's cudaErrorNotReady is kept), and sticky errors that every
//    later call returns;
//  - strict checks (on unless JAXCOMM_EMU_STRICT=0): misuse that a GPU turns into silent
//    corruption or a hang fails the call and is reported (StrictViolations()).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace jaxcomm::cuda_emu {

// Every byte of fresh device memory: 0x7FBADBAD as int32 or float32 is a NaN / a huge index.
constexpr uint32_t kPoison = 0x7FBADBADu;

// Limits the emulated device enforces (an H100's).
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxBlockDimZ = 64;
constexpr unsigned kMaxGridX = 0x7fffffffu;
constexpr unsigned kMaxGridYZ = 65535;
constexpr size_t kMaxSharedPerBlock = 48 * 1024;  // without the opt-in attribute
constexpr size_t kMaxPitch = 2147483647;

// Work a stream runs in order; `what` names it in errors. The work of a kernel launch.
cudaError_t Enqueue(cudaStream_t stream, std::function<void()> work, const char* what);

// Checks a launch configuration as the runtime does: cudaErrorInvalidConfiguration (not
// sticky: the launch is dropped, the error is the thread's last error).
cudaError_t CheckLaunch(dim3 grid, dim3 block, size_t shared_bytes);

// Sets the calling thread's last error (what a failed launch leaves behind).
void SetLastError(cudaError_t error);

// A fault inside running device work (a kernel's trap, a barrier not every thread
// reaches): sticky, every later runtime call in the process returns it.
void RaiseStickyError(cudaError_t error, const std::string& why);

// The sticky error's explanation ("" if none), and clearing it (tests only: a real
// process cannot recover from a sticky error).
std::string StickyErrorWhy();
void ResetStickyErrorForTests();

// Strict-check reports so far (each also printed to stderr), and taking them.
std::vector<std::string> TakeStrictViolations();
bool Strict();
void SetStrict(bool on);

// The stream the XLA seam gives a handler of device `ordinal` (the role of XLA:GPU's
// compute stream): a blocking stream, created once per device.
cudaStream_t XlaStream(int ordinal);

// The deadline of the emulation's own waits (default 600 s; tests shorten it). A GPU
// waits forever; the emulation then raises a sticky cudaErrorLaunchTimeout instead.
void SetWaitDeadline(std::chrono::seconds limit);

// The number of emulated devices this process sees (CUDA_VISIBLE_DEVICES).
int DeviceCount();

// The physical device (the same in every process) behind ordinal `ordinal` of this
// process, or -1 for an invalid ordinal.
int PhysicalDevice(int ordinal);

// Whether [p, p + bytes) lies in one live cudaMalloc'd block (false for host memory and
// for XLA:CPU's buffers, which the emulation treats as device memory it did not allocate).
bool IsDeviceAllocation(const void* p, size_t bytes);

}  // namespace jaxcomm::cuda_emu
