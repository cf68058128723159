// The host backend's MoE expert-parallel transports (jaxcomm/_src/moe/fused.py): dispatch and
// combine, and their gradients, each one collective in which every rank reads its peers'
// token or expert rows in place (one address space), guided by every rank's slot tables.
// XLA's alternative, packing per-rank send buffers, moving them and expanding or reducing
// them with gathers, touches every row three or four times; here each row moves once.
#include "cpu/moe_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/moe_slots.h"
#include "core/registry.h"
#include "core/rendezvous.h"
#include "cpu/launch.h"
#include "cpu/moe_convert.h"
#include "cpu/moe_split.h"
#include "cpu/result_stores.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {
namespace {

// A transport call's operands as checked (CheckMoeOperands), with the host kernels'
// element types.
struct MoePlan : MoeOperandShape {
  int64_t mode = 0, R = 0;
  Real src = Real::kF32, out = Real::kF32, g = Real::kF32;
};

std::string CheckHostMoeOperands(int64_t mode, const ffi::AnyBuffer& src, const ffi::AnyBuffer& dest,
                                 const ffi::AnyBuffer& pos, const ffi::AnyBuffer& w, const ffi::AnyBuffer& g,
                                 const ffi::AnyBuffer& result, MoePlan* p) {
  if (std::string why = CheckMoeOperands(mode, src, dest, pos, w, g, result, p); !why.empty()) return why;
  // The copies move bytes; the float modes' types are float32, bfloat16 or float16 (FP8
  // codes for the dequantizing gathers' src).
  if (mode == kGatherCopy || mode == kGatherSparse) return "";
  AsReal(p->out_type, &p->out);
  AsReal(p->g_type, &p->g);
  if (!AsReal(p->src_type, &p->src)) p->src = Real::kE4M3;
  return "";
}

// Receiver r's incoming rows: f(source s, slot i, row) for every slot of every source
// whose destination is r, sources ascending, slots in (token, slot) order. `tables(s)`
// gives source s's (dest, pos) slot tables.
template <typename Tables, typename F>
void ForEachArrival(int r, int64_t R, int64_t slots, int64_t rows, Tables&& tables, F&& f) {
  for (int64_t s = 0; s < R; ++s) {
    const auto [dest, pos] = tables(static_cast<int>(s));
    for (int64_t i = 0; i < slots; ++i) {
      const int64_t row = pos[i];
      if (dest[i] != r || row < 0 || row >= rows) continue;
      f(static_cast<int>(s), i, row);
    }
  }
}

// Peer::aux: dest, pos, w, g.
std::pair<const int32_t*, const int32_t*> SlotTables(const Peer& p) {
  return {static_cast<const int32_t*>(p.aux[0]), static_cast<const int32_t*>(p.aux[1])};
}

void RunGather(const MoePlan& p, const std::vector<Peer>& peers, int r) {
  char* out = static_cast<char*>(peers[r].out);
  const bool zero = ZeroesUnwritten(p.mode);
  const bool dequant = p.mode == kGatherDequant || p.mode == kGatherDequantSparse;
  std::vector<char> written(zero ? static_cast<size_t>(p.rows) : 0, 0);
  // The copies move rows of any dtype, src's the result's.
  const int64_t in_row_bytes = p.mode == kGatherScaled || dequant ? p.H * RealBytes(p.src) : p.row_bytes;
  const int64_t nb = Fp8Blocks(p.H);
  // copy(destination row, source token row, slot weight, the token's FP8 scales)
  auto rows = [&](auto copy) {
    ForEachArrival(r, p.R, p.T * p.K, p.rows, [&](int s) { return SlotTables(peers[s]); },
                   [&](int s, int64_t i, int64_t row) {
                     if (zero) written[row] = 1;
                     const int64_t t = i / p.K;
                     const char* in = static_cast<const char*>(peers[s].in) + t * in_row_bytes;
                     copy(out + row * p.row_bytes, in, static_cast<const float*>(peers[s].aux[2])[i],
                          static_cast<const float*>(peers[s].aux[3]) + t * nb);
                   });
  };
  if (p.mode == kGatherScaled) {
    WithReal(p.src, [&](auto in) {
      WithReal(p.out, [&](auto o) {
        rows([&](char* dst, const char* src, float a, const float*) {
          ConvertRow<decltype(in), decltype(o)>(dst, src, a, p.H);
        });
      });
    });
  } else if (dequant) {
    WithReal(p.out, [&](auto o) {
      rows([&](char* dst, const char* src, float, const float* scales) {
        DequantizeRowE4M3<decltype(o)>(dst, reinterpret_cast<const uint8_t*>(src), scales, p.H);
      });
    });
  } else {
    rows([&](char* dst, const char* src, float, const float*) { std::memcpy(dst, src, p.row_bytes); });
  }
  if (!zero) return;
  for (int64_t row = 0; row < p.rows; ++row) {
    if (!written[row]) std::memset(out + row * p.row_bytes, 0, p.row_bytes);
  }
}

// One token's combine operands: its n slots' rows, weights, and which slots open a rank's
// group (a slot whose rank differs from the previous slot's), in StageSlotsByRank's order.
class CombineSlots {
 public:
  explicit CombineSlots(int64_t K)
      : d_(static_cast<size_t>(K)), row_(static_cast<size_t>(K)), a_(static_cast<size_t>(K)),
        x_(static_cast<size_t>(K)), opens_(new bool[static_cast<size_t>(std::max<int64_t>(K, 1))]) {}

