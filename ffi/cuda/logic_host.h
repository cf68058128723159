// The CUDA kernels' index logic (kernel_logic.h) run on the host, one thread, in the
// kernels' own structure: what the tests compare with the host backend's results in CI,
// where there is no GPU. Each function does what the named launcher of kernels.cu does.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cuda/kernel_logic.h"

namespace jaxcomm::cuda::logic {

// LaunchRouting: ids [R, T, K] -> dest, pos [R, T, K], sizes [R, E/R], stats [R, 3]
// (dropped, invalid, recv_dropped).
struct Routing {
  std::vector<int32_t> dest, pos, sizes, stats;
};
Routing RouteOnHost(const std::vector<int32_t>& ids, int64_t R, int64_t T, int64_t K, int64_t E,
                    int64_t rows, bool padded);

// Float element types of the host runs below: 0 float32, 1 bfloat16, 2 float16.
enum class HostFloat : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// LaunchMoe for every rank (each rank's own result, as on one GPU per rank). Per rank:
// src bytes, dest/pos int32 [T, K], w float32 [T, K], g float32 [T, H] (kDot) or the FP8
// scales [T, ceil(H/128)] (the dequantizing gathers). `src_type`/`out_type`: the float
// modes' element types (kDot's g is float32 here). Returns each rank's result bytes:
// gathers [rows, row_bytes] (the sparse ones start from 0x7F bytes, which the rows no
// slot writes keep), kReduce [T, H], kDot [T, K] f32.
std::vector<std::string> MoeOnHost(int mode, int64_t T, int64_t K, int64_t H, int64_t rows,
                                   int64_t row_bytes, const std::vector<std::string>& src,
                                   const std::vector<std::vector<int32_t>>& dest,
                                   const std::vector<std::vector<int32_t>>& pos,
                                   const std::vector<std::vector<float>>& w,
                                   const std::vector<std::vector<float>>& g,
                                   HostFloat src_type = HostFloat::kF32, HostFloat out_type = HostFloat::kF32);

// LaunchFp8Quantize on x [T, H] (bytes of `type`), lane by lane as its warps run:
// (codes [T, H], scales [T, ceil(H/128)]).
std::pair<std::string, std::vector<float>> Fp8QuantizeOnHost(const std::string& x, HostFloat type,
                                                             int64_t T, int64_t H);

// LaunchRaggedOneRank over float32 rows of `row_elems` elements: `output` is the result's
// starting value; offsets and sizes as int64.
std::vector<float> RaggedOnHost(int mode, const std::vector<float>& operand, const std::vector<float>& output,
                                int64_t row_elems, int64_t src_rows, int64_t dst_rows,
                                const std::vector<int64_t>& input_offsets, const std::vector<int64_t>& send_sizes,
                                const std::vector<int64_t>& output_offsets, const std::vector<int64_t>& recv_sizes);

// The copies (after PlanCopy with `max_pitch`) of BlockCopy for every block d < R of an
// operand of `dims` split along `axis`, block d at d * block_stride bytes.
std::vector<Copy2D> BlockCopies(const std::vector<int64_t>& dims, int64_t axis, int64_t R, int64_t item,
                                bool to_block, int64_t block_stride, int64_t max_pitch);

}  // namespace jaxcomm::cuda::logic
