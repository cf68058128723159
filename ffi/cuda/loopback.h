// Loopback mode: R logical ranks share one GPU, their "peer" buffers being regions of
// that device's memory, so the MoE routing, dispatch and combine kernels run, are checked
// against the host backend and are measured on a single GPU, outside XLA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace jaxcomm::cuda {

struct LoopbackConfig {
  int device = 0;
  int R = 8;
  int64_t T = 0, H = 0, K = 0, E = 0;
  int64_t capacity = 0;  // rows per rank (packed) or per expert (padded)
  bool padded = false;
  bool bf16 = true;      // element type of x: bfloat16, else float32 (or float16, below)
  bool f16 = false;      // x is float16
  // DeepEP's low-latency decode: the padded layout, the rows past each expert's count left
  // as they were (the dispatch writes only arriving rows; the loopback fills expert_x
  // with 0x7F bytes first, so that the caller can check no other row was written).
  bool low_latency = false;
  // FP8 dispatch: each rank's tokens quantized (LaunchFp8Quantize, part of the dispatch's
  // time), moved as FP8 codes and scales, dequantized into x's type by the gather.
  bool fp8 = false;
  int iters = 10;        // timed repetitions of each stage (after one warm-up)
  bool return_expert_x = false;
  // Launch each rank's part on its own (MoeShape::self = r), as one GPU per rank does,
  // instead of one launch for all ranks.
  bool per_rank = false;
};

struct LoopbackResult {
  // Outputs of the last repetition: expert_x [R, rows, H] (when asked), y [R, T, H] = the
  // combine of expert_x with `w` (identity experts), sizes [R, E/R], stats [R, 3]
  // (dropped, invalid, recv_dropped), dest/pos [R, T, K].
  std::vector<char> expert_x, y;
  std::vector<int32_t> sizes, stats, dest, pos;
  // Median milliseconds per stage and of a device-to-device copy of R*T*H elements.
  double plan_ms = 0, dispatch_ms = 0, combine_ms = 0, memcpy_ms = 0;
  int64_t memcpy_bytes = 0;  // bytes that copy reads plus writes
  int64_t pairs = 0;         // kept (token, destination rank) pairs: DeepEP's unit
  int64_t rows = 0;          // rows of expert_x per rank
};

// Runs routing, dispatch and combine for R ranks' inputs x [R, T, H], ids [R, T, K],
// w [R, T, K]. "" or an error message naming the failed call and its place. The combine
// reads x's type and writes it, accumulating in float32.
std::string RunMoeLoopback(const LoopbackConfig& cfg, const void* x, const int32_t* ids,
                           const float* w, LoopbackResult* out);

}  // namespace jaxcomm::cuda
