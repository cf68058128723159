// The few CUDA runtime functions the mock NCCL calls, declared with the runtime's C ABI
// (cuda_runtime_api.h) so that the mock needs no CUDA header: only public runtime API, so
// it runs on whichever runtime the process has (the emulated one of ffi/cuda_emu/runtime,
// or the test double of tests/emulation/test_nccl_mock.py). Resolved when the mock is
// loaded, from the runtime already loaded into the process.
#pragma once

extern "C" {
typedef struct CUstream_st* cudaStream_t;
typedef int cudaError_t;  // enum cudaError: cudaSuccess is 0
typedef void (*cudaHostFn_t)(void* user_data);

cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetPCIBusId(char* pci_bus_id, int len, int device);
// Runs fn(user_data) on the host after the stream's earlier work, before its later work.
cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data);
const char* cudaGetErrorString(cudaError_t error);
}
