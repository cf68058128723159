// See kernels.h. Float arithmetic that must match the host backend bit for bit uses the
// _rn intrinsics: nvcc would otherwise contract a*x + y into an FMA, which rounds once
// where the host code rounds twice.
#include "cuda/kernels.h"

#include "cuda/kernel_logic.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace jaxcomm::cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxK = kMaxSlots;

// ------------------------------------------------------------------------------ routing

struct RoutingWork {
  int32_t* local_rank;  // [R, T*K]
  int32_t* counts;      // [R, E]
  int32_t* before;      // [R, E]: assignments to expert e from ranks below r
  int32_t* start;       // [E]: packed layout, first row of expert e at its rank
  int32_t* total;       // [E]
  int32_t* invalid;     // [R]
};

RoutingWork Carve(void* work, int R, int64_t TK, int64_t E) {
  int32_t* p = static_cast<int32_t*>(work);
  RoutingWork w;
  w.local_rank = p; p += R * TK;
  w.counts = p; p += R * E;
  w.before = p; p += R * E;
  w.start = p; p += E;
  w.total = p; p += E;
  w.invalid = p;
  return w;
}

// One block per rank: each assignment's rank among the rank's assignments to the same
// expert, in (t, k) order, and the per-expert counts. Warps of a chunk take turns so that
// the order across warps is kept; inside a warp, lanes with equal experts rank by lane.
__global__ void RankKernel(const int32_t* ids, int64_t TK, int E, RoutingWork w) {
  extern __shared__ int cnt[];
  __shared__ int invalid;
  const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = blockDim.x >> 5;
  for (int e = tid; e < E; e += blockDim.x) cnt[e] = 0;
  if (tid == 0) invalid = 0;
  __syncthreads();
  const int32_t* my = ids + r * TK;
  const unsigned lt = (1u << lane) - 1u;
  for (int64_t base = 0; base < TK; base += blockDim.x) {
    const int64_t i = base + tid;
    const bool in = i < TK;
    int e = E;
    if (in) {
      const int v = my[i];
      if (logic::IsExpert(v, E)) {
        e = v;
      } else if (logic::IsInvalidId(v, E)) {
        atomicAdd(&invalid, 1);
      }
    }
    const unsigned same = __match_any_sync(kFull, e);
    const int mine = __popc(same & lt);
    int rank = -1;
    for (int turn = 0; turn < nwarps; ++turn) {
      if (warp == turn && e < E) rank = cnt[e] + mine;
      __syncwarp();
      // The highest lane of each group of equal experts advances the count.
      if (warp == turn && e < E && (same >> lane) == 1u) cnt[e] += __popc(same);
      __syncthreads();
    }
    if (in) w.local_rank[r * TK + i] = rank;
  }
  for (int e = tid; e < E; e += blockDim.x) w.counts[r * E + e] = cnt[e];
  if (tid == 0) w.invalid[r] = invalid;
}

// Totals, prefix counts over source ranks, packed start rows and each rank's sizes.
__global__ void PlanKernel(int R, int E, int64_t rows, bool padded, RoutingWork w,
                           int32_t* sizes, int32_t* stats) {
  const int El = E / R;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int run = 0;
    for (int r = 0; r < R; ++r) {
      w.before[r * E + e] = run;
      run += w.counts[r * E + e];
    }
    w.total[e] = run;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    w.start[e] = static_cast<int32_t>(logic::ExpertStart(w.total, e, El));
  }
  __syncthreads();
  for (int d = threadIdx.x; d < R; d += blockDim.x) {
    int64_t arrived = 0, kept = 0;
    for (int el = 0; el < El; ++el) {
      const int e = d * El + el;
      const int64_t mine = w.total[e];
      const int64_t size = logic::KeptRows(padded, mine, w.start[e], rows, El);
      sizes[d * El + el] = static_cast<int32_t>(size);
      arrived += mine;
      kept += size;
    }
    stats[d * 3 + 1] = w.invalid[d];
    stats[d * 3 + 2] = static_cast<int32_t>(arrived - kept);
  }
}

