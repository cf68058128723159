// The CUDA backend's FFI targets as Python sees them (jax.ffi.register_ffi_target takes
// {stage: handler capsule}), for both builds: the GPU module's (bindings.cc) and the
// emulation's (cuda_emu/module.cc, whose stages are wrapped by its seam).
#pragma once

#include <nanobind/nanobind.h>

#include "cuda/handlers.h"

namespace jaxcomm::cuda {

// op name -> {"instantiate", "initialize", "execute": capsule}; a null stage is left out.
// `stages` ends with an entry whose op is nullptr.
nanobind::dict StagesDict(const Stages* stages);

// op name -> {"execute": capsule}; `targets` ends with an entry whose op is nullptr.
nanobind::dict LocalTargetsDict(const LocalTarget* targets);

}  // namespace jaxcomm::cuda
