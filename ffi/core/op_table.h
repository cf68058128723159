// The one definition of every jaxcomm op and of the codes its attributes carry. Both
// backends register their handlers from it (ffi/module.cc for the host backend,
// ffi/cuda/handlers.cc for CUDA), bind each op's own attributes from it, and parse its
// codes with it; the extension module hands it to Python (op_table(), read by
// jaxcomm/_src/ops/table.py), which takes its reduction codes and modes from there.
//
// Adding an op: one JAXCOMM_OPS line, one JAXCOMM_ATTRS_<name> line, then the op's own
// files (its Python primitive under jaxcomm/_src/ops/, its handler per backend, named
// k<Handler> in jaxcomm::cpu and jaxcomm_cuda_<Handler> / jaxcomm_cuda_Inst<Handler> in
// jaxcomm::cuda). A kernel called outside any group: one JAXCOMM_LOCAL_OPS line. Adding
// a reduction code or a mode: one line of its list, then the kernels that implement it.
//
// No XLA or CUDA header here: the CUDA kernels (kernels.cu) include it through
// cuda/kernel_logic.h.
#pragma once

#include <cstdint>
#include <string>

// X(name, Handler, operands, results, backends): the op `name` (Python's name, and the
// FFI target jaxcomm_<name>), its handlers' C++ name, how many buffers it takes and
// returns, and which backends serve it (CPU, or CPU_CUDA). Every op runs over a group:
// it binds the common call attributes (core/call_attrs.h) and has an instantiate stage.
#define JAXCOMM_OPS(X)                                      \
  X(all_reduce, AllReduce, 1, 1, CPU_CUDA)                  \
  X(all_gather, AllGather, 1, 1, CPU_CUDA)                  \
  X(reduce_scatter, ReduceScatter, 1, 1, CPU_CUDA)          \
  X(all_to_all, AllToAll, 1, 1, CPU_CUDA)                   \
  X(ppermute, Permute, 1, 1, CPU_CUDA)                      \
  X(broadcast, Broadcast, 1, 1, CPU_CUDA)                   \
  X(ragged_all_to_all, RaggedAllToAll, 6, 1, CPU_CUDA)      \
  X(moe_transport, MoeTransport, 5, 1, CPU_CUDA)            \
  X(moe_transport_send, MoeTransportSend, 5, 2, CPU_CUDA)   \
  X(moe_recv, MoeRecv, 2, 2, CPU_CUDA)                      \
  X(moe_dispatch, MoeDispatch, 2, 4, CPU)                   \
  X(ft_all_reduce, FtAllReduce, 1, 2, CPU)                  \
  X(put_start, PutStart, 1, 2, CPU_CUDA)                    \
  X(put_done, PutDone, 2, 2, CPU_CUDA)

// Ops whose operand count above is a minimum, X(name): moe_recv takes the send half's two
// results, then every operand the send published, which XLA keeps alive until the round
// is over (cpu/moe_split.h); put_done likewise takes put_start's two results, then the
// put's operand (cpu/put.h).
#define JAXCOMM_VARIADIC_OPS(X) X(moe_recv) X(put_done)

// Kernels a program calls on one device's data, outside any group (no call attributes,
// no state, an execute stage alone), X as JAXCOMM_OPS's; backends CUDA. moe_fp8_quantize:
// x [T, H] float32/bfloat16/float16 -> (FP8 codes [T, H], f32 scales [T, ceil(H/128)]),
// jaxcomm's FP8 token format (core/number_formats.h); the host backend quantizes inside
// moe_dispatch instead.
#define JAXCOMM_LOCAL_OPS(X) X(moe_fp8_quantize, Fp8Quantize, 1, 2, CUDA)

