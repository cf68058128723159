#include "cuda/logic_host.h"

#include <cstring>

#include "core/moe_modes.h"

namespace jaxcomm::cuda::logic {

Routing RouteOnHost(const std::vector<int32_t>& ids, int64_t R, int64_t T, int64_t K, int64_t E,
                    int64_t rows, bool padded) {
  const int64_t El = E / R, TK = T * K;
  Routing out;
  out.dest.assign(R * TK, -1);
  out.pos.assign(R * TK, -1);
  out.sizes.assign(R * El, 0);
  out.stats.assign(R * 3, 0);
  // RankKernel: each assignment's rank among its rank's assignments to the same expert.
  std::vector<int64_t> counts(R * E, 0), local_rank(R * TK, -1);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < TK; ++i) {
      const int64_t v = ids[r * TK + i];
      if (IsExpert(v, E)) {
        local_rank[r * TK + i] = counts[r * E + v]++;
      } else if (IsInvalidId(v, E)) {
        ++out.stats[r * 3 + 1];
      }
    }
  }
  // PlanKernel.
  std::vector<int64_t> before(R * E), total(E), start(E);
  for (int64_t e = 0; e < E; ++e) {
    int64_t run = 0;
    for (int64_t r = 0; r < R; ++r) {
      before[r * E + e] = run;
      run += counts[r * E + e];
    }
    total[e] = run;
  }
  for (int64_t e = 0; e < E; ++e) start[e] = ExpertStart(total, e, El);
  for (int64_t d = 0; d < R; ++d) {
    int64_t arrived = 0, kept = 0;
    for (int64_t el = 0; el < El; ++el) {
      const int64_t e = d * El + el;
      const int64_t size = KeptRows(padded, total[e], start[e], rows, El);
      out.sizes[d * El + el] = static_cast<int32_t>(size);
      arrived += total[e];
      kept += size;
    }
    out.stats[d * 3 + 2] = static_cast<int32_t>(arrived - kept);
  }
  // PositionKernel.
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < TK; ++i) {
      const int64_t v = ids[r * TK + i];
      if (!IsExpert(v, E)) continue;
      const Place p = PlaceAssignment(v, E, El, local_rank[r * TK + i], before[r * E + v], start[v], rows, padded);
      out.dest[r * TK + i] = p.dest;
      out.pos[r * TK + i] = p.row;
      if (p.dropped) ++out.stats[r * 3];
    }
  }
  return out;
}

namespace {

// f(tag) with the element tag of `t` (core/number_formats.h).
template <typename F>
void WithHostFloat(HostFloat t, F&& f) {
  switch (t) {
    case HostFloat::kBF16: f(BF16T{}); return;
    case HostFloat::kF16: f(F16T{}); return;
    default: f(F32T{}); return;
  }
}

template <typename Tag>
const typename Tag::Storage* Elems(const std::string& bytes) {
  return reinterpret_cast<const typename Tag::Storage*>(bytes.data());
}

}  // namespace

