// The index, routing and layout computations of the CUDA backend, as functions that nvcc
// compiles for the device (kernels.cu) and any C++ compiler for the host: the handlers
// use the layout plans, and the extension module exposes them all to the tests
// (ffi/cuda/logic_host.h), which check them in CI, without a GPU, against the host
// backend's results. No CUDA or XLA header here: this file builds without a toolkit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/number_formats.h"  // JAXCOMM_HD, and the conversions the kernels share with the host's
#include "core/moe_slots.h"
#include "core/op_table.h"

namespace jaxcomm::cuda::logic {

// ----------------------------------------------------------------------------- codes

// The op table's reduction codes and ragged_all_to_all modes (core/op_table.h); the
// handlers reject any other code when they instantiate.
using ::jaxcomm::RaggedMode;
using ::jaxcomm::ReduceOp;

// --------------------------------------------------------------------------- routing
//
// jaxcomm/_src/moe/dispatch.py's plan(fused=True), per assignment: rank r's slot k of
// token t chose expert v. Every rank has E/R experts (El); the flat expert buffer of a
// rank has `rows` rows: packed (experts back to back, as many rows as arrive until
// `rows`) or padded (slabs of rows/El rows per expert).

// Whether `id` names an expert; -1 means "no expert", anything else outside [0, E) is
// an invalid id (counted, treated as -1).
JAXCOMM_HD bool IsExpert(int64_t id, int64_t E) { return id >= 0 && id < E; }
JAXCOMM_HD bool IsInvalidId(int64_t id, int64_t E) { return id != -1 && !IsExpert(id, E); }

struct Place {
  int32_t dest;  // destination rank, or -1 (no expert, or dropped)
  int32_t row;   // row in the destination's expert buffer, or -1
  bool dropped;  // a valid assignment that did not fit (capacity)
};

// Where assignment to expert `v` lands. `local_rank`: its rank among this rank's
// assignments to v in (t, k) order; `before`: assignments to v from ranks below this
// one; `start`: v's first row at its rank (packed layout, ExpertStart).
JAXCOMM_HD Place PlaceAssignment(int64_t v, int64_t E, int64_t El, int64_t local_rank,
                                 int64_t before, int64_t start, int64_t rows, bool padded) {
  if (!IsExpert(v, E)) return Place{-1, -1, false};
  int64_t row;
  bool kept;
  if (padded) {
    const int64_t slab = rows / El, slot = before + local_rank;
    row = (v % El) * slab + slot;
    kept = slot < slab;
  } else {
    row = start + before + local_rank;
    kept = row < rows;
  }
  if (!kept) return Place{-1, -1, true};
  return Place{static_cast<int32_t>(v / El), static_cast<int32_t>(row), false};
}

// Packed layout: expert e's first row at its rank, from every expert's total arrivals.
template <typename Totals>
JAXCOMM_HD int64_t ExpertStart(const Totals& total, int64_t e, int64_t El) {
  int64_t start = 0;
  for (int64_t f = (e / El) * El; f < e; ++f) start += total[f];
  return start;
}

// Rows of expert e that its rank keeps (the group sizes it returns), of `total` arriving.
JAXCOMM_HD int64_t KeptRows(bool padded, int64_t total, int64_t start, int64_t rows, int64_t El) {
  if (padded) {
    const int64_t slab = rows / El;
    return total < slab ? total : slab;
  }
  const int64_t hi = start + total < rows ? start + total : rows;
  const int64_t lo = start < rows ? start : rows;
  return hi - lo;
}

// ------------------------------------------------------------------------ MoE slots
//
// The MoE transport kernels stage each token's slot table (dest, pos, w of its K slots)
// and decide which slots move data and in which order; kReduce sums slots by
// destination rank, each rank's slots in k order (ffi/cpu/moe_kernels.cc's order).

// Which of a token's slots a combine reads, and in what order: core/moe_slots.h (the host
// backend's combine sums in the same order).
using ::jaxcomm::moe_slots::SlotOk;
using ::jaxcomm::moe_slots::StageSlots;
using ::jaxcomm::moe_slots::StageSlotsByRank;

// ------------------------------------------------------------------------- FP8
//
// LaunchFp8Quantize: one warp per (token, 128-channel block); lane `lane` holds channels
// lane + 32 i of the block (coalesced), the block's amax is the warp's integer maximum
// of their MagnitudeBits (core/number_formats.h), then every lane encodes its channels.
constexpr int kFp8PerLane = static_cast<int>(kFp8Block / 32);

// Loads lane `lane`'s channels of a block of `n` channels into v (zeros past n); returns
// their largest MagnitudeBits.
template <typename In>
JAXCOMM_HD uint32_t Fp8LoadLane(const typename In::Storage* block, int64_t n, int lane, float* v) {
  uint32_t amax = 0;
  for (int i = 0; i < kFp8PerLane; ++i) {
    const int64_t h = i * 32 + lane;
    v[i] = h < n ? In::Load(block[h]) : 0.f;
    const uint32_t m = MagnitudeBits(v[i]);
    amax = m > amax ? m : amax;
  }
  return amax;
}

// Stores lane `lane`'s channels' FP8 codes.
JAXCOMM_HD void Fp8StoreLane(const float* v, int64_t n, int lane, float multiplier, uint8_t* block) {
  for (int i = 0; i < kFp8PerLane; ++i) {
    const int64_t h = i * 32 + lane;
    if (h < n) block[h] = static_cast<uint8_t>(Fp8Encode(v[i], multiplier));
  }
}

// -------------------------------------------------------------------- ragged_all_to_all
//
// One rank's ragged_all_to_all (ffi/cpu/ragged.cc with R = 1): slice i moves send_sizes[i]
// rows from operand row input_offsets[i] to result row output_offsets[i]. The offsets
// stay on the device (int32 or int64), read through an IndexView.

struct IndexView {
  const void* data;
  int bytes;  // 4 or 8
  JAXCOMM_HD int64_t operator[](int64_t i) const {
    return bytes == 8 ? static_cast<const int64_t*>(data)[i] : static_cast<const int32_t*>(data)[i];
  }
};

// Whether slice (io, ss, oo, rs) is in bounds and its receive size agrees. A call with
// any slice that is not writes nothing.
JAXCOMM_HD bool SliceValid(int64_t io, int64_t ss, int64_t oo, int64_t rs, int64_t src_rows,
                           int64_t dst_rows) {
  return ss >= 0 && io >= 0 && io <= src_rows - ss && oo >= 0 && oo <= dst_rows - ss && rs == ss;
}

// The last slice (in order) that writes result row j, or -1: later slices win overlaps.
JAXCOMM_HD int64_t LastCover(IndexView send_sizes, IndexView output_offsets, int64_t n, int64_t j) {
  int64_t last = -1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ss = send_sizes[i], oo = output_offsets[i];
    if (ss > 0 && oo <= j && j < oo + ss) last = i;
  }
  return last;
}

