// cudaEventQuery without its side effect: the runtime keeps the cudaErrorNotReady of a
// poll as the thread's last error, so the next launch's `return cudaGetLastError()`
// (kernels.cu) would report "device not ready" for a launch that succeeded.
#pragma once

#include <cuda_runtime_api.h>

namespace jaxcomm::cuda {

// cudaEventQuery(event); a NotReady answer is not left as the thread's last error.
inline cudaError_t QueryEvent(cudaEvent_t event) {
  const cudaError_t e = cudaEventQuery(event);
  if (e == cudaErrorNotReady && cudaPeekAtLastError() == cudaErrorNotReady) cudaGetLastError();
  return e;
}

}  // namespace jaxcomm::cuda
