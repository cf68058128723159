#include "cpu/moe_dispatch.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/op_table.h"
#include "cpu/launch.h"
#include "cpu/moe_convert.h"
#include "cpu/moe_kernels.h"
#include "cpu/moe_routing.h"
#include "cpu/moe_split.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {
namespace {

struct DispatchPlan {
  RouteShape shape;
  int64_t H = 0;
  MoeFp8 fp8 = MoeFp8::kNone;  // core/op_table.h
  Real x_type = Real::kF32;   // with FP8: the source tokens' type
  Real out_type = Real::kF32; // with dequantized FP8: the delivered rows' type
  int64_t in_row_bytes = 0;   // a moved token row: x's, or its FP8 code's
  int64_t out_row_bytes = 0;
  int64_t header = 0;         // int32 words before the route tables (status block)
  bool zero_unused = true, check_ids = false;
};

std::string CheckDispatch(const ffi::AnyBuffer& x, const ffi::AnyBuffer& ids, const ffi::AnyBuffer& ex,
                          const ffi::AnyBuffer& route, const ffi::AnyBuffer& q, const ffi::AnyBuffer& scales,
                          DispatchPlan* p) {
  auto xd = x.dimensions(), id = ids.dimensions(), od = ex.dimensions();
  if (xd.size() != 2 || id.size() != 2 || od.size() != 2 || ids.element_type() != ffi::DataType::S32 ||
      id[0] != xd[0] || od[1] != xd[1] || route.element_type() != ffi::DataType::S32) {
    return "bad operand shapes or dtypes";
  }
  RouteShape& s = p->shape;
  s.T = xd[0];
  s.K = id[1];
  s.rows = od[0];
  p->H = xd[1];
  if (std::string why = CheckRouteShape(s); !why.empty()) return why;
  if (static_cast<int64_t>(route.element_count()) != p->header + 2 * s.T * s.K + s.El() + 3) {
    return "the route table's size disagrees with the call";
  }
  const int64_t nb = Fp8Blocks(p->H);
  if (p->fp8 == MoeFp8::kNone) {
    if (ex.element_type() != x.element_type() || q.element_count() != 0 || scales.element_count() != 0) {
      return "expert_x must have x's dtype";
    }
    p->in_row_bytes = x.element_count() ? static_cast<int64_t>(x.size_bytes()) / s.T : 0;
    p->out_row_bytes = p->in_row_bytes;
    return "";
  }
  if (!AsReal(x.element_type(), &p->x_type)) return "FP8 dispatch of a dtype other than float32/bfloat16/float16";
  if (q.element_type() != ffi::DataType::F8E4M3FN || static_cast<int64_t>(q.element_count()) != s.T * p->H ||
      scales.element_type() != ffi::DataType::F32 || static_cast<int64_t>(scales.element_count()) != s.T * nb) {
    return "bad FP8 staging buffers";
  }
  p->in_row_bytes = p->H;
  if (p->fp8 == MoeFp8::kRaw) {
    if (ex.element_type() != ffi::DataType::F8E4M3FN) return "FP8 delivery needs a float8_e4m3fn expert_x";
    p->out_row_bytes = p->H;
    return "";
  }
  if (ex.element_type() != x.element_type()) return "dequantized FP8 delivery needs expert_x in x's dtype";
  p->out_type = p->x_type;
  p->out_row_bytes = p->H * RealBytes(p->out_type);
  return "";
}

// The routing of one call, built by whichever part of the work gets there first.
struct SharedRouting {
  std::once_flag once;
  Routing routing;
  std::string error;
};

// Faults in the whole pages of [data, data + bytes) in one system call
// (MADV_POPULATE_WRITE, Linux 5.14+; elsewhere, or refused, the writes fault them in).
// Measured on the low-latency dispatch at T=128, H=7168, 256 experts, 8 ranks: 1.13-1.28x
// less wall and 1.15-1.18x less CPU time per dispatch+combine; on the zeroed layouts,
// whose results get huge pages, no difference, so they do not call it.
//
// Skipped where the run's first page is already in memory: XLA reuses a loop's
// temporaries from step to step, and populating pages that are all there still walks
// each one (9% of a decode step in a 10-step loop; the rows of an expert start at the
// same place every step, so its first page tells).
void PrefaultResult(char* data, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  // Whole pages inside the region only: its ends may share a page with other data.
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
  if (end <= begin) return;
  unsigned char resident = 0;
  if (mincore(reinterpret_cast<void*>(begin), page, &resident) == 0 && (resident & 1) != 0) return;
  madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE);
#else
  (void)data;
  (void)bytes;
#endif
}

