// Makes a device current for a scope and restores the previous one (RAII): the CUDA
// runtime's current device is per thread, and the threads jaxcomm borrows belong to XLA.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace jaxcomm::cuda {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    const cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) error_ = "cudaSetDevice(" + std::to_string(device) + "): " + cudaGetErrorString(e);
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

 private:
  int previous_ = 0;
  std::string error_;
};

}  // namespace jaxcomm::cuda
