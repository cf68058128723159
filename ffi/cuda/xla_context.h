// What XLA gives a CUDA execute stage, and the one place the CUDA backend asks XLA's FFI
// for it: the stream to enqueue on, the device ordinal, the run id and device scratch
// memory for the call. This is the seam the CPU emulation replaces (under XLA:CPU the
// FFI has no stream, and its scratch allocator answers "XLA FFI GPU context is not
// available"): it supplies an XlaContext of its own, decoded the same way, so every
// handler's code stays the same.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {

namespace ffi = xla::ffi;

// XLA's scratch allocator (XLA_FFI_DeviceMemory_Allocate, xla/ffi/ffi_api.cc) rejects any
// alignment above its kMaxAlignment, 16 ("Unsupported alignment"), on every platform; its
// blocks come from XLA's device allocator, 256-byte aligned anyway. jaxcomm asks for
// kScratchAlignment; the emulation's allocator enforces kXlaMaxScratchAlignment.
inline constexpr size_t kXlaMaxScratchAlignment = 16;
inline constexpr size_t kScratchAlignment = 16;
static_assert(kScratchAlignment <= kXlaMaxScratchAlignment &&
                  (kScratchAlignment & (kScratchAlignment - 1)) == 0,
              "XLA's scratch allocator takes a power-of-two alignment of at most 16");

// What XLA:GPU's scratch allocator answers a request for `alignment` (ffi_api.cc): "" when
// it accepts it, else its refusal. An emulated allocator enforces the same contract.
inline std::string ScratchAlignmentRefusal(size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > kXlaMaxScratchAlignment) {
    return "Unsupported alignment: " + std::to_string(alignment);
  }
  return "";
}

// Device scratch memory of one call, given back to XLA when the call's handler returns
// (XLA's allocator orders its reuse after the work already on the call's stream).
class DeviceScratch {
 public:
  DeviceScratch(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx) : api_(api), ctx_(ctx) {}
  DeviceScratch(DeviceScratch&& other) noexcept
      : api_(other.api_), ctx_(other.ctx_), blocks_(std::move(other.blocks_)) {
    other.blocks_.clear();
  }
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  DeviceScratch& operator=(DeviceScratch&&) = delete;
  ~DeviceScratch();

  // `bytes` (at least kScratchAlignment) of device memory aligned to kScratchAlignment,
  // or nullptr with XLA's reason in `*error` (the allocator's own message).
  void* Allocate(size_t bytes, std::string* error);

 private:
  const XLA_FFI_Api* api_;
  XLA_FFI_ExecutionContext* ctx_;
  std::vector<std::pair<void*, size_t>> blocks_;
};

// One execute stage's view of XLA: bind it with .Ctx<XlaContext>().
struct XlaContext {
  cudaStream_t stream = nullptr;
  int32_t device = 0;
  int64_t run_id = 0;
  DeviceScratch scratch;
};

// Decodes the XlaContext from XLA's execution context; nullopt with the reason emitted on
// `diagnostic` when XLA cannot give one of its parts.
std::optional<XlaContext> DecodeXlaContext(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx,
                                           ffi::DiagnosticEngine& diagnostic);

}  // namespace jaxcomm::cuda

template <>
struct xla::ffi::CtxDecoding<jaxcomm::cuda::XlaContext> {
  using Type = jaxcomm::cuda::XlaContext;
  static std::optional<Type> Decode(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx,
                                    DiagnosticEngine& diagnostic) {
    return jaxcomm::cuda::DecodeXlaContext(api, ctx, diagnostic);
  }
};
