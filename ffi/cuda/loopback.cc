#include "cuda/loopback.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <thread>
#include <memory>
#include <sstream>
#include <vector>

#include "cuda/event_query.h"
#include "cuda/kernels.h"

namespace jaxcomm::cuda {
namespace {

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DevicePtr = std::unique_ptr<void, CudaFree>;

struct StreamDeleter {
  void operator()(cudaStream_t s) const { cudaStreamDestroy(s); }
};
using Stream = std::unique_ptr<std::remove_pointer_t<cudaStream_t>, StreamDeleter>;

struct EventDeleter {
  void operator()(cudaEvent_t e) const { cudaEventDestroy(e); }
};
using Event = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, EventDeleter>;

// Every CUDA call of the loopback goes through here: the message names the call and line.
#define LB_CHECK(expr)                                                                   \
  do {                                                                                   \
    const cudaError_t e_ = (expr);                                                       \
    if (e_ != cudaSuccess) {                                                             \
      std::ostringstream m_;                                                             \
      m_ << "jaxcomm CUDA loopback (R=" << cfg.R << ", T=" << cfg.T << ", H=" << cfg.H      \
         << "): " << #expr << " failed at " << __FILE__ << ":" << __LINE__ << ": "        \
         << cudaGetErrorString(e_);                                                      \
      return m_.str();                                                                   \
    }                                                                                    \
  } while (0)

// Waits for `event` with a deadline (a hung kernel must not hang the caller).
cudaError_t WaitEvent(cudaEvent_t event, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (true) {
    const cudaError_t e = QueryEvent(event);
    if (e != cudaErrorNotReady) return e;
    if (std::chrono::steady_clock::now() > deadline) return cudaErrorLaunchTimeout;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

constexpr std::chrono::seconds kStageLimit{120};

}  // namespace

std::string RunMoeLoopback(const LoopbackConfig& cfg, const void* x, const int32_t* ids,
                           const float* w, LoopbackResult* out) {
  if (cfg.R <= 0 || cfg.R > kMaxPeers || cfg.E % cfg.R != 0 || cfg.E > 8192 || cfg.T <= 0 ||
      cfg.H <= 0 || cfg.K <= 0 || cfg.K > kMaxSlots || cfg.capacity <= 0 ||
      (cfg.low_latency && !cfg.padded)) {
    return "jaxcomm CUDA loopback: need 0 < R <= " + std::to_string(kMaxPeers) +
           ", E divisible by R and at most 8192, 0 < K <= " + std::to_string(kMaxSlots) +
           ", positive T, H and capacity, and the padded layout for low latency";
  }
  const int R = cfg.R;
  const int64_t T = cfg.T, H = cfg.H, K = cfg.K, E = cfg.E, El = E / R;
  const Elem elem = cfg.f16 ? Elem::kF16 : cfg.bf16 ? Elem::kBF16 : Elem::kF32;
  const int64_t item = elem == Elem::kF32 ? 4 : 2;
  const int64_t rows = cfg.padded ? El * cfg.capacity : cfg.capacity;
  const int64_t row_bytes = H * item;
  out->rows = rows;
  LB_CHECK(cudaSetDevice(cfg.device));

  auto alloc = [&](size_t bytes, DevicePtr* p) -> cudaError_t {
    void* raw = nullptr;
    const cudaError_t e = cudaMalloc(&raw, std::max<size_t>(bytes, 1));
    p->reset(raw);
    return e;
  };
  const size_t x_bytes = R * T * row_bytes, tk = R * T * K;
  const int64_t nb = Fp8Blocks(H);
  DevicePtr dx, dids, dw, ddest, dpos, dsizes, dstats, dwork, dexp, dy, dwritten, dq, dscales;
  LB_CHECK(alloc(x_bytes, &dx));
  LB_CHECK(alloc(tk * 4, &dids));
  LB_CHECK(alloc(tk * 4, &dw));
  LB_CHECK(alloc(tk * 4, &ddest));
  LB_CHECK(alloc(tk * 4, &dpos));
  LB_CHECK(alloc(R * El * 4, &dsizes));
  LB_CHECK(alloc(R * 3 * 4, &dstats));
  LB_CHECK(alloc(RoutingWorkBytes(R, T, K, E), &dwork));
  LB_CHECK(alloc(R * rows * row_bytes, &dexp));
  LB_CHECK(alloc(x_bytes, &dy));
  LB_CHECK(alloc(R * rows, &dwritten));
  LB_CHECK(alloc(cfg.fp8 ? R * T * H : 0, &dq));
  LB_CHECK(alloc(cfg.fp8 ? R * T * nb * 4 : 0, &dscales));
  if (cfg.low_latency) LB_CHECK(cudaMemset(dexp.get(), 0x7F, R * rows * row_bytes));
  LB_CHECK(cudaMemcpy(dx.get(), x, x_bytes, cudaMemcpyHostToDevice));
  LB_CHECK(cudaMemcpy(dids.get(), ids, tk * 4, cudaMemcpyHostToDevice));
  LB_CHECK(cudaMemcpy(dw.get(), w, tk * 4, cudaMemcpyHostToDevice));
  // That setup ran on the legacy default stream, which the non-blocking stream below does
  // not wait for (and cudaMemset may return before the device has done it).
  LB_CHECK(cudaDeviceSynchronize());

  cudaStream_t raw_stream = nullptr;
  LB_CHECK(cudaStreamCreateWithFlags(&raw_stream, cudaStreamNonBlocking));
  Stream stream(raw_stream);
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  LB_CHECK(cudaEventCreate(&e0));
  Event ev0(e0);
  LB_CHECK(cudaEventCreate(&e1));
  Event ev1(e1);

  char* xb = static_cast<char*>(dx.get());
  char* eb = static_cast<char*>(dexp.get());
  char* yb = static_cast<char*>(dy.get());
  auto* dest = static_cast<int32_t*>(ddest.get());
  auto* pos = static_cast<int32_t*>(dpos.get());
  MoePeers dispatch, combine;
  dispatch.R = combine.R = R;
  for (int r = 0; r < R; ++r) {
    if (cfg.fp8) {
      dispatch.src[r] = static_cast<const uint8_t*>(dq.get()) + r * T * H;
      dispatch.g[r] = static_cast<const float*>(dscales.get()) + r * T * nb;
    } else {
      dispatch.src[r] = xb + r * T * row_bytes;
    }
    dispatch.out[r] = eb + r * rows * row_bytes;
    dispatch.written[r] = static_cast<uint8_t*>(dwritten.get()) + r * rows;
    combine.src[r] = eb + r * rows * row_bytes;  // identity experts: expert_y = expert_x
    combine.out[r] = yb + r * T * row_bytes;
    combine.w[r] = static_cast<const float*>(dw.get()) + r * T * K;
    dispatch.dest[r] = combine.dest[r] = dest + r * T * K;
    dispatch.pos[r] = combine.pos[r] = pos + r * T * K;
  }
  MoeShape ds;
  ds.T = T;
  ds.K = K;
  ds.H = H;
  ds.rows = rows;
  ds.row_bytes = row_bytes;
  ds.out = elem;  // the dequantizing gathers' result
  MoeShape cs = ds;
  cs.src = cs.out = elem;
  const int dispatch_mode = cfg.fp8 ? (cfg.low_latency ? kGatherDequantSparse : kGatherDequant)
                                    : (cfg.low_latency ? kGatherSparse : kGatherCopy);

  // Median time of `iters` runs of `stage` after one warm-up.
  auto timed = [&](const std::function<cudaError_t()>& stage, double* ms) -> std::string {
    std::vector<float> times;
    for (int i = 0; i <= std::max(cfg.iters, 1); ++i) {
      LB_CHECK(cudaEventRecord(ev0.get(), stream.get()));
      LB_CHECK(stage());
      LB_CHECK(cudaEventRecord(ev1.get(), stream.get()));
      LB_CHECK(WaitEvent(ev1.get(), kStageLimit));
      float t = 0;
      LB_CHECK(cudaEventElapsedTime(&t, ev0.get(), ev1.get()));
      if (i > 0) times.push_back(t);
    }
    std::sort(times.begin(), times.end());
    *ms = times[times.size() / 2];
    return "";
  };
  std::string err = timed([&] {
    return LaunchRouting(static_cast<const int32_t*>(dids.get()), R, T, K, E, rows, cfg.padded,
                         dest, pos, static_cast<int32_t*>(dsizes.get()),
                         static_cast<int32_t*>(dstats.get()), dwork.get(), stream.get());
  }, &out->plan_ms);
  if (!err.empty()) return err;
  // One launch for all ranks, or one per rank (each reading the others' buffers).
  auto each = [&](const std::function<cudaError_t(int)>& launch) -> cudaError_t {
    if (!cfg.per_rank) return launch(-1);
    for (int r = 0; r < R; ++r) {
      const cudaError_t e = launch(r);
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  };
  auto run_dispatch = [&] {
    if (cfg.fp8) {  // every rank quantizes its own tokens (one launch covers all ranks' rows)
      const cudaError_t e = LaunchFp8Quantize(elem, xb, R * T, H, static_cast<uint8_t*>(dq.get()),
                                              static_cast<float*>(dscales.get()), stream.get());
      if (e != cudaSuccess) return e;
    }
    return each([&](int self) {
      MoeShape s = ds;
      s.self = self;
      if (ZeroesUnwritten(dispatch_mode)) {
        const cudaError_t e = MoeZeroWritten(dispatch, s, stream.get());
        if (e != cudaSuccess) return e;
      }
      return LaunchMoe(dispatch_mode, dispatch, s, stream.get());
    });
  };
  auto run_combine = [&] {
    return each([&](int self) {
      MoeShape s = cs;
      s.self = self;
      return LaunchMoe(kReduce, combine, s, stream.get());
    });
  };
  err = timed(run_dispatch, &out->dispatch_ms);
  if (!err.empty()) return err;
  err = timed(run_combine, &out->combine_ms);
  if (!err.empty()) return err;
  // The yardstick: one device-to-device copy of all ranks' tokens, same run, same buffers.
  err = timed([&] {
    return cudaMemcpyAsync(yb, xb, x_bytes, cudaMemcpyDeviceToDevice, stream.get());
  }, &out->memcpy_ms);
  if (!err.empty()) return err;
  out->memcpy_bytes = 2 * static_cast<int64_t>(x_bytes);
  // The timed copy overwrote y: combine once more for the returned result.
  LB_CHECK(run_combine());
  LB_CHECK(cudaEventRecord(ev1.get(), stream.get()));
  LB_CHECK(WaitEvent(ev1.get(), kStageLimit));

  out->y.resize(x_bytes);
  out->sizes.resize(R * El);
  out->stats.resize(R * 3);
  out->dest.resize(tk);
  out->pos.resize(tk);
  LB_CHECK(cudaMemcpy(out->y.data(), yb, x_bytes, cudaMemcpyDeviceToHost));
  LB_CHECK(cudaMemcpy(out->sizes.data(), dsizes.get(), R * El * 4, cudaMemcpyDeviceToHost));
  LB_CHECK(cudaMemcpy(out->stats.data(), dstats.get(), R * 3 * 4, cudaMemcpyDeviceToHost));
  LB_CHECK(cudaMemcpy(out->dest.data(), dest, tk * 4, cudaMemcpyDeviceToHost));
  LB_CHECK(cudaMemcpy(out->pos.data(), pos, tk * 4, cudaMemcpyDeviceToHost));
  if (cfg.return_expert_x) {
    out->expert_x.resize(R * rows * row_bytes);
    LB_CHECK(cudaMemcpy(out->expert_x.data(), eb, out->expert_x.size(), cudaMemcpyDeviceToHost));
  }
  // DeepEP's byte count: one token row per (token, destination rank) pair that keeps at
  // least one assignment.
  int64_t pairs = 0;
  std::vector<char> seen(R);
  for (int64_t st = 0; st < R * T; ++st) {
    std::fill(seen.begin(), seen.end(), 0);
    for (int64_t k = 0; k < K; ++k) {
      const int d = out->dest[st * K + k];
      if (d >= 0 && d < R && !seen[d]) {
        seen[d] = 1;
        ++pairs;
      }
    }
  }
  out->pairs = pairs;
  return "";
}

}  // namespace jaxcomm::cuda
