// The emulation's <cuda.h>: the few driver API types ffi/cuda/ reaches through
// cudaGetDriverEntryPointByVersion (cuMemGetAddressRange), same layout as CUDA 13's.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

typedef enum cudaError_enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_NOT_FOUND = 500,
} CUresult;
typedef unsigned long long CUdeviceptr;

CUresult cuMemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);
