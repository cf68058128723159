// XLA FFI handlers of the CUDA backend (platform "CUDA"), three stages per op:
// instantiate (bind and check the attributes, make the CudaState), initialize (decide the
// group's route and prepare it for this device) and execute (enqueue on XLA's stream).
//
// Registered without custom-call traits: jaxlib's GPU plugin refuses any (see
// jaxcomm/_src/cuda_runtime.py), so XLA never records these calls into CUDA graphs,
// which suits them (the peer routes meet their peers on the host at every call).
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jaxcomm::cuda {

struct Stages {
  const char* op;
  XLA_FFI_Handler* instantiate;
  XLA_FFI_Handler* initialize;
  XLA_FFI_Handler* execute;
};

// Every op's stages, ending with an entry whose `op` is nullptr.
const Stages* AllStages();

}  // namespace jaxcomm::cuda