std::vector<std::string> MoeOnHost(int mode, int64_t T, int64_t K, int64_t H, int64_t rows,
                                   int64_t row_bytes, const std::vector<std::string>& src,
                                   const std::vector<std::vector<int32_t>>& dest,
                                   const std::vector<std::vector<int32_t>>& pos,
                                   const std::vector<std::vector<float>>& w,
                                   const std::vector<std::vector<float>>& g,
                                   HostFloat src_type, HostFloat out_type) {
  const int64_t R = static_cast<int64_t>(src.size());
  std::vector<std::string> out(R);
  std::vector<int> sd(K), srow(K);
  std::vector<float> sw(K);
  const bool gather = mode != kReduce && mode != kDot;
  for (int64_t me = 0; me < R; ++me) {
    if (gather) {  // GatherKernel (self = me), then ZeroUnwrittenKernel where the mode zeroes
      std::string& o = out[me];
      o.assign(rows * row_bytes, ZeroesUnwritten(mode) ? '\0' : '\x7f');
      std::vector<char> written(rows, 0);
      WithHostFloat(src_type, [&](auto in) {
        WithHostFloat(out_type, [&](auto ot) {
          using In = decltype(in);
          using Out = decltype(ot);
          auto* y = reinterpret_cast<typename Out::Storage*>(&o[0]);
          for (int64_t s = 0; s < R; ++s) {
            for (int64_t t = 0; t < T; ++t) {
              const int n = StageSlots(&dest[s][t * K], &pos[s][t * K], &w[s][t * K], K, R, rows, me,
                                       sd.data(), srow.data(), sw.data());
              for (int j = 0; j < n; ++j) {
                written[srow[j]] = 1;
                for (int64_t h = 0; h < H && mode == kGatherScaled; ++h) {
                  y[srow[j] * H + h] = Out::Store(MulRn(sw[j], In::Load(Elems<In>(src[s])[t * H + h])));
                }
                for (int64_t h = 0; h < H && (mode == kGatherDequant || mode == kGatherDequantSparse); ++h) {
                  const auto code = static_cast<uint8_t>(src[s][t * H + h]);
                  y[srow[j] * H + h] = Out::Store(Fp8Decode(code, g[s][t * Fp8Blocks(H) + h / kFp8Block]));
                }
                if (mode == kGatherCopy || mode == kGatherSparse) {
                  std::memcpy(&o[srow[j] * row_bytes], &src[s][t * row_bytes], row_bytes);
                }
              }
            }
          }
        });
      });
      if (!ZeroesUnwritten(mode)) continue;
      for (int64_t row = 0; row < rows; ++row) {
        if (!written[row]) std::memset(&o[row * row_bytes], 0, row_bytes);
      }
    } else if (mode == kReduce) {  // ReduceKernel: slots by rank, each rank's in k order
      WithHostFloat(src_type, [&](auto in) {
        WithHostFloat(out_type, [&](auto ot) {
          using In = decltype(in);
          using Out = decltype(ot);
          std::vector<typename Out::Storage> y(T * H);
          for (int64_t t = 0; t < T; ++t) {
            const int n = StageSlotsByRank(&dest[me][t * K], &pos[me][t * K], &w[me][t * K], K, R, rows,
                                           sd.data(), srow.data(), sw.data());
            for (int64_t h = 0; h < H; ++h) {
              float acc = 0.f, p = 0.f;
              bool acc_set = false, part_set = false;
              int cur = -1;
              for (int j = 0; j < n; ++j) {
                if (sd[j] != cur) {
                  if (part_set) {
                    acc = acc_set ? AddRn(acc, p) : p;
                    acc_set = true;
                    part_set = false;
                  }
                  cur = sd[j];
                }
                const float prod = MulRn(sw[j], In::Load(Elems<In>(src[sd[j]])[srow[j] * H + h]));
                p = part_set ? AddRn(p, prod) : prod;
                part_set = true;
              }
              if (part_set) acc = acc_set ? AddRn(acc, p) : p;
              y[t * H + h] = Out::Store(acc);
            }
          }
          out[me].assign(reinterpret_cast<const char*>(y.data()), y.size() * sizeof(y[0]));
        });
      });
    } else if (mode == kDot) {  // DotKernel (summation order differs: compare with a tolerance)
      WithHostFloat(src_type, [&](auto in) {
        using In = decltype(in);
        std::vector<float> y(T * K, 0.f);
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t k = 0; k < K; ++k) {
            const int64_t d = dest[me][t * K + k], row = pos[me][t * K + k];
            if (!SlotOk(d, row, R, rows)) continue;
            float acc = 0.f;
            for (int64_t h = 0; h < H; ++h) acc += g[me][t * H + h] * In::Load(Elems<In>(src[d])[row * H + h]);
            y[t * K + k] = acc;
          }
        }
        out[me].assign(reinterpret_cast<const char*>(y.data()), y.size() * sizeof(float));
      });
    }
  }
  return out;
}

