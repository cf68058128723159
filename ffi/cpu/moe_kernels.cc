// The host backend's MoE expert-parallel transports (jaxcomm/_src/moe/fused.py): dispatch and
// combine, and their gradients, each one collective in which every rank reads its peers'
// token or expert rows in place (one address space), guided by every rank's slot tables.
// XLA's alternative, packing per-rank send buffers, moving them and expanding or reducing
// them with gathers, touches every row three or four times; here each row moves once.
#include "cpu/moe_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/rendezvous.h"
#include "cpu/launch.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {
namespace {


struct MoePlan : MoeOperandShape {
  int64_t mode = 0, R = 0;
};

// Peer::aux: dest, pos, w, g.
std::string RunMoe(const MoePlan& p, const std::vector<Peer>& peers, int r) {
  const int32_t* my_dest = static_cast<const int32_t*>(peers[r].aux[0]);
  const int32_t* my_pos = static_cast<const int32_t*>(peers[r].aux[1]);
  const float* my_w = static_cast<const float*>(peers[r].aux[2]);
  if (p.mode == kGatherCopy || p.mode == kGatherScaled) {
    char* out = static_cast<char*>(peers[r].out);
    std::vector<char> written(static_cast<size_t>(p.rows), 0);
    for (int64_t s = 0; s < p.R; ++s) {
      const int32_t* dest = static_cast<const int32_t*>(peers[s].aux[0]);
      const int32_t* pos = static_cast<const int32_t*>(peers[s].aux[1]);
      const float* w = static_cast<const float*>(peers[s].aux[2]);
      const char* src = static_cast<const char*>(peers[s].in);
      for (int64_t i = 0; i < p.T * p.K; ++i) {
        const int64_t row = pos[i];
        if (dest[i] != r || row < 0 || row >= p.rows) continue;
        written[row] = 1;
        const char* in = src + (i / p.K) * p.row_bytes;
        if (p.mode == kGatherCopy) {
          std::memcpy(out + row * p.row_bytes, in, p.row_bytes);
        } else {
          float* o = reinterpret_cast<float*>(out + row * p.row_bytes);
          const float* x = reinterpret_cast<const float*>(in);
          const float a = w[i];
          for (int64_t h = 0; h < p.H; ++h) o[h] = a * x[h];
        }
      }
    }
    for (int64_t row = 0; row < p.rows; ++row) {
      if (!written[row]) std::memset(out + row * p.row_bytes, 0, p.row_bytes);
    }
    return "";
  }
  if (p.mode == kReduce) {
    float* out = static_cast<float*>(peers[r].out);
    std::vector<float> part(static_cast<size_t>(p.H));
    for (int64_t t = 0; t < p.T; ++t) {
      float* y = out + t * p.H;
      bool y_set = false;
      for (int64_t d = 0; d < p.R; ++d) {
        const float* src = static_cast<const float*>(peers[d].in);
        bool part_set = false;
        for (int64_t k = 0; k < p.K; ++k) {
          const int64_t i = t * p.K + k, row = my_pos[i];
          if (my_dest[i] != d || row < 0 || row >= p.rows) continue;
          const float a = my_w[i];
          const float* x = src + row * p.H;
          if (!part_set) {
            for (int64_t h = 0; h < p.H; ++h) part[h] = a * x[h];
            part_set = true;
          } else {
            for (int64_t h = 0; h < p.H; ++h) part[h] += a * x[h];
          }
        }
        if (!part_set) continue;
        if (!y_set) {
          std::memcpy(y, part.data(), sizeof(float) * p.H);
          y_set = true;
        } else {
          for (int64_t h = 0; h < p.H; ++h) y[h] += part[h];
        }
      }
      if (!y_set) std::memset(y, 0, sizeof(float) * p.H);
    }
    return "";
  }
  if (p.mode == kDot) {
    float* out = static_cast<float*>(peers[r].out);
    const float* g = static_cast<const float*>(peers[r].aux[3]);
    for (int64_t i = 0; i < p.T * p.K; ++i) {
      const int64_t row = my_pos[i], d = my_dest[i];
      out[i] = 0.f;
      if (d < 0 || d >= p.R || row < 0 || row >= p.rows) continue;
      const float* x = static_cast<const float*>(peers[d].in) + row * p.H;
      const float* gt = g + (i / p.K) * p.H;
      // Eight independent partial sums: a single accumulator is a serial dependency chain
      // the compiler may not vectorise (it would reorder float additions).
      float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int64_t h = 0;
      for (; h + 8 <= p.H; h += 8) {
        for (int l = 0; l < 8; ++l) lane[l] += gt[h + l] * x[h + l];
      }
      float acc = 0.f;
      for (; h < p.H; ++h) acc += gt[h] * x[h];
      for (int l = 0; l < 8; ++l) acc += lane[l];
      out[i] = acc;
    }
    return "";
  }
  return "moe transport: unknown mode";
}

ffi::Future MoeTransport(InstructionState* st, ffi::RunId run, int32_t ordinal,
                         ffi::AnyBuffer src, ffi::AnyBuffer dest, ffi::AnyBuffer pos,
                         ffi::AnyBuffer w, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> result,
                         std::string_view call_site, std::string_view axis, int64_t timeout_ms,
                         ffi::Span<const int64_t>, int64_t group_size, ffi::Span<const int64_t>,
                         int64_t mode) {
  Common c{st, run, ordinal, "moe_transport", call_site, axis, timeout_ms};
  MoePlan p{};
  p.mode = mode;
  p.R = group_size;
  if (std::string why = CheckMoeOperands(mode, src, dest, pos, w, g, *result, &p); !why.empty()) {
    return Reject(c, why);
  }
  const bool gather = p.gather;
  const Peer mine = Buffers(src, *result, {&dest, &pos, &w, &g});
  const WorkFn work = [p](const std::vector<Peer>& peers, int part, int parts) -> std::string {
    std::string err;
    ForEachOwnedRank(peers, part, parts, [&](int r) {
      if (err.empty()) err = RunMoe(p, peers, r);
    });
    return err;
  };
  // Bytes the whole group touches: decides whether the work is split over the ranks' threads
  // (a dot-product call has a small result but reads T*K rows per rank).
  const size_t touched = static_cast<size_t>(p.R) *
                         (gather ? static_cast<size_t>(p.rows * p.row_bytes)
                                 : static_cast<size_t>(p.T * p.K * p.H) * 4 + result->size_bytes());
  return Launch(c, mine, touched, std::move(work));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cpu_MoeTransport, MoeTransport,
                              BindCommon(ffi::Ffi::Bind(),
                                         [](auto b) { return BindBuffers<5>(std::move(b)); })
                                  JAXCOMM_BIND_ATTRS(moe_transport));

XLA_FFI_Handler* const kMoeTransport = jaxcomm_cpu_MoeTransport;

}  // namespace jaxcomm::cpu