// The operand row that result row j comes from through slice i (j inside slice i).
JAXCOMM_HD int64_t SourceRow(IndexView input_offsets, IndexView output_offsets, int64_t i, int64_t j) {
  return input_offsets[i] + j - output_offsets[i];
}

// ----------------------------------------------------------------------- copy plans
//
// Collectives whose operand is split along an inner dimension move "outer" rows of a
// piece each: strided (2D) copies. cudaMemcpy2DAsync refuses a pitch above the device's
// maximum (cudaDevAttrMaxPitch, 2^31 - 1 bytes on current GPUs), which a large
// all_gather or all_to_all reaches; such a copy is split into one copy per row.

// `height` rows of `width` bytes; row i goes from src + i*spitch to dst + i*dpitch.
// Offsets are relative to buffers the caller names.
struct Copy2D {
  size_t dst, dpitch, src, spitch, width, height;
};

// Calls emit(copy) for the copies that carry out `c` within `max_pitch`: none when it is
// empty, one contiguous copy (height 1) when its rows are back to back on both sides,
// `c` itself when both pitches fit, else one copy per row.
template <typename Emit>
void PlanCopy(const Copy2D& c, size_t max_pitch, Emit&& emit) {
  if (c.width == 0 || c.height == 0) return;
  if (c.height == 1 || (c.dpitch == c.width && c.spitch == c.width)) {
    emit(Copy2D{c.dst, c.width * c.height, c.src, c.width * c.height, c.width * c.height, 1});
    return;
  }
  if (c.dpitch <= max_pitch && c.spitch <= max_pitch) {
    emit(c);
    return;
  }
  for (size_t i = 0; i < c.height; ++i) {
    emit(Copy2D{c.dst + i * c.dpitch, c.width, c.src + i * c.spitch, c.width, c.width, 1});
  }
}

// An operand [outer, n, inner...] split into R blocks along dimension `axis` of size n:
// `outer` rows per block of `piece` bytes each (the block's part of one outer index).
struct Split {
  size_t outer = 1, piece = 0;
};
// dims[0..ndim) of `item`-byte elements, split R ways along `axis` (dims[axis] % R == 0).
inline Split SplitAlong(const int64_t* dims, size_t ndim, size_t axis, size_t R, size_t item) {
  Split s;
  size_t below = item;
  for (size_t i = 0; i < ndim; ++i) {
    if (i < axis) s.outer *= static_cast<size_t>(dims[i]);
    if (i > axis) below *= static_cast<size_t>(dims[i]);
  }
  s.piece = (axis < ndim ? static_cast<size_t>(dims[axis]) / R : 1) * below;
  return s;
}

// Block d of an operand split by `s` (R blocks): its rows, at piece d of each outer row,
// copied to (or from) a contiguous block. `to_block`: operand -> block d, whose bytes
// start at `block_at`; otherwise block d -> operand.
inline Copy2D BlockCopy(const Split& s, size_t R, size_t d, size_t block_at, bool to_block) {
  const size_t strided = d * s.piece, pitch = R * s.piece;
  return to_block ? Copy2D{block_at, s.piece, strided, pitch, s.piece, s.outer}
                  : Copy2D{strided, pitch, block_at, s.piece, s.piece, s.outer};
}

}  // namespace jaxcomm::cuda::logic