__global__ void PositionKernel(const int32_t* ids, int R, int64_t TK, int E, int64_t rows,
                               bool padded, RoutingWork w, int32_t* dest, int32_t* pos,
                               int32_t* stats) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= R * TK) return;
  const int r = static_cast<int>(idx / TK);
  const int El = E / R;
  const int v = ids[idx];
  int d = -1, p = -1;
  if (logic::IsExpert(v, E)) {
    const logic::Place place = logic::PlaceAssignment(v, E, El, w.local_rank[idx], w.before[r * E + v],
                                                      w.start[v], rows, padded);
    d = place.dest;
    p = place.row;
    if (place.dropped) atomicAdd(&stats[r * 3 + 0], 1);
  }
  dest[idx] = d;
  pos[idx] = p;
}

// ---------------------------------------------------------------------------- MoE moves

// A token's slots that go somewhere, staged in shared memory.
struct Slots {
  int n;
  int d[kMaxK];
  int row[kMaxK];
  float a[kMaxK];
  // The raw slot table of the token, loaded by K threads at once (one global load each
  // instead of a chain of K dependent loads by one thread).
  int32_t raw_d[kMaxK];
  int32_t raw_row[kMaxK];
  float raw_a[kMaxK];
};

__device__ void LoadSlots(const MoePeers& p, const MoeShape& s, int src, int64_t t, Slots* sl) {
  const int k = threadIdx.x;
  if (k < s.K) {
    sl->raw_d[k] = p.dest[src][t * s.K + k];
    sl->raw_row[k] = p.pos[src][t * s.K + k];
    sl->raw_a[k] = p.w[src] != nullptr ? p.w[src][t * s.K + k] : 0.f;
  }
  __syncthreads();
}

// The slots of rank `src`'s token t that go to a rank (only to `s.self` when set), in k
// order (logic::StageSlots).
__device__ void StageSlots(const MoePeers& p, const MoeShape& s, int src, int64_t t, Slots* sl) {
  LoadSlots(p, s, src, t, sl);
  if (threadIdx.x == 0) {
    sl->n = logic::StageSlots(sl->raw_d, sl->raw_row, sl->raw_a, s.K, p.R, s.rows, s.self, sl->d,
                              sl->row, sl->a);
  }
  __syncthreads();
}

// Rank s's token t goes into every destination row of its slots: read once, written to
// each row (a scatter, so that x is read once per token, not once per expert row). In and
// Out are core/number_formats.h's element tags (kGatherScaled: src's and the result's;
// the dequantizing gathers: the result's).
template <int kMode, typename In, typename Out>
__global__ void GatherKernel(MoePeers p, MoeShape s) {
  __shared__ Slots sl;
  const int src = blockIdx.y;
  const int64_t t = blockIdx.x;
  StageSlots(p, s, src, t, &sl);
  constexpr bool kZero = ZeroesUnwritten(kMode);
  if (kZero && threadIdx.x == 0) {
    for (int j = 0; j < sl.n; ++j) p.written[sl.d[j]][sl.row[j]] = 1;
  }
  if constexpr (kMode == kGatherCopy || kMode == kGatherSparse) {
    const char* in = static_cast<const char*>(p.src[src]) + t * s.row_bytes;
    if (s.row_bytes % 16 == 0) {
      const int64_t nv = s.row_bytes / 16;
      for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
        const uint4 val = reinterpret_cast<const uint4*>(in)[v];
        for (int j = 0; j < sl.n; ++j) {
          char* out = static_cast<char*>(p.out[sl.d[j]]) + sl.row[j] * s.row_bytes;
          reinterpret_cast<uint4*>(out)[v] = val;
        }
      }
    } else {
      for (int64_t b = threadIdx.x; b < s.row_bytes; b += blockDim.x) {
        const char val = in[b];
        for (int j = 0; j < sl.n; ++j) {
          static_cast<char*>(p.out[sl.d[j]])[sl.row[j] * s.row_bytes + b] = val;
        }
      }
    }
  } else if constexpr (kMode == kGatherScaled) {
    const auto* in = static_cast<const typename In::Storage*>(p.src[src]) + t * s.H;
    for (int64_t h = threadIdx.x; h < s.H; h += blockDim.x) {
      const float x = In::Load(in[h]);
      for (int j = 0; j < sl.n; ++j) {
        static_cast<typename Out::Storage*>(p.out[sl.d[j]])[sl.row[j] * s.H + h] = Out::Store(MulRn(sl.a[j], x));
      }
    }
  } else {  // kGatherDequant, kGatherDequantSparse: the FP8 codes times their block scales
    const uint8_t* in = static_cast<const uint8_t*>(p.src[src]) + t * s.H;
    const float* scales = static_cast<const float*>(p.g[src]) + t * Fp8Blocks(s.H);
    for (int64_t h = threadIdx.x; h < s.H; h += blockDim.x) {
      const auto v = Out::Store(Fp8Decode(in[h], scales[h / kFp8Block]));
      for (int j = 0; j < sl.n; ++j) {
        static_cast<typename Out::Storage*>(p.out[sl.d[j]])[sl.row[j] * s.H + h] = v;
      }
    }
  }
}

