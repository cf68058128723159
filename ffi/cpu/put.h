// One-sided puts with a signal on the host backend (jaxcomm.tp.put_start / put_done, and
// the collective matmuls of jaxcomm/_src/tp/ built on them).
//
// put_start(x) -> (data, status): every rank hands over its operand and the result buffer
// `data` its peers write into, and returns at once. When every rank of the group has
// started, jaxcomm's threads (a pool thread of the last rank to arrive; across processes
// the transports' threads) copy each source's operand straight into its destination's
// `data`: no staging copy at the receiver. The status block at the start of `status` is
// the per-put signal: completed when the round is over (cpu/moe_split.h's protocol).
//
// put_done(data, status, x) -> (data, status), aliased: completes when the signal does.
// It takes x too, so XLA keeps the operand that peers read alive until then. XLA's device
// threads run whatever does not depend on `data` (the chunk matmuls) in between.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jaxcomm::cpu {

extern XLA_FFI_Handler* const kPutStart;
extern XLA_FFI_Handler* const kPutDone;

}  // namespace jaxcomm::cpu
