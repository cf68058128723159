#include "cpu/ft.h"

#include <algorithm>
#include <string>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/launch.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {
namespace {

namespace ffi = xla::ffi;

ffi::Future FtAllReduce(InstructionState* st, ffi::RunId run, int32_t ordinal, ffi::AnyBuffer x,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mask,
                        std::string_view call_site, std::string_view axis, int64_t timeout_ms,
                        ffi::Span<const int64_t>, int64_t group_size, ffi::Span<const int64_t>) {
  Common c{st, run, ordinal, "ft.all_reduce", call_site, axis, timeout_ms};
  const auto dtype = x.element_type();
  if (!ReduceSupported(dtype, ReduceOp::kSum)) return Reject(c, "the dtype does not support addition");
  if (mask->element_type() != ffi::DataType::PRED ||
      static_cast<int64_t>(mask->element_count()) != group_size) {
    return Reject(c, "the mask result must be bool[group size]");
  }
  Peer mine = Buffers(x, *y);
  mine.out_aux = mask->untyped_data();
  const size_t n = x.element_count();
  const WorkFn work = [dtype, n](const std::vector<Peer>& peers, int part, int parts) -> std::string {
    std::vector<const void*> in;
    std::vector<void*> out;
    for (const Peer& p : peers) {
      if (p.in != nullptr) in.push_back(p.in);  // ranks left out contribute nothing
      if (p.out != nullptr) out.push_back(p.out);
    }
    if (part == 0) {
      for (const Peer& p : peers) {
        if (p.out_aux == nullptr) continue;
        auto* m = static_cast<bool*>(p.out_aux);
        for (size_t r = 0; r < peers.size(); ++r) m[r] = peers[r].in != nullptr;
      }
    }
    constexpr size_t kAlign = 64;
    const size_t chunk = ((n + parts - 1) / parts + kAlign - 1) / kAlign * kAlign;
    const size_t begin = std::min(n, chunk * part), end = std::min(n, begin + chunk);
    return begin < end ? Reduce(dtype, ReduceOp::kSum, in, out, begin, end) : "";
  };
  // A zero-size operand still meets its peers: the mask is the call's result too.
  if (n == 0 && x.untyped_data() == nullptr) mine.in = &mine;  // any non-null marker
  return Launch(c, mine, 2 * x.size_bytes() * group_size, std::move(work),
                LaunchOptions{/*split_by_rank=*/false, /*tolerant=*/true});
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cpu_FtAllReduce, FtAllReduce,
                              BindCommon(ffi::Ffi::Bind(), [](auto b) {
                                return std::move(b)
                                    .template Arg<ffi::AnyBuffer>()
                                    .template Ret<ffi::AnyBuffer>()
                                    .template Ret<ffi::AnyBuffer>();
                              }) JAXCOMM_BIND_ATTRS(ft_all_reduce));

XLA_FFI_Handler* const kFtAllReduce = jaxcomm_cpu_FtAllReduce;

}  // namespace jaxcomm::cpu