std::pair<std::string, std::vector<float>> Fp8QuantizeOnHost(const std::string& x, HostFloat type,
                                                             int64_t T, int64_t H) {
  const int64_t nb = Fp8Blocks(H);
  std::string q(T * H, '\0');
  std::vector<float> scales(T * nb);
  WithHostFloat(type, [&](auto tag) {
    using In = decltype(tag);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t b = 0; b < nb; ++b) {  // one warp
        const int64_t h0 = b * kFp8Block, n = H - h0 < kFp8Block ? H - h0 : kFp8Block;
        float v[32][kFp8PerLane];
        uint32_t amax[32];
        for (int lane = 0; lane < 32; ++lane) amax[lane] = Fp8LoadLane<In>(Elems<In>(x) + t * H + h0, n, lane, v[lane]);
        for (int o = 16; o > 0; o >>= 1) {  // the butterfly of __shfl_xor_sync
          uint32_t next[32];
          for (int lane = 0; lane < 32; ++lane) next[lane] = amax[lane ^ o] > amax[lane] ? amax[lane ^ o] : amax[lane];
          std::memcpy(amax, next, sizeof(amax));
        }
        for (int lane = 0; lane < 32; ++lane) {
          const Fp8BlockScale sc = Fp8ScaleOf(amax[lane]);
          Fp8StoreLane(v[lane], n, lane, sc.multiplier, reinterpret_cast<uint8_t*>(&q[t * H + h0]));
          if (lane == 0) scales[t * nb + b] = sc.scale;
        }
      }
    }
  });
  return {q, scales};
}

std::vector<float> RaggedOnHost(int mode, const std::vector<float>& operand, const std::vector<float>& output,
                                int64_t row_elems, int64_t src_rows, int64_t dst_rows,
                                const std::vector<int64_t>& input_offsets, const std::vector<int64_t>& send_sizes,
                                const std::vector<int64_t>& output_offsets, const std::vector<int64_t>& recv_sizes) {
  std::vector<float> result = output;
  const int64_t n = static_cast<int64_t>(send_sizes.size());
  const IndexView io{input_offsets.data(), 8}, ss{send_sizes.data(), 8}, oo{output_offsets.data(), 8};
  for (int64_t i = 0; i < n; ++i) {  // CallValid
    if (!SliceValid(input_offsets[i], send_sizes[i], output_offsets[i], recv_sizes[i], src_rows, dst_rows)) {
      return result;
    }
  }
  const auto mode_ = static_cast<RaggedMode>(mode);
  if (mode_ == RaggedMode::kForward || mode_ == RaggedMode::kZeroReceived) {  // RaggedForwardKernel
    for (int64_t j = 0; j < dst_rows; ++j) {
      const int64_t i = LastCover(ss, oo, n, j);
      if (i < 0) continue;
      for (int64_t e = 0; e < row_elems; ++e) {
        result[j * row_elems + e] = mode_ == RaggedMode::kZeroReceived ? 0.f : operand[SourceRow(io, oo, i, j) * row_elems + e];
      }
    }
    return result;
  }
  for (int64_t r = 0; r < src_rows; ++r) {  // RaggedTransposeKernel: operand is the cotangent
    for (int64_t i = 0; i < n; ++i) {
      if (ss[i] <= 0 || r < io[i] || r >= io[i] + ss[i]) continue;
      const int64_t j = oo[i] + r - io[i];
      if (LastCover(ss, oo, n, j) != i) continue;
      for (int64_t e = 0; e < row_elems; ++e) result[r * row_elems + e] += operand[j * row_elems + e];
    }
  }
  return result;
}

std::vector<Copy2D> BlockCopies(const std::vector<int64_t>& dims, int64_t axis, int64_t R, int64_t item,
                                bool to_block, int64_t block_stride, int64_t max_pitch) {
  const Split s = SplitAlong(dims.data(), dims.size(), static_cast<size_t>(axis), static_cast<size_t>(R),
                             static_cast<size_t>(item));
  std::vector<Copy2D> out;
  for (int64_t d = 0; d < R; ++d) {
    PlanCopy(BlockCopy(s, R, d, d * block_stride, to_block), static_cast<size_t>(max_pitch),
             [&](const Copy2D& c) { out.push_back(c); });
  }
  return out;
}

}  // namespace jaxcomm::cuda::logic
