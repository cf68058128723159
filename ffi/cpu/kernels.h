// Host data-movement kernels: reductions over the ranks' buffers and strided block copies.
// They read peers' buffers in place (the host backend is zero-copy between devices).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/op_table.h"  // ReduceOp, ReduceOpName
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {

// For i in [begin, end): every outputs[k][i] = op over j of inputs[j][i] (in rank order).
// Half-precision types accumulate in float and round once. Safe when an output aliases an
// input: each block is read from every input before any output is written.
// With `streaming`, outputs are written with non-temporal stores (cpu/result_stores.h).
// Returns "" or why the dtype/op pair is not supported.
std::string Reduce(xla::ffi::DataType dtype, ReduceOp op, const std::vector<const void*>& inputs,
                   const std::vector<void*>& outputs, size_t begin, size_t end, bool streaming = false);

// Whether Reduce supports this pair (checked once per call, before any rank waits).
bool ReduceSupported(xla::ffi::DataType dtype, ReduceOp op);

// A block of an N-d array, described by its shape and the byte strides of the source and
// destination arrays it sits in. Compile() folds contiguous dimensions together so that
// the innermost copy is one memcpy as long as possible.
struct BlockCopy {
  std::vector<int64_t> shape;
  std::vector<int64_t> src_strides;
  std::vector<int64_t> dst_strides;
  int64_t item_bytes = 1;

  void Compile();
  // With `streaming`, pieces of 4 KiB and more bypass the caches (cpu/result_stores.h).
  void Run(const char* src, char* dst, bool streaming = false) const;
};

// Row-major byte strides of `dims`.
std::vector<int64_t> RowMajorStrides(const std::vector<int64_t>& dims, int64_t item_bytes);

}  // namespace jaxcomm::cpu
