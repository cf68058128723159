// The emulation's side of the XLA seam (ffi/cuda/xla_context.h), in place of XLA:GPU's
// (ffi/cuda/xla_context.cc). Under XLA:CPU the FFI gives a handler no stream and no
// scratch allocator, so:
//  - the stream is the device's emulated "XLA stream" (cuda_emu::XlaStream), a blocking
//    stream as XLA:GPU's compute stream is;
//  - scratch comes from the emulated device memory (poisoned), under XLA:GPU's contract:
//    a power-of-two alignment of at most 16, refused with XLA's own message otherwise
//    (issue 30's defect 1 broke it);
//  - when the handler returns (its XlaContext is destroyed), the XLA stream is drained:
//    XLA:CPU reads the results as soon as the handler returns, where XLA:GPU would order
//    its next work after the stream's. Then the scratch goes back, as XLA:GPU's allocator
//    reuses it only after the stream's work.
#include "cuda/xla_context.h"

#include "cuda_emu/runtime/emu.h"
#include "cuda_emu/seam/seam.h"

namespace jaxcomm::cuda {
namespace {

// The device ordinal of the call `ctx` (what the destructor needs to find its stream).
int32_t Ordinal(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx) {
  ffi::DiagnosticEngine diagnostic;
  auto device = ffi::CtxDecoding<ffi::DeviceOrdinal>::Decode(api, ctx, diagnostic);
  return device ? *device : 0;
}

}  // namespace

DeviceScratch::~DeviceScratch() {
  if (api_ == nullptr || ctx_ == nullptr) return;
  const int32_t device = Ordinal(api_, ctx_);
  // Moved-from objects drain too: harmless (the stream is idle by then).
  cudaSetDevice(device);
  cudaStreamSynchronize(cuda_emu::XlaStream(device));
  for (const auto& [data, size] : blocks_) cudaFree(data);
}

void* DeviceScratch::Allocate(size_t bytes, std::string* error) {
  void* p = cuda_emu::seam::AllocateScratch(Ordinal(api_, ctx_), bytes, kScratchAlignment, error);
  if (p != nullptr) blocks_.emplace_back(p, bytes);
  return p;
}

std::optional<XlaContext> DecodeXlaContext(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx,
                                           ffi::DiagnosticEngine& diagnostic) {
  auto device = ffi::CtxDecoding<ffi::DeviceOrdinal>::Decode(api, ctx, diagnostic);
  auto run = ffi::CtxDecoding<ffi::RunId>::Decode(api, ctx, diagnostic);
  if (!device || !run) return std::nullopt;
  return XlaContext{cuda_emu::XlaStream(*device), *device, run->run_id, DeviceScratch(api, ctx)};
}

}  // namespace jaxcomm::cuda

namespace jaxcomm::cuda_emu::seam {

void* AllocateScratch(int device, size_t bytes, size_t alignment, std::string* error) {
  const std::string refusal = cuda::ScratchAlignmentRefusal(alignment);
  if (!refusal.empty()) {
    // XLA:GPU's words (xla/ffi/ffi_api.cc), as DeviceScratch::Allocate reports them there.
    *error = "XLA's scratch allocator refused " + std::to_string(bytes) + " bytes at alignment " +
             std::to_string(alignment) + ": INVALID_ARGUMENT: " + refusal;
    return nullptr;
  }
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes == 0 ? 1 : bytes);
  cudaSetDevice(previous);
  if (e != cudaSuccess) {
    *error = "XLA's scratch allocator refused " + std::to_string(bytes) + " bytes at alignment " +
             std::to_string(alignment) + ": RESOURCE_EXHAUSTED: " + cudaGetErrorString(e);
    return nullptr;
  }
  return p;
}

}  // namespace jaxcomm::cuda_emu::seam