// Rows no slot wrote are zero (as the host backend's).
__global__ void ZeroUnwrittenKernel(MoePeers p, MoeShape s) {
  const int d = s.self >= 0 ? s.self : blockIdx.y;
  for (int64_t row = blockIdx.x; row < s.rows; row += gridDim.x) {
    if (p.written[d][row]) continue;
    char* out = static_cast<char*>(p.out[d]) + row * s.row_bytes;
    if (s.row_bytes % 16 == 0) {
      for (int64_t v = threadIdx.x; v < s.row_bytes / 16; v += blockDim.x) {
        reinterpret_cast<uint4*>(out)[v] = make_uint4(0, 0, 0, 0);
      }
    } else {
      for (int64_t b = threadIdx.x; b < s.row_bytes; b += blockDim.x) out[b] = 0;
    }
  }
}

// Combine: y_s[t] = sum over ranks d in order of (sum over slots k with dest d, in k
// order, of w[t, k] * src_d[pos[t, k]]), in float32, each product and sum rounded as the
// host's, then stored in Out's type. Slots are staged sorted by (d, k); every thread owns
// kV consecutive columns (loaded as one 16-byte vector when kV elements fill one).
template <typename In, typename Out, int kV>
__global__ void ReduceKernel(MoePeers p, MoeShape s) {
  using X = typename In::Storage;
  __shared__ Slots sl;
  const int src = s.self >= 0 ? s.self : blockIdx.y;
  const int64_t t = blockIdx.x;
  LoadSlots(p, s, src, t, &sl);
  if (threadIdx.x == 0) {
    sl.n = logic::StageSlotsByRank(sl.raw_d, sl.raw_row, sl.raw_a, s.K, p.R, s.rows, sl.d, sl.row, sl.a);
  }
  __syncthreads();
  auto* out = static_cast<typename Out::Storage*>(p.out[src]) + t * s.H;
  for (int64_t h0 = threadIdx.x * static_cast<int64_t>(kV); h0 < s.H; h0 += blockDim.x * static_cast<int64_t>(kV)) {
    float y[kV], part[kV];
    bool y_set = false, part_set = false;
    int cur = -1;
    for (int j = 0; j < sl.n; ++j) {
      if (sl.d[j] != cur) {
        if (part_set) {
          for (int v = 0; v < kV; ++v) y[v] = y_set ? AddRn(y[v], part[v]) : part[v];
          y_set = true;
          part_set = false;
        }
        cur = sl.d[j];
      }
      const X* row = static_cast<const X*>(p.src[sl.d[j]]) + sl.row[j] * s.H + h0;
      X x[kV];
      if constexpr (kV * sizeof(X) == 16) {
        *reinterpret_cast<uint4*>(x) = *reinterpret_cast<const uint4*>(row);
      } else {
        for (int v = 0; v < kV; ++v) x[v] = row[v];
      }
      const float a = sl.a[j];
      for (int v = 0; v < kV; ++v) {
        const float prod = MulRn(a, In::Load(x[v]));
        part[v] = part_set ? AddRn(part[v], prod) : prod;
      }
      part_set = true;
    }
    if (part_set) {
      for (int v = 0; v < kV; ++v) y[v] = y_set ? AddRn(y[v], part[v]) : part[v];
      y_set = true;
    }
    // Stored as one vector of kV results (8, 16 or 32 bytes) where kV elements were loaded
    // as one: the columns are then aligned alike.
    using Y = typename Out::Storage;
    constexpr int kBytes = kV * static_cast<int>(sizeof(Y));
    alignas(16) Y o[kV];
    for (int v = 0; v < kV; ++v) o[v] = Out::Store(y_set ? y[v] : 0.f);
    if constexpr (kV * sizeof(X) == 16 && kBytes % 16 == 0) {
      for (int c = 0; c < kBytes / 16; ++c) reinterpret_cast<uint4*>(out + h0)[c] = reinterpret_cast<const uint4*>(o)[c];
    } else if constexpr (kV * sizeof(X) == 16 && kBytes == 8) {
      *reinterpret_cast<uint2*>(out + h0) = *reinterpret_cast<const uint2*>(o);
    } else {
      for (int v = 0; v < kV; ++v) out[h0 + v] = o[v];
    }
  }
}

