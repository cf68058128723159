// Cases for the emulated CUDA runtime (ffi/cuda_emu/runtime/), one per argv[1]; run by
// tests/emulation/test_runtime.py. Each case exits 0 or prints what differed and exits 1.
#include <cuda_runtime_api.h>
#include <unistd.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "cuda_emu/runtime/emu.h"
#include "expect.h"

namespace emu = jaxcomm::cuda_emu;


namespace {

void SleepMs(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// A host function that blocks its stream until Release().
struct Gate {
  std::atomic<bool> open{false};
  static void Wait(void* p) {
    auto* g = static_cast<Gate*>(p);
    while (!g->open.load()) SleepMs(1);
  }
  void Release() { open.store(true); }
};

void Append(std::vector<int>* v, int x) { v->push_back(x); }

// Work runs asynchronously and in order.
void StreamOrder() {
  cudaStream_t s;
  OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Gate gate;
  std::vector<int> order;
  OK(cudaLaunchHostFunc(s, &Gate::Wait, &gate));
  for (int i = 0; i < 5; ++i) {
    OK(emu::Enqueue(s, [&order, i] { Append(&order, i); }, "append"));
  }
  EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady);
  EXPECT_EQ(cudaGetLastError(), cudaErrorNotReady);
  EXPECT_EQ(order.size(), 0);
  gate.Release();
  OK(cudaStreamSynchronize(s));
  EXPECT_EQ(order.size(), 5);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(order[i], i);
  OK(cudaStreamDestroy(s));
}

// cudaGetLastError clears, cudaPeekAtLastError does not; an event poll's NotReady stays.
void LastError() {
  cudaStream_t s;
  cudaEvent_t ev;
  OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  EXPECT_EQ(cudaEventQuery(ev), cudaSuccess);  // never recorded: complete
  Gate gate;
  OK(cudaLaunchHostFunc(s, &Gate::Wait, &gate));
  OK(cudaEventRecord(ev, s));
  EXPECT_EQ(cudaEventQuery(ev), cudaErrorNotReady);
  EXPECT_EQ(cudaPeekAtLastError(), cudaErrorNotReady);
  EXPECT_EQ(cudaPeekAtLastError(), cudaErrorNotReady);
  EXPECT_EQ(cudaGetLastError(), cudaErrorNotReady);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  // Per thread: another thread's last error is its own.
  std::thread([&] {
    EXPECT_EQ(cudaEventQuery(ev), cudaErrorNotReady);
  }).join();
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  gate.Release();
  OK(cudaEventSynchronize(ev));
  EXPECT_EQ(cudaEventQuery(ev), cudaSuccess);
  // A failed launch configuration is not sticky.
  EXPECT_EQ(emu::CheckLaunch(dim3(1), dim3(2048), 0), cudaErrorInvalidConfiguration);
  emu::SetLastError(cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  int d = -1;
  OK(cudaGetDevice(&d));
  OK(cudaEventDestroy(ev));
  OK(cudaStreamDestroy(s));
}

void Sticky() {
  emu::RaiseStickyError(cudaErrorIllegalAddress, "test fault");
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, 16), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);  // not cleared
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorIllegalAddress);
  if (emu::StickyErrorWhy() != "test fault") std::exit(1);
  emu::ResetStickyErrorForTests();
  OK(cudaMalloc(&p, 16));
  OK(cudaFree(p));
}

void Poison() {
  void* p = nullptr;
  OK(cudaMalloc(&p, 4096 + 3));
  std::vector<uint32_t> host(1025);
  OK(cudaMemcpy(host.data(), p, 4096 + 3, cudaMemcpyDeviceToHost));
  for (int i = 0; i < 1024; ++i) EXPECT_EQ(host[i], emu::kPoison);
  // Out of the block's bounds: refused.
  EXPECT_EQ(cudaMemset(p, 0, 4100), cudaErrorInvalidValue);
  EXPECT_EQ(emu::TakeStrictViolations().size(), 1);
  OK(cudaFree(p));
}

