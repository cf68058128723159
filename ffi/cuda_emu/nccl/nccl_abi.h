// The C ABI of the mock NCCL: the types and entry points of NCCL 2.x's nccl.h that
// jaxcomm's CUDA backend loads with dlsym (ffi/cuda/nccl.cc), with NCCL's values and
// layouts (the backend declares the same ones in ffi/cuda/nccl.h, inside its namespace).
// cuda_runtime_api.h is the emulated runtime's (ffi/cuda_emu/runtime/include).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

extern "C" {

typedef struct ncclComm* ncclComm_t;
typedef struct {
  char internal[128];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclNumResults = 8
} ncclResult_t;

typedef enum {
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
  ncclNumTypes = 10
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclNumOps = 4 } ncclRedOp_t;

// NCCL 2.17's ncclConfig_t prefix (the fields a caller of that version sets); NCCL reads
// `size` bytes and takes the fields `version` has. The mock reads `blocking` only.
typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
  int splitShare;
} ncclConfig_t;

#define JAXCOMM_NCCL_MOCK_API __attribute__((visibility("default")))

JAXCOMM_NCCL_MOCK_API ncclResult_t ncclGetVersion(int* version);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclGetUniqueId(ncclUniqueId* id);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                                          int rank, ncclConfig_t* config);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclCommFinalize(ncclComm_t comm);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclCommDestroy(ncclComm_t comm);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclCommAbort(ncclComm_t comm);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclCommCount(ncclComm_t comm, int* count);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclCommUserRank(ncclComm_t comm, int* rank);
JAXCOMM_NCCL_MOCK_API const char* ncclGetErrorString(ncclResult_t result);
JAXCOMM_NCCL_MOCK_API const char* ncclGetLastError(ncclComm_t comm);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                                                 ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                                 cudaStream_t stream);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                                                 ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                                     ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                                     cudaStream_t stream);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                                                 ncclDataType_t datatype, int root, ncclComm_t comm,
                                                 cudaStream_t stream);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                                            ncclComm_t comm, cudaStream_t stream);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                                            ncclComm_t comm, cudaStream_t stream);
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclGroupStart();
JAXCOMM_NCCL_MOCK_API ncclResult_t ncclGroupEnd();

}  // extern "C"
