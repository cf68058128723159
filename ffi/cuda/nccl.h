// NCCL, loaded at run time with dlopen from the nvidia-nccl-cu12/-cu13 wheel that jax's
// CUDA extra installs (both at nvidia/nccl/lib/libnccl.so.2), or from the library
// search path, so that a CPU-only install never needs it and the build needs no NCCL
// headers. Only the few types and functions jaxcomm calls are declared here; their
// layouts are NCCL's stable C ABI (nccl.h of NCCL 2.x).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <mutex>
#include <string>

namespace jaxcomm::cuda {

typedef struct ncclComm* ncclComm_t;
struct ncclUniqueId {
  char internal[128];
};

enum ncclResult_t : int {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
};

enum ncclDataType_t : int {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9,
};

enum ncclRedOp_t : int { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3 };

// ncclConfig_t as of NCCL 2.17 (nccl.h's ncclConfig_v21700). NCCL reads `size` bytes of it
// and takes the fields that `version` has (newer ones keep their defaults), so this prefix
// of the current struct stays valid. NcclConfig() fills it as NCCL_CONFIG_INITIALIZER.
struct ncclConfig_t {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
  int splitShare;
};
// A configuration with NCCL's defaults, but `blocking` as given: jaxcomm creates every
// communicator non-blocking (0), so that no call ever waits inside NCCL without a deadline.
ncclConfig_t NcclConfig(int blocking);

// The loaded library's entry points. All pointers are set once Load() succeeded.
struct NcclApi {
  ncclResult_t (*GetVersion)(int*) = nullptr;
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*CommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  const char* (*GetLastError)(ncclComm_t) = nullptr;  // optional (NCCL >= 2.13)
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t) = nullptr;
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t,
                            cudaStream_t) = nullptr;
  ncclResult_t (*ReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t,
                            cudaStream_t) = nullptr;
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t,
                       cudaStream_t) = nullptr;
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;

  int version = 0;
  std::string path;  // the file that was loaded

  // "" and the loaded table, or why NCCL cannot be used. Thread-safe; loads once.
  static const NcclApi* Get(std::string* error);
  // Where to look first (the wheel's lib/libnccl.so.2, found by Python). Before Get().
  static void SetSearchPath(std::string path);
  // The message of a failed call: NCCL's error string (and last error when it has one).
  std::string Describe(ncclResult_t r, ncclComm_t comm) const;
};

}  // namespace jaxcomm::cuda