// Each op's own attributes, in binding order, after those every call carries
// (core/call_attrs.h): A(type, name), type I64 (int64_t) or I64S (a span of int64_t).
#define JAXCOMM_ATTRS_all_reduce(A) A(I64, reduce_op)
#define JAXCOMM_ATTRS_all_gather(A) A(I64, axis_index)
#define JAXCOMM_ATTRS_reduce_scatter(A) A(I64, reduce_op) A(I64, scatter_dimension)
#define JAXCOMM_ATTRS_all_to_all(A) A(I64, split_axis) A(I64, concat_axis)
#define JAXCOMM_ATTRS_ppermute(A) A(I64S, sources)
#define JAXCOMM_ATTRS_broadcast(A) A(I64, root)
#define JAXCOMM_ATTRS_ragged_all_to_all(A) A(I64, mode) A(I64, src_rows) A(I64, dst_rows)
#define JAXCOMM_ATTRS_moe_transport(A) A(I64, mode)
#define JAXCOMM_ATTRS_moe_transport_send(A) A(I64, mode)
#define JAXCOMM_ATTRS_moe_recv(A)
#define JAXCOMM_ATTRS_moe_dispatch(A) \
  A(I64, num_experts) A(I64, slab) A(I64, fp8) A(I64, zero_unused) A(I64, check_ids) A(I64, split)
#define JAXCOMM_ATTRS_ft_all_reduce(A)
#define JAXCOMM_ATTRS_put_start(A) A(I64S, sources)
#define JAXCOMM_ATTRS_put_done(A)
#define JAXCOMM_ATTRS_moe_fp8_quantize(A)  // a local op: no common attributes either

// Appends op `name`'s own attributes to an FFI binding: BindCallAttrs(b)
// JAXCOMM_BIND_ATTRS(all_reduce) gives .Attr<int64_t>("reduce_op"). Only where
// xla/ffi/api/ffi.h is included.
#define JAXCOMM_ATTR_TYPE_I64 int64_t
#define JAXCOMM_ATTR_TYPE_I64S ::xla::ffi::Span<const int64_t>
#define JAXCOMM_BIND_ATTR_(type, name) .template Attr<JAXCOMM_ATTR_TYPE_##type>(#name)
#define JAXCOMM_BIND_ATTRS(name) JAXCOMM_ATTRS_##name(JAXCOMM_BIND_ATTR_)

// Expands `x` only for the ops a backend serves: JAXCOMM_IF_CUDA_##backends(x).
#define JAXCOMM_IF_CUDA_CPU_CUDA(...) __VA_ARGS__
#define JAXCOMM_IF_CUDA_CUDA(...) __VA_ARGS__
#define JAXCOMM_IF_CUDA_CPU(...)

// The codes of the ops' enum attributes: X(name, code, Enumerator). Python's names are
// these (jaxcomm.all_reduce(op="sum")).
//   reduce_op of all_reduce and reduce_scatter:
#define JAXCOMM_REDUCE_OPS(X) X(sum, 0, kSum) X(prod, 1, kProd) X(min, 2, kMin) X(max, 3, kMax)
//   mode of ragged_all_to_all: the forward op, and the two halves of its transpose
//   (towards `operand`; towards `output`: the rows a forward call writes, zeroed).
#define JAXCOMM_RAGGED_MODES(X) \
  X(forward, 0, kForward) X(transpose_operand, 1, kTransposeOperand) X(zero_received, 2, kZeroReceived)
//   mode of moe_transport and moe_transport_send (core/moe_modes.h says what each does):
#define JAXCOMM_MOE_MODES(X)                                                             \
  X(gather_copy, 0, kGatherCopy) X(gather_scaled, 1, kGatherScaled) X(reduce, 2, kReduce) \
  X(dot, 3, kDot) X(gather_sparse, 4, kGatherSparse) X(gather_dequant, 5, kGatherDequant) \
  X(gather_dequant_sparse, 6, kGatherDequantSparse)
//   fp8 of moe_dispatch: tokens travel in their dtype, or as FP8 delivered dequantized to
//   their dtype, or delivered as FP8 (codes and scales). Python's fp8= names these.
#define JAXCOMM_MOE_FP8(X) X(none, 0, kNone) X(dequantize, 1, kDequantize) X(raw, 2, kRaw)

