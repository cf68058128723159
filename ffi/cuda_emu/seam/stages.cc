#include "cuda_emu/seam/stages.h"

#include <array>
#include <cstdlib>
#include <utility>

namespace jaxcomm::cuda_emu {
namespace {

constexpr int kMaxOps = 32;

int CountOps() {
  int n = 0;
  while (cuda::AllStages()[n].op != nullptr) ++n;
  return n;
}

// The initialize stage of op `i` on the call frame of its execute stage: the same
// context (state, device), no arguments, results or attributes (it binds none).
template <int I>
XLA_FFI_Error* InitializeThenExecute(XLA_FFI_CallFrame* frame) {
  const cuda::Stages& s = cuda::AllStages()[I];
  XLA_FFI_CallFrame init = *frame;
  init.stage = XLA_FFI_ExecutionStage_INITIALIZE;
  init.args.size = 0;
  init.rets.size = 0;
  init.attrs.size = 0;
  init.future = nullptr;
  if (XLA_FFI_Error* e = s.initialize(&init)) return e;
  return s.execute(frame);
}

template <int... I>
constexpr std::array<XLA_FFI_Handler*, kMaxOps> Table(std::integer_sequence<int, I...>) {
  return {&InitializeThenExecute<I>...};
}

}  // namespace

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

}  // namespace jaxcomm::cuda_emu