// Combine's gradient towards the weights: out_s[t, k] = <g_s[t], src_d[pos]> in float32
// (X: src's element tag, G: g's).
template <typename X, typename G>
__global__ void DotKernel(MoePeers p, MoeShape s) {
  __shared__ float partial[32];
  const int src = s.self >= 0 ? s.self : blockIdx.y;
  const int64_t t = blockIdx.x;
  const auto* g = static_cast<const typename G::Storage*>(p.g[src]) + t * s.H;
  float* out = static_cast<float*>(p.out[src]) + t * s.K;
  for (int k = 0; k < s.K; ++k) {
    const int d = p.dest[src][t * s.K + k], row = p.pos[src][t * s.K + k];
    const bool ok = logic::SlotOk(d, row, p.R, s.rows);
    float acc = 0.f;
    if (ok) {
      const auto* x = static_cast<const typename X::Storage*>(p.src[d]) + row * s.H;
      for (int64_t h = threadIdx.x; h < s.H; h += blockDim.x) acc += G::Load(g[h]) * X::Load(x[h]);
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(kFull, acc, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = 0.f;
      for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) sum += partial[w];
      out[k] = ok ? sum : 0.f;
    }
    __syncthreads();
  }
}

// ------------------------------------------------------------------------------- FP8

// One warp per (token, 128-channel block), grid-strided (logic::Fp8LoadLane).
template <typename In>
__global__ void Fp8QuantizeKernel(const typename In::Storage* x, int64_t T, int64_t H, uint8_t* q,
                                  float* scales) {
  const int lane = threadIdx.x & 31;
  const int64_t nb = Fp8Blocks(H), jobs = T * nb;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  // `job` is the same on every lane of a warp: the shuffles below see all 32 lanes.
  for (int64_t job = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; job < jobs;
       job += warps) {
    const int64_t t = job / nb, b = job % nb, h0 = b * kFp8Block;
    const int64_t n = H - h0 < kFp8Block ? H - h0 : kFp8Block;
    float v[logic::kFp8PerLane];
    uint32_t amax = logic::Fp8LoadLane<In>(x + t * H + h0, n, lane, v);
    for (int o = 16; o > 0; o >>= 1) {
      const uint32_t other = __shfl_xor_sync(kFull, amax, o);
      amax = other > amax ? other : amax;
    }
    const Fp8BlockScale sc = Fp8ScaleOf(amax);
    logic::Fp8StoreLane(v, n, lane, sc.multiplier, q + t * H + h0);
    if (lane == 0) scales[t * nb + b] = sc.scale;
  }
}

