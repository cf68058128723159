// XLA FFI handlers of the host backend, one per collective. Each op's handler lives in
// handlers.cc next to the data movement it hands to the rendezvous (core/rendezvous.h).
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jaxcomm::cpu {

// The instantiate stage shared by every op: builds the instruction's RoundTable.
extern XLA_FFI_Handler* const kInstantiate;

extern XLA_FFI_Handler* const kAllReduce;
extern XLA_FFI_Handler* const kAllGather;
extern XLA_FFI_Handler* const kReduceScatter;
extern XLA_FFI_Handler* const kAllToAll;
extern XLA_FFI_Handler* const kPermute;
extern XLA_FFI_Handler* const kBroadcast;

}  // namespace jaxcomm::cpu