// Every enum list, X(list, attribute): the attribute that carries its codes.
#define JAXCOMM_CODE_LISTS(X)                                                \
  X(JAXCOMM_REDUCE_OPS, reduce_op) X(JAXCOMM_RAGGED_MODES, ragged_mode)      \
  X(JAXCOMM_MOE_MODES, moe_mode) X(JAXCOMM_MOE_FP8, moe_fp8)

#define JAXCOMM_ENUMERATOR_(name, code, Enumerator) Enumerator = code,

namespace jaxcomm {

enum class ReduceOp : int { JAXCOMM_REDUCE_OPS(JAXCOMM_ENUMERATOR_) };
enum class RaggedMode : int { JAXCOMM_RAGGED_MODES(JAXCOMM_ENUMERATOR_) };
enum class MoeFp8 : int { JAXCOMM_MOE_FP8(JAXCOMM_ENUMERATOR_) };

// IsReduceOp(code), ReduceOpCodes() ("sum 0, prod 1, min 2, max 3"), and the same for
// RaggedMode, MoeMode and MoeFp8.
#define JAXCOMM_IS_CODE_(name, code, Enumerator) || c == code
#define JAXCOMM_APPEND_CODE_(name, code, Enumerator) s += std::string(s.empty() ? "" : ", ") + #name " " #code;
#define JAXCOMM_CODE_FUNCTIONS_(LIST, Kind)                                     \
  constexpr bool Is##Kind(int64_t c) { return false LIST(JAXCOMM_IS_CODE_); } \
  inline std::string Kind##Codes() {                                          \
    std::string s;                                                            \
    LIST(JAXCOMM_APPEND_CODE_)                                                \
    return s;                                                                 \
  }
JAXCOMM_CODE_FUNCTIONS_(JAXCOMM_REDUCE_OPS, ReduceOp)
JAXCOMM_CODE_FUNCTIONS_(JAXCOMM_RAGGED_MODES, RaggedMode)
JAXCOMM_CODE_FUNCTIONS_(JAXCOMM_MOE_MODES, MoeMode)
JAXCOMM_CODE_FUNCTIONS_(JAXCOMM_MOE_FP8, MoeFp8)
#undef JAXCOMM_CODE_FUNCTIONS_
#undef JAXCOMM_APPEND_CODE_
#undef JAXCOMM_IS_CODE_

// "" when `code` is valid, else the error naming it and the valid ones ("unknown
// reduction code 7 (valid: sum 0, ...)"): what every backend's parsing says of it. Called
// on every execution: nothing is built unless the code is unknown.
inline std::string UnknownCode(const char* what, int64_t code, const std::string& codes) {
  return "unknown " + std::string(what) + " " + std::to_string(code) + " (valid: " + codes + ")";
}
inline std::string CheckReduceOp(int64_t code) {
  return IsReduceOp(code) ? std::string() : UnknownCode("reduction code", code, ReduceOpCodes());
}
inline std::string CheckRaggedMode(int64_t code) {
  return IsRaggedMode(code) ? std::string() : UnknownCode("ragged_all_to_all mode", code, RaggedModeCodes());
}
inline std::string CheckMoeMode(int64_t code) {
  return IsMoeMode(code) ? std::string() : UnknownCode("MoE transport mode", code, MoeModeCodes());
}
inline std::string CheckMoeFp8(int64_t code) {
  return IsMoeFp8(code) ? std::string() : UnknownCode("MoE dispatch fp8 mode", code, MoeFp8Codes());
}

// The name of a reduction, for messages.
inline const char* ReduceOpName(ReduceOp op) {
#define JAXCOMM_NAME_CASE_(name, code, Enumerator) \
  case ReduceOp::Enumerator: return #name;
  switch (op) { JAXCOMM_REDUCE_OPS(JAXCOMM_NAME_CASE_) }
#undef JAXCOMM_NAME_CASE_
  return "?";
}

}  // namespace jaxcomm
