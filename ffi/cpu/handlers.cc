#include "cpu/handlers.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include "core/registry.h"
#include "core/rendezvous.h"
#include "cpu/kernels.h"
#include "cpu/launch.h"
#include "cpu/result_stores.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {
namespace {

namespace ffi = xla::ffi;

// Reduce's operand and result lists, per thread and reused (cleared by each use): the
// work of a call allocates none of its own.
struct ReduceLists {
  std::vector<const void*> in;
  std::vector<void*> out;
};
ReduceLists& Lists() {
  thread_local ReduceLists lists;
  lists.in.clear();
  lists.out.clear();
  return lists;
}

// ---------------------------------------------------------------------------- all_reduce

CallResult AllReduce(InstructionState* st, ffi::RunId run, int32_t ordinal, ffi::AnyBuffer x,
                      ffi::Result<ffi::AnyBuffer> y,
                      std::string_view call_site, std::string_view axis, int64_t timeout_ms,
                      ffi::Span<const int64_t>, int64_t group_size,
                      ffi::Span<const int64_t>, int64_t reduce_op) {
  Common c{st, run, ordinal, "all_reduce", call_site, axis, timeout_ms};
  const Peer mine = Buffers(x, *y);
  const size_t n = x.element_count();
  if (n == 0) return Done();
  if (std::string why = CheckReduceOp(reduce_op); !why.empty()) return Reject(c, why);
  const auto dtype = x.element_type();
  const auto op = static_cast<ReduceOp>(reduce_op);
  if (!ReduceSupported(dtype, op)) {
    return Reject(c, std::string("op '") + ReduceOpName(op) + "' does not support this dtype");
  }
  const bool streaming = StreamsResult(y->untyped_data(), y->size_bytes());
  WorkFn work =
      [dtype, op, n, streaming](const std::vector<Peer>& peers, int part, int parts) -> std::string {
        ReduceLists& lists = Lists();
        auto& in = lists.in;
        auto& out = lists.out;
        for (const Peer& p : peers) {
          in.push_back(p.in);
          if (p.out != nullptr) out.push_back(p.out);  // other processes write their own
        }
        constexpr size_t kAlign = 64;  // elements: keeps parts off each other's cache lines
        size_t chunk = ((n + parts - 1) / parts + kAlign - 1) / kAlign * kAlign;
        size_t begin = std::min(n, chunk * part), end = std::min(n, begin + chunk);
        return Reduce(dtype, op, in, out, begin, end, streaming);
      };
  const size_t item = x.size_bytes() / n;
  LaunchOptions options{/*split_by_rank=*/false};
  // Across hosts, reduce within each host first; not for half precision, which would
  // then round once per phase instead of once. (A reduce-scatter over TCP reduces each
  // element once, over every rank.)
  options.combine = [dtype, op](const std::vector<const void*>& in, void* out, size_t elements) {
    return Reduce(dtype, op, in, {out}, 0, elements);
  };
  options.combine_partials = dtype != ffi::DataType::F16 && dtype != ffi::DataType::BF16;
  options.range = [dtype, op, item, streaming](const std::vector<Peer>& peers, size_t lo, size_t hi) -> std::string {
    ReduceLists& lists = Lists();
    auto& in = lists.in;
    auto& out = lists.out;
    for (const Peer& p : peers) {
      in.push_back(p.in);
      if (p.out != nullptr) out.push_back(static_cast<char*>(p.out) + lo * item);
    }
    return Reduce(dtype, op, in, out, 0, hi - lo, streaming);
  };
  return Launch(c, mine, 2 * x.size_bytes() * group_size, std::move(work), std::move(options));
}

// ---------------------------------------------------------------------------- all_gather

CallResult AllGather(InstructionState* st, ffi::RunId run, int32_t ordinal, ffi::AnyBuffer x,
                      ffi::Result<ffi::AnyBuffer> y,
                      std::string_view call_site, std::string_view axis, int64_t timeout_ms,
                      ffi::Span<const int64_t>, int64_t group_size,
                      ffi::Span<const int64_t>, int64_t gather_axis) {
  Common c{st, run, ordinal, "all_gather", call_site, axis, timeout_ms};
  const Peer mine = Buffers(x, *y);
  if (x.element_count() == 0) return Done();
  const auto dims = Dims(x);
  const int64_t item = x.size_bytes() / x.element_count();
  const int64_t outer = Product(dims, 0, gather_axis);
  const size_t inner = Product(dims, gather_axis, dims.size()) * item;
  const int64_t R = group_size;
  const bool streaming = StreamsResult(y->untyped_data(), y->size_bytes());
  WorkFn work =
      [outer, inner, R, streaming](const std::vector<Peer>& peers, int part, int parts) -> std::string {
        ForEachOwnedRank(peers, part, parts, [&](int d) {
          char* out = static_cast<char*>(peers[d].out);
          for (int64_t j = 0; j < R; ++j) {
            const char* in = static_cast<const char*>(peers[j].in);
            for (int64_t o = 0; o < outer; ++o) {
              StoreResult(out + (o * R + j) * inner, in + o * inner, inner, streaming);
            }
          }
        });
        return "";
      };
  LaunchOptions options;
  if (outer == 1) {  // each rank's input lands whole in one block of every result
    options.range = [inner, item, R, streaming](const std::vector<Peer>& peers, size_t lo, size_t hi) -> std::string {
      ForEachOwnedRank(peers, 0, 1, [&](int d) {
        char* out = static_cast<char*>(peers[d].out) + lo * item;
        for (int64_t j = 0; j < R; ++j) StoreResult(out + j * inner, peers[j].in, (hi - lo) * item, streaming);
      });
      return "";
    };
  }
  return Launch(c, mine, 2 * y->size_bytes() * R, std::move(work), std::move(options));
}

// ------------------------------------------------------------------------ reduce_scatter

CallResult ReduceScatter(InstructionState* st, ffi::RunId run, int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, std::string_view call_site,
                          std::string_view axis, int64_t timeout_ms, ffi::Span<const int64_t>,
                          int64_t group_size, ffi::Span<const int64_t>, int64_t reduce_op,
                          int64_t scatter_dimension) {
  Common c{st, run, ordinal, "reduce_scatter", call_site, axis, timeout_ms};
  const Peer mine = Buffers(x, *y);
  if (x.element_count() == 0) return Done();
  if (std::string why = CheckReduceOp(reduce_op); !why.empty()) return Reject(c, why);
  const auto dtype = x.element_type();
  const auto op = static_cast<ReduceOp>(reduce_op);
  if (!ReduceSupported(dtype, op)) {
    return Reject(c, std::string("op '") + ReduceOpName(op) + "' does not support this dtype");
  }
  const auto dims = Dims(x);
  const int64_t item = x.size_bytes() / x.element_count();
  const int64_t R = group_size;
  const int64_t outer = Product(dims, 0, scatter_dimension);
  const size_t inner = Product(dims, scatter_dimension, dims.size()) / R;  // elements
  const bool streaming = StreamsResult(y->untyped_data(), y->size_bytes());
  WorkFn work =
      [dtype, op, outer, inner, item, R, streaming](const std::vector<Peer>& peers, int part, int parts) -> std::string {
        std::string err;
        ReduceLists& lists = Lists();
        auto& in = lists.in;
        auto& out = lists.out;
        in.resize(R);
        out.resize(1);
        ForEachOwnedRank(peers, part, parts, [&](int d) {
          for (int64_t o = 0; o < outer && err.empty(); ++o) {
            for (int64_t j = 0; j < R; ++j) {
              in[j] = static_cast<const char*>(peers[j].in) + ((o * R + d) * inner) * item;
            }
            out[0] = static_cast<char*>(peers[d].out) + o * inner * item;
            err = Reduce(dtype, op, in, out, 0, inner, streaming);
          }
        });
        return err;
      };
  LaunchOptions options;
  if (outer == 1) {  // result d is the reduction of block d of the inputs
    options.range = [dtype, op, inner, item, streaming](const std::vector<Peer>& peers, size_t lo, size_t hi) -> std::string {
      std::string err;
      ReduceLists& lists = Lists();
      auto& in = lists.in;
      auto& out = lists.out;
      in.resize(peers.size());
      out.resize(1);
      ForEachOwnedRank(peers, 0, 1, [&](int d) {
        const size_t begin = std::max(lo, d * inner), end = std::min(hi, (d + 1) * inner);
        if (begin >= end || !err.empty()) return;
        for (size_t j = 0; j < peers.size(); ++j) in[j] = static_cast<const char*>(peers[j].in) + (begin - lo) * item;
        out[0] = static_cast<char*>(peers[d].out) + (begin - d * inner) * item;
        err = Reduce(dtype, op, in, out, 0, end - begin, streaming);
      });
      return err;
    };
    options.reads = ReadsOwnBlock(inner);
  }
  return Launch(c, mine, 2 * x.size_bytes() * R, std::move(work), std::move(options));
}

// ---------------------------------------------------------------------------- all_to_all

CallResult AllToAll(InstructionState* st, ffi::RunId run, int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                     std::string_view call_site, std::string_view axis, int64_t timeout_ms,
                     ffi::Span<const int64_t>, int64_t group_size,
                      ffi::Span<const int64_t>, int64_t split_axis,
                     int64_t concat_axis) {
  Common c{st, run, ordinal, "all_to_all", call_site, axis, timeout_ms};
  const Peer mine = Buffers(x, *y);
  if (x.element_count() == 0) return Done();
  const int64_t R = group_size;
  const auto in_dims = Dims(x);
  const auto out_dims = Dims(*y);
  const int64_t item = x.size_bytes() / x.element_count();
  BlockCopy plan;
  plan.item_bytes = item;
  plan.shape = in_dims;
  plan.shape[split_axis] /= R;
  plan.src_strides = RowMajorStrides(in_dims, item);
  plan.dst_strides = RowMajorStrides(out_dims, item);
  const int64_t src_piece = plan.shape[split_axis] * plan.src_strides[split_axis];
  const int64_t dst_piece = (out_dims[concat_axis] / R) * plan.dst_strides[concat_axis];
  plan.Compile();
  const bool streaming = StreamsResult(y->untyped_data(), y->size_bytes());
  WorkFn work =
      [plan, src_piece, dst_piece, R, streaming](const std::vector<Peer>& peers, int part, int parts) -> std::string {
        ForEachOwnedRank(peers, part, parts, [&](int d) {
          char* out = static_cast<char*>(peers[d].out);
          for (int64_t j = 0; j < R; ++j) {
            plan.Run(static_cast<const char*>(peers[j].in) + d * src_piece, out + j * dst_piece, streaming);
          }
        });
        return "";
      };
  LaunchOptions options;
  if (split_axis == 0 && concat_axis == 0) {
    // Block d of rank j's input is block j of result d, both contiguous.
    const size_t block = x.element_count() / R;
    options.range = [block, item, R, streaming](const std::vector<Peer>& peers, size_t lo, size_t hi) -> std::string {
      ForEachOwnedRank(peers, 0, 1, [&](int d) {
        const size_t begin = std::max(lo, d * block), end = std::min(hi, (d + 1) * block);
        if (begin >= end) return;
        char* out = static_cast<char*>(peers[d].out) + (begin - d * block) * item;
        for (int64_t j = 0; j < R; ++j) {
          StoreResult(out + j * block * item, static_cast<const char*>(peers[j].in) + (begin - lo) * item,
                      (end - begin) * item, streaming);
        }
      });
      return "";
    };
    options.reads = ReadsOwnBlock(block);
  }
  return Launch(c, mine, 2 * x.size_bytes() * R, std::move(work), std::move(options));
}

// ------------------------------------------------------------------------------- ppermute

CallResult Permute(InstructionState* st, ffi::RunId run, int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                    std::string_view call_site, std::string_view axis, int64_t timeout_ms,
                    ffi::Span<const int64_t>, int64_t group_size,
                      ffi::Span<const int64_t>, ffi::Span<const int64_t> sources) {
  Common c{st, run, ordinal, "ppermute", call_site, axis, timeout_ms};
  const Peer mine = Buffers(x, *y);
  if (x.element_count() == 0) return Done();
  if (static_cast<int64_t>(sources.size()) != group_size) {
    return Reject(c, "sources has the wrong length");
  }
  std::vector<int64_t> src(sources.begin(), sources.end());
  const size_t bytes = x.size_bytes();
  const bool streaming = StreamsResult(y->untyped_data(), bytes);
  WorkFn work =
      [src, bytes, streaming](const std::vector<Peer>& peers, int part, int parts) -> std::string {
        ForEachOwnedRank(peers, part, parts, [&](int d) {
          if (src[d] < 0) {
            ZeroResult(peers[d].out, bytes, streaming);
          } else {
            StoreResult(peers[d].out, peers[src[d]].in, bytes, streaming);
          }
        });
        return "";
      };
  LaunchOptions options;
  options.needs = [src](int s, int d) { return src[d] == s; };
  options.point_to_point = true;
  const size_t item = bytes / x.element_count();
  options.range = [src, item, streaming](const std::vector<Peer>& peers, size_t lo, size_t hi) -> std::string {
    ForEachOwnedRank(peers, 0, 1, [&](int d) {
      char* out = static_cast<char*>(peers[d].out) + lo * item;
      if (src[d] < 0) {
        ZeroResult(out, (hi - lo) * item, streaming);
      } else {
        StoreResult(out, peers[src[d]].in, (hi - lo) * item, streaming);
      }
    });
    return "";
  };
  return Launch(c, mine, 2 * bytes * group_size, std::move(work), std::move(options));
}

// ------------------------------------------------------------------------------ broadcast

CallResult Broadcast(InstructionState* st, ffi::RunId run, int32_t ordinal, ffi::AnyBuffer x,
                      ffi::Result<ffi::AnyBuffer> y,
                      std::string_view call_site, std::string_view axis, int64_t timeout_ms,
                      ffi::Span<const int64_t>, int64_t group_size,
                      ffi::Span<const int64_t>, int64_t root) {
  Common c{st, run, ordinal, "broadcast", call_site, axis, timeout_ms};
  const Peer mine = Buffers(x, *y);
  if (x.element_count() == 0) return Done();
  const size_t bytes = x.size_bytes();
  const bool streaming = StreamsResult(y->untyped_data(), bytes);
  WorkFn work =
      [root, bytes, streaming](const std::vector<Peer>& peers, int part, int parts) -> std::string {
        const void* src = peers[root].in;
        ForEachOwnedRank(peers, part, parts, [&](int d) {
          StoreResult(peers[d].out, src, bytes, streaming);  // nothing to do for the root in place
        });
        return "";
      };
  LaunchOptions options;
  options.needs = [root](int s, int) { return s == root; };
  return Launch(c, mine, 2 * bytes * group_size, std::move(work), std::move(options));
}

// --------------------------------------------------------------------------- instantiate

uint64_t InstructionKey(const ffi::Dictionary& attrs) {
  auto text = [&attrs](const char* name) {
    auto v = attrs.get<std::string_view>(name);
    return v.has_value() ? *v : std::string_view();
  };
  auto groups = attrs.get<ffi::Span<const int64_t>>("groups");
  return jaxcomm::InstructionKey(text("call_site"), text("axis"),
                                 groups.has_value() ? *groups : ffi::Span<const int64_t>());
}

ffi::ErrorOr<std::unique_ptr<InstructionState>> Instantiate(ffi::Dictionary attrs) {
  auto parsed = ParseGroupAttrs(attrs, "jaxcomm");
  if (!parsed.has_value()) return ffi::Unexpected(parsed.error());
  auto table = std::make_shared<RoundTable>(std::move(parsed->groups), parsed->partition_devices,
                                            Registry::Get().process_index(), InstructionKey(attrs));
  Registry::Get().AddTable(table);  // the mismatch check looks at every table's rounds
  return std::make_unique<InstructionState>(std::move(table));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cpu_Instantiate, Instantiate,
                              ffi::Ffi::BindInstantiate().Attrs<ffi::Dictionary>());
// The six single-operand collectives, bound with their attributes from core/op_table.h.
#define JAXCOMM_UNARY_HANDLER(name, Handler)                                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cpu_##Handler, Handler,                               \
                                BindCommon(ffi::Ffi::Bind(), [](auto b) { return BindUnary(std::move(b)); }) \
                                    JAXCOMM_BIND_ATTRS(name));
JAXCOMM_UNARY_HANDLER(all_reduce, AllReduce)
JAXCOMM_UNARY_HANDLER(all_gather, AllGather)
JAXCOMM_UNARY_HANDLER(reduce_scatter, ReduceScatter)
JAXCOMM_UNARY_HANDLER(all_to_all, AllToAll)
JAXCOMM_UNARY_HANDLER(ppermute, Permute)
JAXCOMM_UNARY_HANDLER(broadcast, Broadcast)
#undef JAXCOMM_UNARY_HANDLER

XLA_FFI_Handler* const kInstantiate = jaxcomm_cpu_Instantiate;
XLA_FFI_Handler* const kAllReduce = jaxcomm_cpu_AllReduce;
XLA_FFI_Handler* const kAllGather = jaxcomm_cpu_AllGather;
XLA_FFI_Handler* const kReduceScatter = jaxcomm_cpu_ReduceScatter;
XLA_FFI_Handler* const kAllToAll = jaxcomm_cpu_AllToAll;
XLA_FFI_Handler* const kPermute = jaxcomm_cpu_Permute;
XLA_FFI_Handler* const kBroadcast = jaxcomm_cpu_Broadcast;

}  // namespace jaxcomm::cpu