// ------------------------------------------------------------------------------- ragged

struct RaggedArgs {
  logic::IndexView io, ss, oo, rs;
  int64_t n, src_rows, dst_rows, row_bytes, row_elems;
};

// Whether every slice of the call is in bounds; computed by the whole block.
__device__ bool CallValid(const RaggedArgs& a) {
  bool ok = true;
  for (int64_t i = threadIdx.x; i < a.n; i += blockDim.x) {
    ok = ok && logic::SliceValid(a.io[i], a.ss[i], a.oo[i], a.rs[i], a.src_rows, a.dst_rows);
  }
  return __syncthreads_and(ok) != 0;
}

__global__ void RaggedForwardKernel(RaggedArgs a, const char* operand, char* result, bool zero) {
  if (!CallValid(a)) return;
  for (int64_t j = blockIdx.x; j < a.dst_rows; j += gridDim.x) {
    const int64_t i = logic::LastCover(a.ss, a.oo, a.n, j);
    if (i < 0) continue;
    char* out = result + j * a.row_bytes;
    if (zero) {
      for (int64_t b = threadIdx.x; b < a.row_bytes; b += blockDim.x) out[b] = 0;
      continue;
    }
    const char* in = operand + logic::SourceRow(a.io, a.oo, i, j) * a.row_bytes;
    for (int64_t b = threadIdx.x; b < a.row_bytes; b += blockDim.x) out[b] = in[b];
  }
}

template <typename T>
__device__ void AddRow(T* out, const T* in, int64_t n) {
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) out[e] = out[e] + in[e];
}
__device__ void AddRow(__half* out, const __half* in, int64_t n) {
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    out[e] = __float2half_rn(__fadd_rn(__half2float(out[e]), __half2float(in[e])));
  }
}
__device__ void AddRow(__nv_bfloat16* out, const __nv_bfloat16* in, int64_t n) {
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    out[e] = __float2bfloat16_rn(__fadd_rn(__bfloat162float(out[e]), __bfloat162float(in[e])));
  }
}
__device__ void AddRow(float* out, const float* in, int64_t n) {
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) out[e] = __fadd_rn(out[e], in[e]);
}
__device__ void AddRow(double* out, const double* in, int64_t n) {
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) out[e] = __dadd_rn(out[e], in[e]);
}

// Transpose towards the operand (one rank): every operand row adds the cotangent rows it
// is still visible in, slice by slice in order.
template <typename T>
__global__ void RaggedTransposeKernel(RaggedArgs a, const T* cot, T* acc) {
  if (!CallValid(a)) return;
  for (int64_t r = blockIdx.x; r < a.src_rows; r += gridDim.x) {
    for (int64_t i = 0; i < a.n; ++i) {
      const int64_t io = a.io[i], ss = a.ss[i];
      if (ss <= 0 || r < io || r >= io + ss) continue;
      const int64_t j = a.oo[i] + r - io;
      if (logic::LastCover(a.ss, a.oo, a.n, j) != i) continue;
      AddRow(acc + r * a.row_elems, cot + j * a.row_elems, a.row_elems);
      __syncthreads();
    }
  }
}

// ------------------------------------------------------------------------ peer reduce

