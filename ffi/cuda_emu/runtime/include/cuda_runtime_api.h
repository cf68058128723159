// The CUDA runtime API as jaxcomm's CUDA backend (ffi/cuda/) uses it, declared for the
// emulation: the same names, types and values as the real <cuda_runtime_api.h> (CUDA 13),
// implemented on the host by ffi/cuda_emu/runtime/. Only what ffi/cuda/ calls is here;
// a call the backend starts to use fails to compile in the emulation build first, which
// is where it gets added (with the runtime's documented behaviour).
#pragma once

#include <cstddef>
#include <cstdint>

// The version the declarations follow (CUDA 13.0), as the real header defines it: code that
// guards newer calls by it (ffi/cuda/ipc.cc) takes the same branch as on CUDA 13.
#define CUDART_VERSION 13000

// ------------------------------------------------------------------------ errors
enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidPitchValue = 12,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorIllegalState = 401,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchTimeout = 702,
  cudaErrorPeerAccessAlreadyEnabled = 704,
  cudaErrorPeerAccessNotEnabled = 705,
  cudaErrorSetOnActiveProcess = 708,
  cudaErrorAssert = 710,
  cudaErrorPeerAccessUnsupported = 217,
  cudaErrorInvalidDevice = 101,
  cudaErrorNoDevice = 100,
  cudaErrorLaunchFailure = 719,
  cudaErrorUnknown = 999,
};
typedef enum cudaError cudaError_t;

// ------------------------------------------------------------------ opaque handles
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;

#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)

// ------------------------------------------------------------------------- flags
#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault 0x00
#define cudaEventBlockingSync 0x01
#define cudaEventDisableTiming 0x02
#define cudaEventInterprocess 0x04
#define cudaIpcMemLazyEnablePeerAccess 0x01

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMaxPitch = 11,
  cudaDevAttrMultiProcessorCount = 16,
};

enum cudaDriverEntryPointQueryResult {
  cudaDriverEntryPointSuccess = 0,
  cudaDriverEntryPointSymbolNotFound = 1,
  cudaDriverEntryPointVersionNotSufficent = 2,
};
#define cudaEnableDefault 0x0

// --------------------------------------------------------------------- IPC handles
#define CUDA_IPC_HANDLE_SIZE 64
typedef struct cudaIpcMemHandle_st {
  char reserved[CUDA_IPC_HANDLE_SIZE];
} cudaIpcMemHandle_t;
typedef struct cudaIpcEventHandle_st {
  char reserved[CUDA_IPC_HANDLE_SIZE];
} cudaIpcEventHandle_t;

// ------------------------------------------------------------------ device props
struct CUuuid_st {
  char bytes[16];
};
typedef struct CUuuid_st cudaUUID_t;

struct cudaDeviceProp {
  char name[256];
  cudaUUID_t uuid;
  size_t totalGlobalMem;
  size_t sharedMemPerBlock;
  int warpSize;
  size_t memPitch;
  int maxThreadsPerBlock;
  int maxThreadsDim[3];
  int maxGridSize[3];
  int multiProcessorCount;
  int major;
  int minor;
  int pciBusID;
  int pciDeviceID;
  int pciDomainID;
};

// ------------------------------------------------------------------- launch dims
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
};

// --------------------------------------------------------------------------- API
const char* cudaGetErrorString(cudaError_t error);
const char* cudaGetErrorName(cudaError_t error);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest);
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer);
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags);
cudaError_t cudaDeviceDisablePeerAccess(int peer);
cudaError_t cudaRuntimeGetVersion(int* version);
cudaError_t cudaDriverGetVersion(int* version);
cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int version,
                                             unsigned long long flags,
                                             cudaDriverEntryPointQueryResult* status);

cudaError_t cudaMalloc(void** ptr, size_t size);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaMemGetInfo(size_t* free, size_t* total);
cudaError_t cudaMemset(void* ptr, int value, size_t count);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t stream);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream);
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                              size_t height, cudaMemcpyKind kind, cudaStream_t stream);

cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags);
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int flags, int priority);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags = 0);

typedef void (*cudaHostFn_t)(void* user_data);
cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data);

cudaError_t cudaEventCreate(cudaEvent_t* event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* ptr);
cudaError_t cudaIpcOpenMemHandle(void** ptr, cudaIpcMemHandle_t handle, unsigned int flags);
cudaError_t cudaIpcCloseMemHandle(void* ptr);
cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t* handle, cudaEvent_t event);
cudaError_t cudaIpcOpenEventHandle(cudaEvent_t* event, cudaIpcEventHandle_t handle);
