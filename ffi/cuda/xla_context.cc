// XLA:GPU's side of the seam (xla_context.h): the stream, device, run id and scratch
// memory from XLA's FFI. The CPU emulation compiles its own definitions instead.
#include "cuda/xla_context.h"

#include <algorithm>

namespace jaxcomm::cuda {
namespace {

// XLA's message for `error`, which is then destroyed.
std::string Consume(const XLA_FFI_Api* api, XLA_FFI_Error* error) {
  std::string message(ffi::internal::GetErrorMessage(api, error));
  ffi::internal::DestroyError(api, error);
  return message;
}

}  // namespace

DeviceScratch::~DeviceScratch() {
  for (const auto& [data, size] : blocks_) {
    XLA_FFI_DeviceMemory_Free_Args args;
    args.struct_size = XLA_FFI_DeviceMemory_Free_Args_STRUCT_SIZE;
    args.extension_start = nullptr;
    args.ctx = ctx_;
    args.size = size;
    args.data = data;
    // Nothing to report to at destruction; XLA logs its own failures.
    if (XLA_FFI_Error* error = api_->XLA_FFI_DeviceMemory_Free(&args)) Consume(api_, error);
  }
}

void* DeviceScratch::Allocate(size_t bytes, std::string* error) {
  // XLA's allocator answers a request of 0 bytes with no memory; callers want an address.
  bytes = std::max(bytes, kScratchAlignment);
  XLA_FFI_DeviceMemory_Allocate_Args args;
  args.struct_size = XLA_FFI_DeviceMemory_Allocate_Args_STRUCT_SIZE;
  args.extension_start = nullptr;
  args.ctx = ctx_;
  args.size = bytes;
  args.alignment = kScratchAlignment;
  args.data = nullptr;
  if (XLA_FFI_Error* e = api_->XLA_FFI_DeviceMemory_Allocate(&args)) {
    *error = "XLA's scratch allocator refused " + std::to_string(bytes) + " bytes at alignment " +
             std::to_string(kScratchAlignment) + ": " + Consume(api_, e);
    return nullptr;
  }
  if (args.data == nullptr) {
    *error = "XLA's scratch allocator returned no memory for " + std::to_string(bytes) + " bytes";
    return nullptr;
  }
  blocks_.emplace_back(args.data, bytes);
  return args.data;
}

std::optional<XlaContext> DecodeXlaContext(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx,
                                           ffi::DiagnosticEngine& diagnostic) {
  auto stream = ffi::CtxDecoding<ffi::PlatformStream<cudaStream_t>>::Decode(api, ctx, diagnostic);
  auto device = ffi::CtxDecoding<ffi::DeviceOrdinal>::Decode(api, ctx, diagnostic);
  auto run = ffi::CtxDecoding<ffi::RunId>::Decode(api, ctx, diagnostic);
  if (!stream || !device || !run) return std::nullopt;
  return XlaContext{*stream, *device, run->run_id, DeviceScratch(api, ctx)};
}

}  // namespace jaxcomm::cuda