template <typename T>
struct Acc {
  using Type = T;
  __device__ static T Load(const T& x) { return x; }
  __device__ static T Store(T x) { return x; }
};
template <>
struct Acc<__half> {
  using Type = float;
  __device__ static float Load(const __half& x) { return __half2float(x); }
  __device__ static __half Store(float x) { return __float2half_rn(x); }
};
template <>
struct Acc<__nv_bfloat16> {
  using Type = float;
  __device__ static float Load(const __nv_bfloat16& x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 Store(float x) { return __float2bfloat16_rn(x); }
};

template <typename A>
__device__ __forceinline__ A Combine(logic::ReduceOp op, A a, A b) {
  switch (op) {
    case logic::ReduceOp::kSum: return a + b;
    case logic::ReduceOp::kProd: return a * b;
    case logic::ReduceOp::kMin: return b < a ? b : a;
    case logic::ReduceOp::kMax: return a < b ? b : a;
  }
  return a;
}

template <typename T>
__global__ void PeerReduceKernel(logic::ReduceOp op, T* out, PeerOperands srcs, int64_t outer,
                                 int64_t inner, int64_t stride, int64_t offset) {
  using A = typename Acc<T>::Type;
  const int64_t n = outer * inner;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t at = (j / inner) * stride + offset + j % inner;
    A acc = Acc<T>::Load(static_cast<const T*>(srcs.src[0])[at]);
    for (int d = 1; d < srcs.R; ++d) acc = Combine(op, acc, Acc<T>::Load(static_cast<const T*>(srcs.src[d])[at]));
    out[j] = Acc<T>::Store(acc);
  }
}

unsigned Blocks(int64_t n, int64_t cap = 65535) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(n, cap)));
}

}  // namespace

size_t RoutingWorkBytes(int R, int64_t T, int64_t K, int64_t E) {
  return sizeof(int32_t) * static_cast<size_t>(R * T * K + 2 * R * E + 2 * E + R);
}

cudaError_t LaunchRouting(const int32_t* ids, int R, int64_t T, int64_t K, int64_t E,
                          int64_t rows, bool padded, int32_t* dest, int32_t* pos, int32_t* sizes,
                          int32_t* stats, void* work, cudaStream_t stream) {
  // RankKernel keeps one counter per expert in shared memory (48 KiB without opt-in).
  if (R <= 0 || E % R != 0 || E > 8192 || rows <= 0) return cudaErrorInvalidValue;
  const int64_t TK = T * K;
  RoutingWork w = Carve(work, R, TK, E);
  cudaError_t err = cudaMemsetAsync(stats, 0, sizeof(int32_t) * 3 * R, stream);
  if (err != cudaSuccess) return err;
  RankKernel<<<R, 1024, sizeof(int) * E, stream>>>(ids, TK, static_cast<int>(E), w);
  PlanKernel<<<1, 1024, 0, stream>>>(R, static_cast<int>(E), rows, padded, w, sizes, stats);
  const int64_t n = R * TK;
  PositionKernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
      ids, R, TK, static_cast<int>(E), rows, padded, w, dest, pos, stats);
  return cudaGetLastError();
}