  // Rank r's token t of plan p.
  void Stage(const MoePlan& p, const std::vector<Peer>& peers, int r, int64_t t) {
    const auto [dest, pos] = SlotTables(peers[r]);
    const float* w = static_cast<const float*>(peers[r].aux[2]);
    n_ = moe_slots::StageSlotsByRank(dest + t * p.K, pos + t * p.K, w + t * p.K, p.K, p.R, p.rows, d_.data(),
                                     row_.data(), a_.data());
    const int64_t row_bytes = p.H * RealBytes(p.src);
    for (int j = 0; j < n_; ++j) {
      x_[j] = static_cast<const char*>(peers[d_[j]].in) + row_[j] * row_bytes;
      opens_[j] = j == 0 || d_[j] != d_[j - 1];
    }
  }
  int n() const { return n_; }
  const void* const* rows() const { return x_.data(); }
  const float* weights() const { return a_.data(); }
  const bool* opens() const { return opens_.get(); }

 private:
  int n_ = 0;
  std::vector<int> d_, row_;
  std::vector<float> a_;
  std::vector<const void*> x_;
  std::unique_ptr<bool[]> opens_;
};

// Rank s: y[t] = sum over ranks d in order of (sum over slots k with dest_s[t, k] == d, in
// order, of w_s[t, k] * src_d[pos_s[t, k]]), in float32, stored in the result's type.
// Without contraction into fused multiply-adds (-ffp-contract=off) the sums round as the
// NumPy reference's and the CUDA kernel's.
void RunReduce(const MoePlan& p, const std::vector<Peer>& peers, int r) {
  const int64_t out_item = RealBytes(p.out);
  const bool f16c = HasF16c() && Registry::Get().cpu_f16c();
  // As the collectives' results (cpu/result_stores.h): large ones already in memory are
  // written past the caches.
  const bool stream = StreamsResult(peers[r].out, static_cast<size_t>(p.T * p.H * out_item));
  CombineSlots slots(p.K);
  WithReal(p.src, [&](auto in) {
    WithReal(p.out, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      // A token's float32 sums in column order, only where the result's type is not
      // written straight from the sums: whole rows, 28 KiB at H = 7168, in L1/L2.
      std::vector<float> y32(kStoresDirect<In, Out> ? 0 : static_cast<size_t>(p.H));
      for (int64_t t = 0; t < p.T; ++t) {
        slots.Stage(p, peers, r, t);
        char* out = static_cast<char*>(peers[r].out) + t * p.H * out_item;
        if (slots.n() == 0) {
          std::memset(out, 0, static_cast<size_t>(p.H * out_item));  // +0.0 in every type
          continue;
        }
        SumSlots<In, Out>(out, y32.data(), slots.rows(), slots.weights(), slots.opens(), slots.n(), p.H, f16c,
                          stream);
        if constexpr (!kStoresDirect<In, Out>) StoreRow<Out>(out, y32.data(), p.H);
      }
    });
  });
  if (stream) FenceStreamingStores();
}

// Rank s: out[t, k] = <g_s[t], src_d[pos_s[t, k]]> for d = dest_s[t, k], else 0.
void RunDot(const MoePlan& p, const std::vector<Peer>& peers, int r) {
  const auto [my_dest, my_pos] = SlotTables(peers[r]);
  float* out = static_cast<float*>(peers[r].out);
  const char* g = static_cast<const char*>(peers[r].aux[3]);
  const int64_t in_row_bytes = p.H * RealBytes(p.src), g_row_bytes = p.H * RealBytes(p.g);
  WithReal(p.src, [&](auto in) {
    WithReal(p.g, [&](auto gt) {
      for (int64_t i = 0; i < p.T * p.K; ++i) {
        const int64_t row = my_pos[i], d = my_dest[i];
        out[i] = 0.f;
        if (d < 0 || d >= p.R || row < 0 || row >= p.rows) continue;
        const char* x = static_cast<const char*>(peers[d].in) + row * in_row_bytes;
        out[i] = DotRow<decltype(gt), decltype(in)>(g + (i / p.K) * g_row_bytes, x, p.H);
      }
    });
  });
}

