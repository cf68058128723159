// jaxcomm's own CUDA kernels, behind host launchers that enqueue on a stream and never
// synchronize. Shared by the XLA handlers (handlers.cc: one rank, the peers table holds
// this device's own buffers) and the loopback mode (loopback.cc: R logical ranks whose
// "peer" buffers are regions of one device's memory). Semantics follow the host backend
// exactly: ffi/cpu/moe_kernels.cc (MoeMode) and ffi/cpu/ragged.cc (RaggedMode). Their
// index computations live in kernel_logic.h, where the host tests reach them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/moe_modes.h"
#include "cuda/kernel_logic.h"

namespace jaxcomm::cuda {

// Ranks a kernel can address in one launch (the peer tables travel as kernel arguments).
constexpr int kMaxPeers = 16;
// Slots per token (top-k) the MoE kernels stage in shared memory.
constexpr int kMaxSlots = 64;

// Element types the kernels that add values support (XLA's PrimitiveType numbering is not
// used here on purpose: handlers map it, so this header needs no XLA).
enum class Elem : int { kF32, kF64, kF16, kBF16, kS8, kS16, kS32, kS64, kU8, kU16, kU32, kU64 };

// Every rank's buffers for one MoE transport call; rank d's entries at [d].
struct MoePeers {
  int R = 0;
  const void* src[kMaxPeers] = {};
  void* out[kMaxPeers] = {};
  const int32_t* dest[kMaxPeers] = {};  // [T, K]: destination rank of each slot, or -1
  const int32_t* pos[kMaxPeers] = {};   // [T, K]: the slot's row at the destination, or -1
  const float* w[kMaxPeers] = {};       // [T, K]
  const void* g[kMaxPeers] = {};        // [T, H] (kDot), or the FP8 scales [T, ceil(H/128)] f32 (kGatherDequant*)
  uint8_t* written[kMaxPeers] = {};     // [rows] scratch: rows a gather wrote (gather modes)
};

// The transports are core/moe_modes.h's MoeMode, with its element types: the copies
// (kGatherCopy, kGatherSparse) move rows of `row_bytes` bytes; the float modes take
// float32, bfloat16 or float16 and accumulate in float32 (the host backend's arithmetic,
// core/number_formats.h's conversions); the dequantizing gathers read FP8 codes and
// their scales (g).

struct MoeShape {
  int64_t T = 0, K = 0, H = 0, rows = 0, row_bytes = 0;
  // The float modes' element types (kF32, kBF16 or kF16): src, the result and g (kDot).
  Elem src = Elem::kF32, out = Elem::kF32, g = Elem::kF32;
  // -1: compute every rank's result (loopback, one launch). r >= 0: only rank r's, reading
  // the peers' buffers in place (one GPU per rank, peers.h).
  int self = -1;
};

// Runs `mode` for every rank of `peers` (as the host backend's RunMoe for each r), or for
// rank `shape.self` only. The gathers that zero the rows nobody writes
// (ZeroesUnwritten(mode)) need `written` zeroed first (MoeZeroWritten); the others never
// touch `written`, nor the rows no slot writes.
cudaError_t LaunchMoe(int mode, const MoePeers& peers, const MoeShape& shape, cudaStream_t stream);
cudaError_t MoeZeroWritten(const MoePeers& peers, const MoeShape& shape, cudaStream_t stream);

// jaxcomm's FP8 token format (core/number_formats.h) of x [T, H] (`in`: kF32, kBF16 or
// kF16): q [T, H] float8_e4m3fn codes and scales [T, ceil(H/128)] f32, one warp per
// 128-channel block of a token. The same bits as the host backend's quantization.
cudaError_t LaunchFp8Quantize(Elem in, const void* x, int64_t T, int64_t H, uint8_t* q, float* scales,
                              cudaStream_t stream);

// Routing of R logical ranks on one device (loopback): jaxcomm/_src/moe/dispatch.py's
// plan(fused=True). ids [R, T, K] int32 -> dest, pos [R, T, K]; sizes [R, El] (the
// group_sizes/counts each rank returns); stats [R, 3] = dropped, invalid, recv_dropped.
// `work` holds RoutingWorkBytes(R, T, K, E) bytes of device scratch.
size_t RoutingWorkBytes(int R, int64_t T, int64_t K, int64_t E);
cudaError_t LaunchRouting(const int32_t* ids, int R, int64_t T, int64_t K, int64_t E,
                          int64_t rows, bool padded, int32_t* dest, int32_t* pos, int32_t* sizes,
                          int32_t* stats, void* work, cudaStream_t stream);

// ragged_all_to_all of a one-rank group (ffi/cpu/ragged.cc with R = 1). Offsets and
// sizes stay on the device; when any slice is out of bounds (or recv_sizes disagree) the
// kernels write nothing. `result` already holds `output`.
cudaError_t LaunchRaggedOneRank(int mode, const void* operand, void* result, int64_t src_rows,
                                int64_t dst_rows, int64_t row_bytes, int64_t row_elems,
                                Elem elem, const void* input_offsets, const void* send_sizes,
                                const void* output_offsets, const void* recv_sizes, int64_t n,
                                int idx_bytes, cudaStream_t stream);

// Reductions of a group whose ranks read each other's operands (peers.h: several
// processes on one GPU, which NCCL refuses): this rank's result, reduced in rank order,
// out[o * inner + i] = op over d < R of srcs[d][o * stride + offset + i] (elements), for
// o < outer and i < inner. Half precision accumulates in float32 and rounds once; kU8
// also serves bool (sum excluded: bool sums reach here as int32).
struct PeerOperands {
  int R = 0;
  const void* src[kMaxPeers] = {};
};
cudaError_t LaunchPeerReduce(logic::ReduceOp op, Elem elem, void* out, const PeerOperands& srcs,
                             int64_t outer, int64_t inner, int64_t stride, int64_t offset,
                             cudaStream_t stream);

}  // namespace jaxcomm::cuda