// Receiver r's expert rows: each kept assignment's token row, copied (or dequantized)
// from its source, and zeros in the rows nobody fills if asked.
void Deliver(const DispatchPlan& p, const Routing& routing, const std::vector<Peer>& peers, int r) {
  char* out = static_cast<char*>(peers[r].out);
  const RouteShape& s = p.shape;
  const int64_t nb = Fp8Blocks(p.H);
  std::vector<int32_t> sizes(s.El());
  routing.ReceiverSizes(r, sizes.data());
  if (!p.zero_unused) {
    // The low-latency result has no huge pages (mostly unwritten): fault in the rows
    // that will be written, each expert's run at once, before the row copies.
    for (int64_t el = 0; el < s.El(); ++el) {
      PrefaultResult(out + routing.ExpertStart(r, el) * p.out_row_bytes,
                     static_cast<size_t>(sizes[el]) * p.out_row_bytes);
    }
  }
  auto rows = [&](auto copy) {
    for (int64_t src = 0; src < s.R; ++src) {
      const int32_t* dest = routing.dest(static_cast<int>(src));
      const int32_t* pos = routing.pos(static_cast<int>(src));
      const char* in = static_cast<const char*>(peers[src].in);
      const float* scales = static_cast<const float*>(peers[src].aux[1]);
      for (int64_t i = 0; i < s.T * s.K; ++i) {
        if (dest[i] != r) continue;
        const int64_t t = i / s.K;
        copy(out + pos[i] * p.out_row_bytes, in + t * p.in_row_bytes, scales + t * nb);
      }
    }
  };
  if (p.fp8 == MoeFp8::kDequantize) {
    WithReal(p.out_type, [&](auto o) {
      rows([&](char* dst, const char* q, const float* sc) {
        DequantizeRowE4M3<decltype(o)>(dst, reinterpret_cast<const uint8_t*>(q), sc, p.H);
      });
    });
  } else {
    rows([&](char* dst, const char* in, const float*) { std::memcpy(dst, in, p.out_row_bytes); });
  }
  if (!p.zero_unused) return;
  for (int64_t el = 0; el < s.El(); ++el) {
    const int64_t from = routing.ExpertStart(r, el) + sizes[el];
    const int64_t to = el + 1 < s.El() ? routing.ExpertStart(r, el + 1) : s.rows;
    if (to > from) std::memset(out + from * p.out_row_bytes, 0, (to - from) * p.out_row_bytes);
  }
}

// Rank r's route table (layout in moe_dispatch.h).
void WriteRoute(const DispatchPlan& p, const Routing& routing, int32_t* table, int r) {
  const RouteShape& s = p.shape;
  const int64_t TK = s.T * s.K;
  int32_t* t = table + p.header;
  std::memcpy(t, routing.pos(r), sizeof(int32_t) * TK);
  std::memcpy(t + TK, routing.dest(r), sizeof(int32_t) * TK);
  int32_t* stats = t + 2 * TK + s.El();
  stats[2] = routing.ReceiverSizes(r, t + 2 * TK);
  stats[0] = routing.dropped(r);
  stats[1] = routing.invalid(r);
}

