// What a collective's handler returns: either "done" (its result is written, nothing
// waits) or an ffi::Future that completes later.
//
// A round that completes on the device thread (RoundTable's inline path) has nothing to
// wait for, yet an ffi::Future result costs a promise (an allocation), XLA's own future
// (XLA_FFI_Future_Create: more allocations), a continuation and its completion, per call.
// XLA's FFI lets a handler return either a synchronous status or a future
// (ResultEncoding returning std::variant<XLA_FFI_Error*, XLA_FFI_Future*>, see
// xla/ffi/api/api.h); CallResult is that choice for jaxcomm's handlers. Handlers bound to
// return ffi::Future still accept one (it converts).
#pragma once

#include <optional>
#include <utility>
#include <variant>

#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

class CallResult {
 public:
  // The call is complete and succeeded.
  static CallResult Done() { return CallResult(); }
  // The call completes (or failed) when `future` does.
  CallResult(xla::ffi::Future future) : future_(std::move(future)) {}  // NOLINT: implicit

  bool done() const { return !future_.has_value(); }
  // The future form, for handlers that return an ffi::Future (an available one if done).
  operator xla::ffi::Future() && {  // NOLINT: implicit
    if (future_) return std::move(*future_);
    xla::ffi::Promise promise;
    xla::ffi::Future future(promise);
    promise.SetAvailable();
    return future;
  }

 private:
  CallResult() = default;
  std::optional<xla::ffi::Future> future_;
};

}  // namespace jaxcomm

namespace xla::ffi {

// Done: a synchronous success (no XLA future is made); else XLA's asynchronous result.
template <ExecutionStage stage>
struct ResultEncoding<stage, jaxcomm::CallResult> {
  XLA_FFI_ATTRIBUTE_ALWAYS_INLINE
  static std::variant<XLA_FFI_Error*, XLA_FFI_Future*> Encode(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx,
                                                             jaxcomm::CallResult result) {
    if (result.done()) return static_cast<XLA_FFI_Error*>(nullptr);
    return ResultEncoding<stage, Future>::Encode(api, ctx, static_cast<Future>(std::move(result)));
  }
};

}  // namespace xla::ffi
