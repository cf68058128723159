// The emulation's <cuda_runtime.h>: the runtime API, plus (for device code compiled for
// the host) the SIMT layer's qualifiers, built-in variables and intrinsics.
#pragma once

#include <cuda_runtime_api.h>

#if __has_include(<jaxcomm_simt.h>)
#include <jaxcomm_simt.h>
#endif
