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

// Kernels a program calls on one device's data, outside any group: an execute stage
// alone (no state), ending with an entry whose `op` is nullptr. moe_fp8_quantize: x [T, H]
// float32, bfloat16 or float16 -> (q [T, H] float8_e4m3fn, scales [T, ceil(H/128)] f32),
// jaxcomm's FP8 token format (core/number_formats.h).
struct LocalTarget {
  const char* op;
  XLA_FFI_Handler* execute;
};
const LocalTarget* LocalTargets();

}  // namespace jaxcomm::cuda
