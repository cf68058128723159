// The emulated XLA seam's staging of XLA:CPU's buffers in emulated device memory.
//
// Under XLA:GPU every operand and result of a custom call is device memory that XLA's
// allocator (a BFC allocator over a few large cudaMalloc'd regions) handed out: the CUDA
// IPC route exports it (cuMemGetAddressRange + cudaIpcGetMemHandle of its region), and
// the strict checks of the emulated runtime can check what touches it. XLA:CPU's buffers
// are host memory. So each emulated call runs the CUDA backend's execute stage on a copy
// of XLA's call frame whose buffers point into an "XLA arena" of emulated device memory:
//  - per device, regions of emulated cudaMalloc (the first 4 MiB, each next one at least
//    twice the last and twice the request), sub-allocated first-fit at XLA's 256-byte
//    alignment; regions are never freed, so an exported handle (IpcRegistry caches them by
//    region, the peers cache what they opened) stays valid for the process's life;
//  - before the handler: operands copied in (an operand and a result at one address,
//    input_output_aliases, share one block), other results poisoned (kPoison, as a fresh
//    block is under the emulation: XLA:GPU's results hold whatever was there);
//  - after the handler (its XlaContext drained XLA's stream): results copied back to
//    XLA:CPU's buffers, the blocks freed.
// Split-phase halves outlive the call: a send half (moe_transport_send, put_start) keeps
// moving data on jaxcomm's own stream after it returns, into its result and out of its
// operands, until the receive half (moe_recv, put_done) makes XLA's stream wait. Its
// blocks therefore stay "pinned" under their XLA:CPU addresses; the receive half, which
// takes the send's results (aliased to its own) and every operand the send published,
// finds them there (not copied in again: they are the live data), and frees them once it
// ran (a failed receive leaves them: its send's movement may still write them). A send's first result (its data, still being written) is not copied back; its
// others (the status written on XLA's stream) are.
// Buffers of a sub-byte type (XLA:CPU may pack them) and tokens are passed through as
// XLA:CPU's host memory, which the emulation treats as device memory it did not allocate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace jaxcomm::cuda_emu::seam {

// How a call's buffers outlive it.
enum class CallKind {
  kPlain,        // staged for the call alone
  kSendHalf,     // pins its blocks for its receive half
  kReceiveHalf,  // takes the blocks its send half pinned, frees them after
};

// What the handler of one call saw of one buffer (the last call's, for tests).
struct StagedBuffer {
  uintptr_t xla = 0;     // XLA:CPU's buffer
  uintptr_t staged = 0;  // what the handler got
  uint64_t bytes = 0;
  bool device_memory = false;  // the staged block lies in one emulated cudaMalloc'd block
  bool result = false;
};

struct StagingStats {
  uint64_t calls = 0, buffers = 0, bytes_in = 0, bytes_out = 0;
  uint64_t arena_bytes = 0, arenas = 0;  // every device's regions
  uint64_t pinned = 0;                   // blocks kept for receive halves now
  std::vector<StagedBuffer> last_call;
};

StagingStats Stats();

// Runs `handler` on a copy of `frame` whose buffers are staged as above (the device is
// the call's DeviceOrdinal). A staging failure (the arena's cudaMalloc) is returned as an
// XLA FFI error without running the handler.
XLA_FFI_Error* RunStaged(XLA_FFI_CallFrame* frame, CallKind kind,
                         const std::function<XLA_FFI_Error*(XLA_FFI_CallFrame*)>& handler);

}  // namespace jaxcomm::cuda_emu::seam
