#include "cuda_emu/seam/stages.h"

#include <array>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "cuda_emu/seam/staging.h"

namespace jaxcomm::cuda_emu {
namespace {

constexpr int kMaxOps = 32;

int CountOps() {
  int n = 0;
  while (cuda::AllStages()[n].op != nullptr) ++n;
  return n;
}

// XLA:CPU's device ids of this process's devices, in local order (SetLocalDevices).
std::mutex ids_mu;
std::vector<int64_t> local_ids;
XLA_FFI_DeviceOrdinal_Get* xla_ordinal = nullptr;

// XLA:CPU's DeviceOrdinal is the device's id in the job (process 1 of a job of 2-device
// processes: 2048, 2049); XLA:GPU's is the local ordinal, which the CUDA backend takes
// as its CUDA device. The handlers' API table maps one to the other.
XLA_FFI_Error* LocalDeviceOrdinal(XLA_FFI_DeviceOrdinal_Get_Args* args) {
  if (XLA_FFI_Error* e = xla_ordinal(args)) return e;
  std::lock_guard<std::mutex> lock(ids_mu);
  for (size_t k = 0; k < local_ids.size(); ++k) {
    if (local_ids[k] == args->device_ordinal) {
      args->device_ordinal = static_cast<int32_t>(k);
      break;
    }
  }
  return nullptr;
}

// XLA's API table with DeviceOrdinal_Get mapped (one XLA in the process: one table).
const XLA_FFI_Api* HandlerApi(const XLA_FFI_Api* api) {
  static const XLA_FFI_Api* patched = [api] {
    static XLA_FFI_Api copy = *api;  // the fields this build knows
    xla_ordinal = api->XLA_FFI_DeviceOrdinal_Get;
    copy.XLA_FFI_DeviceOrdinal_Get = &LocalDeviceOrdinal;
    return &copy;
  }();
  return patched;
}

// XLA's metadata query (the handler's API version and traits) rather than a call.
bool MetadataQuery(const XLA_FFI_CallFrame* frame) {
  for (const XLA_FFI_Extension_Base* e = frame->extension_start; e != nullptr; e = e->next) {
    if (e->type == XLA_FFI_Extension_Metadata) return true;
  }
  return false;
}

seam::CallKind KindOf(const char* op) {
  if (std::strcmp(op, "moe_transport_send") == 0 || std::strcmp(op, "put_start") == 0) {
    return seam::CallKind::kSendHalf;
  }
  if (std::strcmp(op, "moe_recv") == 0 || std::strcmp(op, "put_done") == 0) return seam::CallKind::kReceiveHalf;
  return seam::CallKind::kPlain;
}

// One emulated call of an execute stage: XLA's metadata query and any stage but execute
// go to the handler alone. An execute stage runs, with the device ordinal mapped, first
// the op's initialize stage (if it has one) on the same context (state, device) with no
// arguments, results or attributes (it binds none), then the execute stage on the call's
// buffers staged in emulated device memory (staging.h).
XLA_FFI_Error* RunEmulated(XLA_FFI_CallFrame* frame, XLA_FFI_Handler* initialize, XLA_FFI_Handler* execute,
                           seam::CallKind kind) {
  if (MetadataQuery(frame) || frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return execute(frame);
  XLA_FFI_CallFrame call = *frame;
  call.api = HandlerApi(frame->api);
  if (initialize != nullptr) {
    XLA_FFI_CallFrame init = call;
    init.stage = XLA_FFI_ExecutionStage_INITIALIZE;
    init.args.size = 0;
    init.rets.size = 0;
    init.attrs.size = 0;
    init.future = nullptr;
    if (XLA_FFI_Error* e = initialize(&init)) return e;
  }
  return seam::RunStaged(&call, kind, execute);
}

// Op `I`'s emulated execute stage (its initialize stage first: XLA:CPU runs none).
template <int I>
XLA_FFI_Error* InitializeThenExecute(XLA_FFI_CallFrame* frame) {
  const cuda::Stages& s = cuda::AllStages()[I];
  return RunEmulated(frame, s.initialize, s.execute, KindOf(s.op));
}

template <int... I>
constexpr std::array<XLA_FFI_Handler*, kMaxOps> Table(std::integer_sequence<int, I...>) {
  return {&InitializeThenExecute<I>...};
}

// A kernel outside any group, on its buffers staged as the groups' are.
template <int I>
XLA_FFI_Error* StagedLocal(XLA_FFI_CallFrame* frame) {
  return RunEmulated(frame, nullptr, cuda::LocalTargets()[I].execute, seam::CallKind::kPlain);
}

template <int... I>
constexpr std::array<XLA_FFI_Handler*, kMaxOps> LocalTable(std::integer_sequence<int, I...>) {
  return {&StagedLocal<I>...};
}

}  // namespace

void SetLocalDevices(std::vector<int64_t> xla_ids) {
  std::lock_guard<std::mutex> lock(ids_mu);
  local_ids = std::move(xla_ids);
}

const cuda::Stages* EmulatedStages() {
  static const auto stages = [] {
    constexpr auto wrappers = Table(std::make_integer_sequence<int, kMaxOps>());
    std::array<cuda::Stages, kMaxOps + 1> out{};
    const int n = CountOps();
    if (n > kMaxOps) std::abort();  // raise kMaxOps
    for (int i = 0; i < n; ++i) {
      const cuda::Stages& s = cuda::AllStages()[i];
      out[i] = {s.op, s.instantiate, nullptr, wrappers[i]};
    }
    out[n] = {nullptr, nullptr, nullptr, nullptr};
    return out;
  }();
  return stages.data();
}

const cuda::LocalTarget* EmulatedLocalTargets() {
  static const auto targets = [] {
    constexpr auto wrappers = LocalTable(std::make_integer_sequence<int, kMaxOps>());
    std::array<cuda::LocalTarget, kMaxOps + 1> out{};
    int n = 0;
    while (cuda::LocalTargets()[n].op != nullptr) ++n;
    if (n > kMaxOps) std::abort();  // raise kMaxOps
    for (int i = 0; i < n; ++i) out[i] = {cuda::LocalTargets()[i].op, wrappers[i]};
    out[n] = {nullptr, nullptr};
    return out;
  }();
  return targets.data();
}

}  // namespace jaxcomm::cuda_emu
