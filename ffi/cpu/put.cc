#include "cpu/put.h"

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "cpu/launch.h"
#include "cpu/moe_split.h"
#include "cpu/result_stores.h"

namespace jaxcomm::cpu {
namespace {

// Writes the sources' operands into the destinations' results (those this process owns),
// bytes [lo, hi) of each result: the put's data movement. The operands' pointers point at
// byte lo already where the round streams by ranges (RangeFn, core/rendezvous.h).
std::string Deliver(const std::vector<Peer>& peers, const std::vector<int64_t>& src, size_t lo, size_t hi,
                    bool streaming, int part, int parts) {
  ForEachOwnedRank(peers, part, parts, [&](int d) {
    char* out = static_cast<char*>(peers[d].out) + lo;
    if (src[d] < 0) {
      ZeroResult(out, hi - lo, streaming);
    } else {
      StoreResult(out, peers[src[d]].in, hi - lo, streaming);
    }
  });
  return "";
}

ffi::Future PutStart(InstructionState* st, ffi::RunId run, int32_t ordinal, ffi::AnyBuffer x,
                     ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> status,
                     std::string_view call_site, std::string_view axis, int64_t timeout_ms,
                     ffi::Span<const int64_t>, int64_t group_size, ffi::Span<const int64_t>,
                     ffi::Span<const int64_t> sources) {
  Common c{st, run, ordinal, "put_start", call_site, axis, timeout_ms};
  if (status->size_bytes() < static_cast<size_t>(kStatusWords) * 4) return Reject(c, "status block too small");
  if (static_cast<int64_t>(sources.size()) != group_size) return Reject(c, "sources has the wrong length");
  if (data->size_bytes() != x.size_bytes()) return Reject(c, "result and operand sizes differ");
  // Zero-size puts never reach here (jaxcomm/_src/tp/put.py): every put has a round.
  OpenSend(status->untyped_data(), data->untyped_data());
  std::vector<int64_t> src(sources.begin(), sources.end());
  const size_t bytes = x.size_bytes();
  const bool streaming = StreamsResult(data->untyped_data(), bytes);
  WorkFn work = [src, bytes, streaming](const std::vector<Peer>& peers, int part, int parts) {
    return Deliver(peers, src, 0, bytes, streaming, part, parts);  // whole buffers: lo = 0
  };
  LaunchOptions options;
  options.needs = [src](int s, int d) { return src[d] == s; };
  options.point_to_point = true;
  const size_t item = bytes / x.element_count();
  options.range = [src, item, streaming](const std::vector<Peer>& peers, size_t lo, size_t hi) {
    return Deliver(peers, src, lo * item, hi * item, streaming, 0, 1);
  };
  return LaunchSend(c, Buffers(x, *data), 2 * bytes * group_size, std::move(work), status->untyped_data(),
                    std::move(options));
}

ffi::Future PutDone(InstructionState* st, ffi::RunId run, int32_t ordinal, ffi::AnyBuffer data,
                    ffi::AnyBuffer status, ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> data_out,
                    ffi::Result<ffi::AnyBuffer> status_out, std::string_view call_site, std::string_view axis,
                    int64_t timeout_ms, ffi::Span<const int64_t>, int64_t, ffi::Span<const int64_t>) {
  return AwaitSend(Common{st, run, ordinal, "put_done", call_site, axis, timeout_ms}, data, status, *data_out,
                   *status_out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cpu_PutStart, PutStart,
                              BindCommon(ffi::Ffi::Bind(),
                                         [](auto b) { return BindBuffers<1>(std::move(b)).template Ret<ffi::AnyBuffer>(); })
                                  JAXCOMM_BIND_ATTRS(put_start));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cpu_PutDone, PutDone,
                              BindCommon(ffi::Ffi::Bind(), [](auto b) { return BindReceiveHalf(std::move(b)); })
                                  JAXCOMM_BIND_ATTRS(put_done));

XLA_FFI_Handler* const kPutStart = jaxcomm_cpu_PutStart;
XLA_FFI_Handler* const kPutDone = jaxcomm_cpu_PutDone;

}  // namespace jaxcomm::cpu