void LaunchLimits() {
  OK(emu::CheckLaunch(dim3(1), dim3(1024), 48 * 1024));
  EXPECT_EQ(emu::CheckLaunch(dim3(1), dim3(1025), 0), cudaErrorInvalidConfiguration);
  EXPECT_EQ(emu::CheckLaunch(dim3(1), dim3(32, 32, 2), 0), cudaErrorInvalidConfiguration);
  EXPECT_EQ(emu::CheckLaunch(dim3(1), dim3(1, 1, 65), 0), cudaErrorInvalidConfiguration);
  EXPECT_EQ(emu::CheckLaunch(dim3(1, 65536), dim3(32), 0), cudaErrorInvalidConfiguration);
  EXPECT_EQ(emu::CheckLaunch(dim3(0), dim3(32), 0), cudaErrorInvalidConfiguration);
  EXPECT_EQ(emu::CheckLaunch(dim3(1), dim3(32), 48 * 1024 + 1), cudaErrorInvalidConfiguration);
  void *a = nullptr, *b = nullptr;
  OK(cudaMalloc(&a, 1024));
  OK(cudaMalloc(&b, 1024));
  // Width above a pitch, and a pitch above the device's limit.
  EXPECT_EQ(cudaMemcpy2DAsync(a, 8, b, 16, 16, 2, cudaMemcpyDeviceToDevice, nullptr), cudaErrorInvalidPitchValue);
  EXPECT_EQ(cudaMemcpy2DAsync(a, size_t{1} << 32, b, 16, 16, 2, cudaMemcpyDeviceToDevice, nullptr),
            cudaErrorInvalidPitchValue);
  OK(cudaFree(a));
  OK(cudaFree(b));
}

// A stream waits for an event recorded on another stream; the host sees it pending.
void EventsAcrossStreams() {
  cudaStream_t a, b;
  cudaEvent_t ev;
  OK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  OK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  Gate gate;
  std::atomic<int> seen{0};
  OK(cudaLaunchHostFunc(a, &Gate::Wait, &gate));
  OK(cudaEventRecord(ev, a));
  OK(cudaStreamWaitEvent(b, ev, 0));
  OK(emu::Enqueue(b, [&] { seen = 1; }, "mark"));
  SleepMs(30);
  EXPECT_EQ(seen.load(), 0);
  EXPECT_EQ(cudaEventQuery(ev), cudaErrorNotReady);
  cudaGetLastError();
  // Recording again later does not change what b waits for.
  gate.Release();
  OK(cudaStreamSynchronize(b));
  EXPECT_EQ(seen.load(), 1);
  // Timing is refused on a timing-disabled event.
  float ms = 0;
  EXPECT_EQ(cudaEventElapsedTime(&ms, ev, ev), cudaErrorInvalidResourceHandle);
  cudaGetLastError();
  OK(cudaEventDestroy(ev));
  OK(cudaStreamDestroy(a));
  OK(cudaStreamDestroy(b));
}

