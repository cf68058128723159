// XLA FFI handlers of the CUDA backend (platform "CUDA"), three stages per op:
// instantiate (parse the attributes into a CudaState), initialize (create this device's
// NCCL communicator when its group needs one) and execute (enqueue on XLA's stream).
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jaxcomm::cuda {

struct Stages {
  const char* op;
  XLA_FFI_Handler* instantiate;
  XLA_FFI_Handler* initialize;
  XLA_FFI_Handler* execute;
  // Whether XLA may record the op into a CUDA graph (command buffer): no host work and
  // no scratch allocation on the execute path.
  bool command_buffer_compatible;
};

// Every op's stages, ending with an entry whose `op` is nullptr.
const Stages* AllStages();

}  // namespace jaxcomm::cuda
