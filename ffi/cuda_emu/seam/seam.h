// The emulated XLA seam's allocator (seam/xla_context_emu.cc), visible to the module's
// test hooks: scratch under XLA:GPU's contract.
#pragma once

#include <cstddef>
#include <string>

namespace jaxcomm::cuda_emu::seam {

// `bytes` of emulated device memory of `device`, or nullptr with XLA's refusal in *error
// (an alignment XLA:GPU's allocator refuses: not a power of two, or above 16).
void* AllocateScratch(int device, size_t bytes, size_t alignment, std::string* error);

}  // namespace jaxcomm::cuda_emu::seam