// The legacy stream waits for blocking streams and they for it; non-blocking ones do not.
void LegacyStream() {
  cudaStream_t blocking, nonblocking;
  OK(cudaStreamCreate(&blocking));
  OK(cudaStreamCreateWithFlags(&nonblocking, cudaStreamNonBlocking));
  Gate gate;
  std::atomic<int> legacy_done{0};
  OK(cudaLaunchHostFunc(nullptr, &Gate::Wait, &gate));
  OK(emu::Enqueue(nullptr, [&] { legacy_done = 1; }, "legacy mark"));
  std::atomic<int> nb_saw{-1}, b_saw{-1};
  OK(emu::Enqueue(nonblocking, [&] { nb_saw = legacy_done.load(); }, "read"));
  OK(emu::Enqueue(blocking, [&] { b_saw = legacy_done.load(); }, "read"));
  OK(cudaStreamSynchronize(nonblocking));
  EXPECT_EQ(nb_saw.load(), 0);  // ran while the legacy stream was still blocked
  EXPECT_EQ(b_saw.load(), -1);  // still waiting behind the legacy stream
  gate.Release();
  OK(cudaStreamSynchronize(blocking));
  EXPECT_EQ(b_saw.load(), 1);
  // cudaMemset is legacy-stream work: a non-blocking stream does not wait for it.
  void* p = nullptr;
  OK(cudaMalloc(&p, 4));
  Gate gate2;
  OK(cudaLaunchHostFunc(nullptr, &Gate::Wait, &gate2));
  OK(cudaMemset(p, 0, 4));
  uint32_t v = 1;
  emu::SetStrict(false);  // the race strict mode refuses (strict_host_read_unsynchronized)
  OK(cudaMemcpyAsync(&v, p, 4, cudaMemcpyDeviceToHost, nonblocking));
  emu::SetStrict(true);
  OK(cudaStreamSynchronize(nonblocking));
  EXPECT_EQ(v, emu::kPoison);  // the memset has not run yet
  gate2.Release();
  OK(cudaDeviceSynchronize());
  OK(cudaMemcpy(&v, p, 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(v, 0);
  OK(cudaFree(p));
  OK(cudaStreamDestroy(blocking));
  OK(cudaStreamDestroy(nonblocking));
}

void PeerAccess() {
  int can = -1;
  OK(cudaDeviceCanAccessPeer(&can, 0, 0));
  EXPECT_EQ(can, 0);
  OK(cudaDeviceCanAccessPeer(&can, 0, 1));
  EXPECT_EQ(can, 1);
  OK(cudaSetDevice(0));
  EXPECT_EQ(cudaDeviceEnablePeerAccess(0, 0), cudaErrorInvalidDevice);
  cudaGetLastError();
  OK(cudaDeviceEnablePeerAccess(1, 0));
  EXPECT_EQ(cudaDeviceEnablePeerAccess(1, 0), cudaErrorPeerAccessAlreadyEnabled);
  cudaGetLastError();
  EXPECT_EQ(cudaSetDevice(emu::DeviceCount()), cudaErrorInvalidDevice);
  cudaGetLastError();
}

// What this process sees under its CUDA_VISIBLE_DEVICES (the Python test sets it and
// checks the line): "<cudaGetDeviceCount's error> <count> <physical,...> <pci,...>
// <uuid byte 15,...>", then the first invalid ordinal refused.
void VisibleDevices() {
  int count = -1;
  const cudaError_t e = cudaGetDeviceCount(&count);
  cudaGetLastError();
  std::string physical, pci, uuid;
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp prop;
    OK(cudaGetDeviceProperties(&prop, d));
    const std::string sep = d ? "," : "";
    physical += sep + std::to_string(emu::PhysicalDevice(d));
    pci += sep + std::to_string(prop.pciBusID);
    uuid += sep + std::to_string(static_cast<int>(prop.uuid.bytes[15]));
  }
  std::printf("%d %d [%s] [%s] [%s]\n", static_cast<int>(e), count, physical.c_str(), pci.c_str(), uuid.c_str());
  EXPECT_EQ(cudaSetDevice(count), cudaErrorInvalidDevice);
  cudaGetLastError();
  EXPECT_EQ(emu::PhysicalDevice(count), -1);
}

void StrictNeverRecorded() {
  cudaStream_t s;
  cudaEvent_t ev;
  OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  EXPECT_EQ(cudaStreamWaitEvent(s, ev, 0), cudaErrorInvalidResourceHandle);
  auto v = emu::TakeStrictViolations();
  EXPECT_EQ(v.size(), 1);
  if (v[0].find("never recorded") == std::string::npos) std::exit(1);
  emu::SetStrict(false);
  OK(cudaStreamWaitEvent(s, ev, 0));  // CUDA's own behaviour: a no-op
  emu::SetStrict(true);
  cudaGetLastError();
  OK(cudaEventDestroy(ev));
  OK(cudaStreamDestroy(s));
}

void StrictFreeInUse() {
  cudaStream_t s;
  OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void* p = nullptr;
  OK(cudaMalloc(&p, 256));
  Gate gate;
  OK(cudaLaunchHostFunc(s, &Gate::Wait, &gate));
  OK(cudaMemsetAsync(p, 0, 256, s));
  EXPECT_EQ(cudaFree(p), cudaErrorIllegalState);
  auto v = emu::TakeStrictViolations();
  EXPECT_EQ(v.size(), 1);
  cudaGetLastError();
  gate.Release();
  OK(cudaStreamSynchronize(s));
  OK(cudaFree(p));
  OK(cudaStreamDestroy(s));
}

// A host read (cudaMemcpy: the legacy stream) of memory that a non-blocking stream's
// queued copy still writes: the legacy stream does not wait for that stream.
void StrictHostReadUnsynchronized() {
  cudaStream_t s;
  OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void* p = nullptr;
  OK(cudaMalloc(&p, 64));
  std::vector<char> src(64, 1), dst(64, 0);
  Gate gate;
  OK(cudaLaunchHostFunc(s, &Gate::Wait, &gate));
  OK(cudaMemcpyAsync(p, src.data(), 64, cudaMemcpyHostToDevice, s));
  EXPECT_EQ(cudaMemcpy(dst.data(), p, 64, cudaMemcpyDeviceToHost), cudaErrorIllegalState);
  auto v = emu::TakeStrictViolations();
  EXPECT_EQ(v.size(), 1);
  if (v[0].find("without synchronizing") == std::string::npos) std::exit(1);
  cudaGetLastError();
  gate.Release();
  OK(cudaStreamSynchronize(s));  // synchronized: the same read is fine
  OK(cudaMemcpy(dst.data(), p, 64, cudaMemcpyDeviceToHost));
  EXPECT_EQ(dst[63], 1);
  // The other way round: a setup memset on the legacy stream, then the non-blocking
  // stream's copy of the same memory without synchronizing (issue 30's defect 2).
  Gate legacy_gate;
  OK(cudaLaunchHostFunc(nullptr, &Gate::Wait, &legacy_gate));
  OK(cudaMemset(p, 0, 64));
  EXPECT_EQ(cudaMemcpyAsync(dst.data(), p, 64, cudaMemcpyDeviceToHost, s), cudaErrorIllegalState);
  EXPECT_EQ(emu::TakeStrictViolations().size(), 1);
  cudaGetLastError();
  legacy_gate.Release();
  OK(cudaDeviceSynchronize());
  OK(cudaFree(p));
  OK(cudaStreamDestroy(s));
}

// Two processes: the child exports a block and an interprocess event; the parent opens
// both, sees the child's data, waits on its event, then uses the mapping after closing it.
// A handle names one block or event for good: a block or event made after another was
// freed (reusing its descriptor) has a handle of its own, and the same block always the
// same handle (peers cache what they opened by handle).
void IpcHandlesUnique() {
  void* p = nullptr;
  cudaIpcMemHandle_t first, again, later;
  OK(cudaMalloc(&p, 4096));
  OK(cudaIpcGetMemHandle(&first, p));
  OK(cudaIpcGetMemHandle(&again, p));
  EXPECT_EQ(std::memcmp(&first, &again, sizeof(first)), 0);
  OK(cudaFree(p));
  OK(cudaMalloc(&p, 4096));
  OK(cudaIpcGetMemHandle(&later, p));
  EXPECT_EQ(std::memcmp(&first, &later, sizeof(first)) != 0, true);
  OK(cudaFree(p));
  cudaEvent_t ev;
  cudaIpcEventHandle_t e1, e2;
  OK(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming));
  OK(cudaIpcGetEventHandle(&e1, ev));
  OK(cudaEventDestroy(ev));
  OK(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming));
  OK(cudaIpcGetEventHandle(&e2, ev));
  EXPECT_EQ(std::memcmp(&e1, &e2, sizeof(e1)) != 0, true);
  OK(cudaEventDestroy(ev));
}