cudaError_t MoeZeroWritten(const MoePeers& peers, const MoeShape& shape, cudaStream_t stream) {
  for (int d = 0; d < peers.R; ++d) {
    if (shape.self >= 0 && d != shape.self) continue;
    const cudaError_t err = cudaMemsetAsync(peers.written[d], 0, shape.rows, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// Calls f(tag) with the element tag of float type `e`; cudaErrorInvalidValue for others.
template <typename F>
cudaError_t WithFloat(Elem e, F&& f) {
  switch (e) {
    case Elem::kF32: f(F32T{}); return cudaSuccess;
    case Elem::kBF16: f(BF16T{}); return cudaSuccess;
    case Elem::kF16: f(F16T{}); return cudaSuccess;
    default: return cudaErrorInvalidValue;
  }
}

// f(tag of a, tag of b) for two float types.
template <typename F>
cudaError_t WithFloats(Elem a, Elem b, F&& f) {
  cudaError_t inner = cudaSuccess;
  const cudaError_t outer = WithFloat(a, [&](auto ta) { inner = WithFloat(b, [&](auto tb) { f(ta, tb); }); });
  return outer != cudaSuccess ? outer : inner;
}

cudaError_t LaunchMoe(int mode, const MoePeers& peers, const MoeShape& shape, cudaStream_t stream) {
  if (peers.R <= 0 || peers.R > kMaxPeers || shape.K > kMaxK || shape.T <= 0) {
    return shape.T == 0 ? cudaSuccess : cudaErrorInvalidValue;
  }
  if (shape.T > 0x7fffffff || shape.self >= peers.R) return cudaErrorInvalidValue;
  // Gather modes read every source's tokens (grid.y); the others compute one rank per
  // grid.y, or only `self`.
  const unsigned ranks = static_cast<unsigned>(peers.R);
  const dim3 grid(static_cast<unsigned>(shape.T), ranks);
  const dim3 own(static_cast<unsigned>(shape.T), shape.self >= 0 ? 1u : ranks);
  cudaError_t err = cudaSuccess;
  switch (mode) {
    case kGatherCopy:
      GatherKernel<kGatherCopy, F32T, F32T><<<grid, 128, 0, stream>>>(peers, shape);
      break;
    case kGatherSparse:
      GatherKernel<kGatherSparse, F32T, F32T><<<grid, 128, 0, stream>>>(peers, shape);
      break;
    case kGatherScaled:
      err = WithFloats(shape.src, shape.out, [&](auto in, auto out) {
        GatherKernel<kGatherScaled, decltype(in), decltype(out)><<<grid, 128, 0, stream>>>(peers, shape);
      });
      break;
    case kGatherDequant:
      err = WithFloat(shape.out, [&](auto out) {
        GatherKernel<kGatherDequant, E4M3T, decltype(out)><<<grid, 128, 0, stream>>>(peers, shape);
      });
      break;
    case kGatherDequantSparse:
      err = WithFloat(shape.out, [&](auto out) {
        GatherKernel<kGatherDequantSparse, E4M3T, decltype(out)><<<grid, 128, 0, stream>>>(peers, shape);
      });
      break;
    case kReduce:
      err = WithFloats(shape.src, shape.out, [&](auto in, auto out) {
        using In = decltype(in);
        using Out = decltype(out);
        constexpr int kV = static_cast<int>(16 / sizeof(typename In::Storage));
        if (shape.H % kV == 0) {
          ReduceKernel<In, Out, kV><<<own, 128, 0, stream>>>(peers, shape);
        } else {
          ReduceKernel<In, Out, 1><<<own, 128, 0, stream>>>(peers, shape);
        }
      });
      break;
    case kDot:
      err = WithFloats(shape.src, shape.g, [&](auto x, auto g) {
        DotKernel<decltype(x), decltype(g)><<<own, 256, 0, stream>>>(peers, shape);
      });
      break;
    default:
      return cudaErrorInvalidValue;
  }
  if (err != cudaSuccess) return err;
  if (ZeroesUnwritten(mode)) {
    const dim3 zgrid(Blocks(shape.rows, 4096), shape.self >= 0 ? 1u : ranks);
    ZeroUnwrittenKernel<<<zgrid, 128, 0, stream>>>(peers, shape);
  }
  return cudaGetLastError();
}

cudaError_t LaunchFp8Quantize(Elem in, const void* x, int64_t T, int64_t H, uint8_t* q, float* scales,
                              cudaStream_t stream) {
  const int64_t jobs = T * Fp8Blocks(H);
  if (jobs == 0) return cudaSuccess;
  const unsigned blocks = Blocks((jobs + 7) / 8, 8192);  // 8 warps per block, one job each
  const cudaError_t err = WithFloat(in, [&](auto tag) {
    using In = decltype(tag);
    Fp8QuantizeKernel<In><<<blocks, 256, 0, stream>>>(static_cast<const typename In::Storage*>(x), T, H,
                                                       q, scales);
  });
  return err != cudaSuccess ? err : cudaGetLastError();
}

cudaError_t LaunchPeerReduce(logic::ReduceOp op, Elem elem, void* out, const PeerOperands& srcs,
                             int64_t outer, int64_t inner, int64_t stride, int64_t offset,
                             cudaStream_t stream) {
  if (srcs.R <= 0 || srcs.R > kMaxPeers) return cudaErrorInvalidValue;
  const int64_t n = outer * inner;
  if (n == 0) return cudaSuccess;
  const unsigned blocks = Blocks((n + 255) / 256, 8192);
  switch (elem) {
#define JAXCOMM_PEER_REDUCE(E, T)                                                                   \
  case Elem::E:                                                                                     \
    PeerReduceKernel<T><<<blocks, 256, 0, stream>>>(op, static_cast<T*>(out), srcs, outer, inner, \
                                                    stride, offset);                               \
    break;
    JAXCOMM_PEER_REDUCE(kF32, float)
    JAXCOMM_PEER_REDUCE(kF64, double)
    JAXCOMM_PEER_REDUCE(kF16, __half)
    JAXCOMM_PEER_REDUCE(kBF16, __nv_bfloat16)
    JAXCOMM_PEER_REDUCE(kS8, int8_t)
    JAXCOMM_PEER_REDUCE(kS16, int16_t)
    JAXCOMM_PEER_REDUCE(kS32, int32_t)
    JAXCOMM_PEER_REDUCE(kS64, int64_t)
    JAXCOMM_PEER_REDUCE(kU8, uint8_t)
    JAXCOMM_PEER_REDUCE(kU16, uint16_t)
    JAXCOMM_PEER_REDUCE(kU32, uint32_t)
    JAXCOMM_PEER_REDUCE(kU64, uint64_t)
#undef JAXCOMM_PEER_REDUCE
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchRaggedOneRank(int mode, const void* operand, void* result, int64_t src_rows,
                                int64_t dst_rows, int64_t row_bytes, int64_t row_elems,
                                Elem elem, const void* input_offsets, const void* send_sizes,
                                const void* output_offsets, const void* recv_sizes, int64_t n,
                                int idx_bytes, cudaStream_t stream) {
  RaggedArgs a{{input_offsets, idx_bytes}, {send_sizes, idx_bytes}, {output_offsets, idx_bytes},
               {recv_sizes, idx_bytes}, n, src_rows, dst_rows, row_bytes, row_elems};
  if (row_bytes == 0 || n == 0) return cudaSuccess;
  if (mode == 0 || mode == 2) {
    RaggedForwardKernel<<<Blocks(dst_rows, 8192), 128, 0, stream>>>(
        a, static_cast<const char*>(operand), static_cast<char*>(result), mode == 2);
    return cudaGetLastError();
  }
  if (mode != 1) return cudaErrorInvalidValue;
  const unsigned blocks = Blocks(src_rows, 8192);
  switch (elem) {
#define JAXCOMM_RAGGED_T(E, T)                                                             \
  case Elem::E:                                                                            \
    RaggedTransposeKernel<T><<<blocks, 128, 0, stream>>>(a, static_cast<const T*>(operand), \
                                                         static_cast<T*>(result));          \
    break;
    JAXCOMM_RAGGED_T(kF32, float)
    JAXCOMM_RAGGED_T(kF64, double)
    JAXCOMM_RAGGED_T(kF16, __half)
    JAXCOMM_RAGGED_T(kBF16, __nv_bfloat16)
    JAXCOMM_RAGGED_T(kS8, int8_t)
    JAXCOMM_RAGGED_T(kS16, int16_t)
    JAXCOMM_RAGGED_T(kS32, int32_t)
    JAXCOMM_RAGGED_T(kS64, int64_t)
    JAXCOMM_RAGGED_T(kU8, uint8_t)
    JAXCOMM_RAGGED_T(kU16, uint16_t)
    JAXCOMM_RAGGED_T(kU32, uint32_t)
    JAXCOMM_RAGGED_T(kU64, uint64_t)
#undef JAXCOMM_RAGGED_T
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace jaxcomm::cuda
