// Split-phase MoE transports on the CUDA backend (jaxcomm.moe.dispatch_send/_recv,
// combine_send/_recv), so that XLA's stream runs the program's independent work (the
// shared expert, the next micro-batch's attention) while tokens travel.
//
// The send half enqueues its data movement on a stream of jaxcomm's (one per device, high
// priority), made to wait for XLA's stream at the send (the inputs are ready) and for the
// peers' sends (their buffers are published); XLA's stream itself waits for nothing and
// goes on. The receive half makes XLA's stream wait for the events the send left: this
// rank's movement done, and every peer's that reads this rank's buffers. Nothing waits on
// the host for the device: the host only meets the peers' handlers, with the call's
// deadline, as every peer route does (peers.h).
//
// How the halves find each other: by the send's result. The receive half takes it as an
// operand aliased to its own result (jaxcomm/_src/moe/fused.py's moe_recv), so both see
// the same device address; a receive handed a copy finds no send and fails loudly.
// Lifetimes: the receive half also takes every operand the send published, so XLA keeps
// them (and the scratch-free result) alive until the movement is over.
#pragma once

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/call_context.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {

struct EventDestroy {
  void operator()(cudaEvent_t e) const { cudaEventDestroy(e); }
};
using OwnedEvent = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, EventDestroy>;

// What a receive half waits for.
struct PendingSend {
  std::vector<cudaEvent_t> waits;
  // Events made for this call alone (a one-rank group has no peer events); destroyed once
  // the receive half enqueued its waits, which CUDA allows before they complete.
  std::vector<OwnedEvent> owned;
};

class SplitSends {
 public:
  // The stream the send halves of `device` move data on: non-blocking, of the highest
  // priority, created on first use and kept for the process's life.
  xla::ffi::ErrorOr<cudaStream_t> Stream(int device, const CallContext& ctx);
  // Records the send half whose result lies at `data` on `device` (replacing an older
  // one at the same address, whose receive half has run).
  void Put(int device, const void* data, PendingSend pending);
  // Removes and returns the send half of `data`; false when there is none.
  bool Take(int device, const void* data, PendingSend* out);

 private:
  std::mutex mu_;
  std::map<int, cudaStream_t> streams_;
  std::map<std::pair<int, const void*>, PendingSend> pending_;
};

// A pair of events on `device` for one call of a one-rank split send: `ready` recorded on
// XLA's stream, `done` on jaxcomm's.
xla::ffi::Error MakeCallEvents(int device, const CallContext& ctx, OwnedEvent* ready, OwnedEvent* done);

}  // namespace jaxcomm::cuda