void Ipc() {
  int to_parent[2], to_child[2];
  if (pipe(to_parent) != 0 || pipe(to_child) != 0) std::exit(1);
  const pid_t pid = fork();
  if (pid == 0) {
    void* p = nullptr;
    OK(cudaMalloc(&p, 4096));
    std::vector<uint32_t> pattern(1024);
    for (int i = 0; i < 1024; ++i) pattern[i] = i * 7u;
    OK(cudaMemcpy(p, pattern.data(), 4096, cudaMemcpyHostToDevice));
    cudaEvent_t ev;
    OK(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming));
    cudaStream_t s;
    OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    Gate gate;
    OK(cudaLaunchHostFunc(s, &Gate::Wait, &gate));
    OK(cudaEventRecord(ev, s));
    cudaIpcMemHandle_t mh;
    cudaIpcEventHandle_t eh;
    OK(cudaIpcGetMemHandle(&mh, p));
    OK(cudaIpcGetEventHandle(&eh, ev));
    void* own = nullptr;
    EXPECT_EQ(cudaIpcOpenMemHandle(&own, mh, cudaIpcMemLazyEnablePeerAccess), cudaErrorInvalidResourceHandle);
    if (write(to_parent[1], &mh, sizeof(mh)) != sizeof(mh) || write(to_parent[1], &eh, sizeof(eh)) != sizeof(eh)) {
      _exit(1);
    }
    char c;
    if (read(to_child[0], &c, 1) != 1) _exit(1);  // the parent saw the event pending
    gate.Release();
    if (read(to_child[0], &c, 1) != 1) _exit(1);  // the parent is done
    _exit(0);
  }
  cudaIpcMemHandle_t mh;
  cudaIpcEventHandle_t eh;
  if (read(to_parent[0], &mh, sizeof(mh)) != sizeof(mh) || read(to_parent[0], &eh, sizeof(eh)) != sizeof(eh)) {
    std::exit(1);
  }
  void* peer = nullptr;
  OK(cudaIpcOpenMemHandle(&peer, mh, cudaIpcMemLazyEnablePeerAccess));
  std::vector<uint32_t> got(1024);
  OK(cudaMemcpy(got.data(), peer, 4096, cudaMemcpyDeviceToHost));
  for (int i = 0; i < 1024; ++i) EXPECT_EQ(got[i], i * 7u);
  cudaEvent_t ev;
  OK(cudaIpcOpenEventHandle(&ev, eh));
  EXPECT_EQ(cudaEventQuery(ev), cudaErrorNotReady);
  cudaGetLastError();
  cudaStream_t s;
  OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  OK(cudaStreamWaitEvent(s, ev, 0));
  std::atomic<int> after{0};
  OK(emu::Enqueue(s, [&] { after = 1; }, "after the peer's event"));
  SleepMs(20);
  EXPECT_EQ(after.load(), 0);
  if (write(to_child[1], "g", 1) != 1) std::exit(1);
  OK(cudaStreamSynchronize(s));
  EXPECT_EQ(after.load(), 1);
  OK(cudaEventSynchronize(ev));
  OK(cudaIpcCloseMemHandle(peer));
  EXPECT_EQ(cudaMemcpy(got.data(), peer, 16, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
  auto v = emu::TakeStrictViolations();
  EXPECT_EQ(v.size(), 1);
  if (v[0].find("after cudaIpcCloseMemHandle") == std::string::npos) std::exit(1);
  cudaGetLastError();
  if (write(to_child[1], "d", 1) != 1) std::exit(1);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_EQ(WIFEXITED(status) && WEXITSTATUS(status) == 0, 1);
  OK(cudaEventDestroy(ev));
  OK(cudaStreamDestroy(s));
}

}  // namespace

int main(int argc, char** argv) {
  const std::map<std::string, std::function<void()>> cases = {
      {"stream_order", StreamOrder},       {"last_error", LastError},
      {"sticky", Sticky},                  {"poison", Poison},
      {"launch_limits", LaunchLimits},     {"events_across_streams", EventsAcrossStreams},
      {"legacy_stream", LegacyStream},     {"peer_access", PeerAccess},
      {"strict_never_recorded", StrictNeverRecorded}, {"strict_free_in_use", StrictFreeInUse},
      {"strict_host_read_unsynchronized", StrictHostReadUnsynchronized}, {"ipc", Ipc},
      {"visible_devices", VisibleDevices}, {"ipc_handles_unique", IpcHandlesUnique},
  };
  if (argc == 2 && std::string(argv[1]) == "--list") {
    for (auto& [name, f] : cases) std::printf("%s\n", name.c_str());
    return 0;
  }
  if (argc != 2 || !cases.count(argv[1])) {
    std::fprintf(stderr, "usage: %s CASE | --list\n", argv[0]);
    return 2;
  }
  cases.at(argv[1])();
  if (!emu::TakeStrictViolations().empty()) {
    std::fprintf(stderr, "unexpected strict-check violations\n");
    return 1;
  }
  return 0;
}
