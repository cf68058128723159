// The CUDA backend's stages as the emulation registers them with XLA:CPU. XLA:CPU (jax
// 0.10.2) runs a custom call's instantiate and execute stages but never its initialize
// stage, which XLA:GPU runs before executing: each emulated execute stage therefore runs
// the op's initialize stage first (CudaState::Initialize does its work once per device
// and returns at once afterwards), then the backend's own execute stage, on the call's
// buffers staged in emulated device memory (staging.h) as XLA:GPU's are device memory.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda/handlers.h"

namespace jaxcomm::cuda_emu {

// cuda::AllStages() with each execute stage preceded by its initialize stage (and no
// initialize stage of its own); ends with an entry whose `op` is nullptr.
const cuda::Stages* EmulatedStages();

// XLA:CPU's device ids of this process's devices in local order: the handlers' DeviceOrdinal
// becomes the index of XLA's in it (XLA:CPU gives the id in the job, XLA:GPU the local
// ordinal, i.e. the CUDA device). Unset, or an id not in it: XLA's value.
void SetLocalDevices(std::vector<int64_t> xla_ids);

// cuda::LocalTargets() with their buffers staged the same way.
const cuda::LocalTarget* EmulatedLocalTargets();

}  // namespace jaxcomm::cuda_emu
