// XLA FFI handler of jaxcomm.ft.all_reduce on the host backend (ft.cc).
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jaxcomm::cpu {

// Operand x; results: the sum over the ranks that contributed, and a bool mask [R] of
// those ranks. Ranks of processes that die or miss the deadline are left out (see
// ExchangeSpec::tolerant in core/cross_process.h).
extern XLA_FFI_Handler* const kFtAllReduce;

}  // namespace jaxcomm::cpu
