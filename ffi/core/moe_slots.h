// Which of a token's (destination, row) slots an MoE combine reads, and in what order:
// shared by the host backend's combine (ffi/cpu/moe_kernels.cc) and the CUDA kernels
// (ffi/cuda/kernel_logic.h), so that both sum a token's rows in one order and give the
// same bits. Host and device code (JAXCOMM_HD); no CUDA or XLA header.
#pragma once

#include <cstdint>

#include "core/number_formats.h"  // JAXCOMM_HD

namespace jaxcomm::moe_slots {

// Whether slot (d, row) is one a kernel acts on: a rank of the group, a row of the buffer.
JAXCOMM_HD bool SlotOk(int64_t d, int64_t row, int64_t R, int64_t rows) {
  return d >= 0 && d < R && row >= 0 && row < rows;
}

// The slots of one token that move a row, in k order: to any rank (self < 0) or only to
// `self`. Writes (d, row, weight) of each into the out arrays; returns how many.
JAXCOMM_HD int StageSlots(const int32_t* d, const int32_t* row, const float* w, int64_t K,
                          int64_t R, int64_t rows, int64_t self, int* out_d, int* out_row,
                          float* out_w) {
  int n = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (!SlotOk(d[k], row[k], R, rows) || (self >= 0 && d[k] != self)) continue;
    out_d[n] = d[k];
    out_row[n] = row[k];
    out_w[n] = w != nullptr ? w[k] : 0.f;
    ++n;
  }
  return n;
}

// The same slots ordered by destination rank, then k: the order kReduce sums them in.
JAXCOMM_HD int StageSlotsByRank(const int32_t* d, const int32_t* row, const float* w, int64_t K,
                                int64_t R, int64_t rows, int* out_d, int* out_row, float* out_w) {
  int n = 0;
  for (int64_t rank = 0; rank < R; ++rank) {
    for (int64_t k = 0; k < K; ++k) {
      if (d[k] != rank || !SlotOk(d[k], row[k], R, rows)) continue;
      out_d[n] = d[k];
      out_row[n] = row[k];
      out_w[n] = w != nullptr ? w[k] : 0.f;
      ++n;
    }
  }
  return n;
}

}  // namespace jaxcomm::moe_slots