std::string RunMoe(const MoePlan& p, const std::vector<Peer>& peers, int r) {
  switch (p.mode) {
    case kGatherCopy:
    case kGatherScaled:
    case kGatherSparse:
    case kGatherDequant:
    case kGatherDequantSparse:
      RunGather(p, peers, r);
      return "";
    case kReduce:
      RunReduce(p, peers, r);
      return "";
    case kDot:
      RunDot(p, peers, r);
      return "";
    default:
      return "moe transport: unknown mode";
  }
}

ffi::Future Transport(const Common& c, ffi::AnyBuffer src, ffi::AnyBuffer dest, ffi::AnyBuffer pos,
                      ffi::AnyBuffer w, ffi::AnyBuffer g, ffi::AnyBuffer& result, int64_t group_size,
                      int64_t mode, void* split_table) {
  MoePlan p{};
  p.mode = mode;
  p.R = group_size;
  if (std::string why = CheckHostMoeOperands(mode, src, dest, pos, w, g, result, &p); !why.empty()) {
    return Reject(c, why);
  }
  const Peer mine = Buffers(src, result, {&dest, &pos, &w, &g});
  WorkFn work = [p](const std::vector<Peer>& peers, int part, int parts) -> std::string {
    std::string err;
    ForEachOwnedRank(peers, part, parts, [&](int r) {
      if (err.empty()) err = RunMoe(p, peers, r);
    });
    return err;
  };
  // Bytes the whole group touches: decides whether the work is split over the ranks'
  // threads (a dot-product call has a small result but reads T*K rows per rank).
  const size_t in_row = static_cast<size_t>(p.H * RealBytes(p.src));
  const size_t touched = static_cast<size_t>(p.R) *
                         (p.gather ? static_cast<size_t>(p.rows * p.row_bytes)
                                   : static_cast<size_t>(p.T * p.K) * in_row + result.size_bytes());
  if (split_table != nullptr) {
    OpenSend(split_table, result.untyped_data());
    return LaunchSend(c, mine, touched, std::move(work), split_table);
  }
  return Launch(c, mine, touched, std::move(work));
}

ffi::Future MoeTransport(InstructionState* st, ffi::RunId run, int32_t ordinal,
                         ffi::AnyBuffer src, ffi::AnyBuffer dest, ffi::AnyBuffer pos,
                         ffi::AnyBuffer w, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> result,
                         std::string_view call_site, std::string_view axis, int64_t timeout_ms,
                         ffi::Span<const int64_t>, int64_t group_size, ffi::Span<const int64_t>,
                         int64_t mode) {
  Common c{st, run, ordinal, "moe_transport", call_site, axis, timeout_ms};
  return Transport(c, src, dest, pos, w, g, *result, group_size, mode, nullptr);
}

// The send half of a split transport (combine_send): the result is written in the
// background; `status` is the table combine_recv waits on (moe_split.h).
ffi::Future MoeTransportSend(InstructionState* st, ffi::RunId run, int32_t ordinal,
                             ffi::AnyBuffer src, ffi::AnyBuffer dest, ffi::AnyBuffer pos,
                             ffi::AnyBuffer w, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> result,
                             ffi::Result<ffi::AnyBuffer> status, std::string_view call_site,
                             std::string_view axis, int64_t timeout_ms, ffi::Span<const int64_t>,
                             int64_t group_size, ffi::Span<const int64_t>, int64_t mode) {
  Common c{st, run, ordinal, "moe_transport_send", call_site, axis, timeout_ms};
  if (status->size_bytes() < static_cast<size_t>(kStatusWords) * 4) return Reject(c, "status block too small");
  return Transport(c, src, dest, pos, w, g, *result, group_size, mode, status->untyped_data());
}

}  // namespace

bool AsReal(ffi::DataType t, Real* r) {
  switch (t) {
    case ffi::DataType::F32:
      *r = Real::kF32;
      return true;
    case ffi::DataType::BF16:
      *r = Real::kBF16;
      return true;
    case ffi::DataType::F16:
      *r = Real::kF16;
      return true;
    default:
      return false;
  }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cpu_MoeTransport, MoeTransport,
                              BindCommon(ffi::Ffi::Bind(),
                                         [](auto b) { return BindBuffers<5>(std::move(b)); })
                                  JAXCOMM_BIND_ATTRS(moe_transport));

XLA_FFI_Handler* const kMoeTransport = jaxcomm_cpu_MoeTransport;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cpu_MoeTransportSend, MoeTransportSend,
                              BindCommon(ffi::Ffi::Bind(),
                                         [](auto b) {
                                           return BindBuffers<5>(std::move(b)).template Ret<ffi::AnyBuffer>();
                                         })
                                  JAXCOMM_BIND_ATTRS(moe_transport_send));

XLA_FFI_Handler* const kMoeTransportSend = jaxcomm_cpu_MoeTransportSend;

}  // namespace jaxcomm::cpu
