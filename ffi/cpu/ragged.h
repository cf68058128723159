// XLA FFI handler of jaxcomm.ragged_all_to_all on the host backend (ragged.cc).
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jaxcomm::cpu {

// Operands: operand, output (aliased to the result), input_offsets, send_sizes,
// output_offsets, recv_sizes. Attribute `mode` picks the forward op or one
// of the two halves of its transpose (see RaggedMode in ragged.cc).
extern XLA_FFI_Handler* const kRaggedAllToAll;

}  // namespace jaxcomm::cpu