ffi::Future MoeDispatch(InstructionState* st, ffi::RunId run, int32_t ordinal, ffi::AnyBuffer x,
                        ffi::AnyBuffer ids, ffi::Result<ffi::AnyBuffer> ex, ffi::Result<ffi::AnyBuffer> route,
                        ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> scales,
                        std::string_view call_site, std::string_view axis, int64_t timeout_ms,
                        ffi::Span<const int64_t>, int64_t group_size, ffi::Span<const int64_t>,
                        int64_t num_experts, int64_t slab, int64_t fp8, int64_t zero_unused,
                        int64_t check_ids, int64_t split) {
  Common c{st, run, ordinal, split ? "moe_dispatch_send" : "moe_dispatch", call_site, axis, timeout_ms};
  DispatchPlan p;
  p.shape.R = group_size;
  p.shape.E = num_experts;
  p.shape.slab = slab;
  p.zero_unused = zero_unused != 0;
  p.check_ids = check_ids != 0;
  p.header = split ? kStatusWords : 0;
  if (std::string why = CheckMoeFp8(fp8); !why.empty()) return Reject(c, why);
  p.fp8 = static_cast<MoeFp8>(fp8);
  if (std::string why = CheckDispatch(x, ids, *ex, *route, *q, *scales, &p); !why.empty()) return Reject(c, why);

  if (p.fp8 != MoeFp8::kNone) {
    // This rank's tokens, quantized once on its own thread before its peers read them.
    const int64_t nb = Fp8Blocks(p.H), in_row = p.H * RealBytes(p.x_type);
    auto* qd = static_cast<uint8_t*>(q->untyped_data());
    auto* sd = static_cast<float*>(scales->untyped_data());
    const char* xd = static_cast<const char*>(x.untyped_data());
    WithReal(p.x_type, [&](auto in) {
      for (int64_t t = 0; t < p.shape.T; ++t) {
        QuantizeRowE4M3<decltype(in)>(xd + t * in_row, p.H, qd + t * p.H, sd + t * nb);
      }
    });
  }
  // Peers read the FP8 staging copy where there is one.
  Peer mine = Buffers(p.fp8 != MoeFp8::kNone ? static_cast<const ffi::AnyBuffer&>(*q) : x, *ex, {&ids, &*scales},
                      /*written_whole=*/p.zero_unused);
  mine.out_aux = route->untyped_data();

  auto shared = std::make_shared<SharedRouting>();
  WorkFn work = [p, shared](const std::vector<Peer>& peers, int part, int parts) -> std::string {
    std::call_once(shared->once, [&] {
      std::vector<const int32_t*> all_ids(peers.size());
      for (size_t s = 0; s < peers.size(); ++s) all_ids[s] = static_cast<const int32_t*>(peers[s].aux[0]);
      shared->error = shared->routing.Build(p.shape, all_ids, p.check_ids);
    });
    if (!shared->error.empty()) return shared->error;
    ForEachOwnedRank(peers, part, parts, [&](int r) {
      Deliver(p, shared->routing, peers, r);
      WriteRoute(p, shared->routing, static_cast<int32_t*>(peers[r].out_aux), r);
    });
    return "";
  };
  const RouteShape& s = p.shape;
  const size_t touched = static_cast<size_t>(s.R) *
                         (static_cast<size_t>(s.T * s.K * (p.in_row_bytes + p.out_row_bytes)) +
                          (p.zero_unused ? ex->size_bytes() : 0));
  if (split) {
    OpenSend(route->untyped_data(), ex->untyped_data());
    return LaunchSend(c, mine, touched, std::move(work), route->untyped_data());
  }
  return Launch(c, mine, touched, std::move(work));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cpu_MoeDispatch, MoeDispatch,
                              BindCommon(ffi::Ffi::Bind(),
                                         [](auto b) {
                                           return std::move(b)
                                               .template Arg<ffi::AnyBuffer>()
                                               .template Arg<ffi::AnyBuffer>()
                                               .template Ret<ffi::AnyBuffer>()
                                               .template Ret<ffi::AnyBuffer>()
                                               .template Ret<ffi::AnyBuffer>()
                                               .template Ret<ffi::AnyBuffer>();
                                         })
                                  JAXCOMM_BIND_ATTRS(moe_dispatch));

XLA_FFI_Handler* const kMoeDispatch = jaxcomm_cpu_MoeDispatch;

}  // namespace jaxcomm::cpu
