// ragged_all_to_all on the host backend: jax.lax.ragged_all_to_all's semantics, with every
// offset and size checked against the buffers before any byte moves, plus the two halves
// of its transpose, so that the gradient needs no extra exchange of offsets.
//
// Each rank publishes its four index arrays through Peer::aux; every rank's share of the
// work reads the peers' arrays directly (host buffers, one address space), so the offsets
// never take a collective of their own.
#include "cpu/ragged.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/rendezvous.h"
#include "cpu/kernels.h"
#include "cpu/launch.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {
namespace {

namespace ffi = xla::ffi;

// With N = m*R slices per rank, slice i of rank s goes to rank i / m and lands at that
// rank's output rows [output_offsets_s[i], + send_sizes_s[i]).
// The modes (core/op_table.h's RaggedMode):
//   kForward: result = output with every received slice written (later slices, in (source,
//   slice) order, overwrite earlier ones where they overlap).
//   kTransposeOperand: the transpose towards `operand`: `operand` holds the cotangent of
//   the forward result (shaped like the forward output), `output` the accumulator shaped
//   like the forward operand. Every forward slice adds the cotangent rows it is still
//   visible in (not overwritten by a later slice) back to the rows it was read from.
//   kZeroReceived: the transpose towards `output`: result = output (the cotangent) with
//   every row some forward slice wrote set to zero. `operand` is not read.

int64_t Index(const void* p, int64_t item, int64_t i) {
  return item == 8 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

struct Slice {
  int64_t src_rank, src_row, dst_row, rows;  // rows of the forward operand / output
};

// Everything one call needs to know about the group's index arrays.
struct Plan {
  int64_t R = 0, m = 0, N = 0, idx_item = 4;
  int64_t src_rows = 0, dst_rows = 0, row_bytes = 0, row_elems = 0;
  xla::ffi::DataType dtype{};
  RaggedMode mode = RaggedMode::kForward;

  // Slices of rank s, slice i (i in [0, N)).
  Slice Get(const std::vector<Peer>& peers, int64_t s, int64_t i) const {
    const Peer& p = peers[s];
    return {s, Index(p.aux[0], idx_item, i), Index(p.aux[2], idx_item, i),
            Index(p.aux[1], idx_item, i)};
  }

  // "" when every rank's offsets and sizes stay inside the buffers and the receivers'
  // recv_sizes agree with the senders' send_sizes; otherwise the first violation.
  std::string Validate(const std::vector<Peer>& peers) const {
    for (int64_t s = 0; s < R; ++s) {
      for (int64_t i = 0; i < N; ++i) {
        const Slice sl = Get(peers, s, i);
        const int64_t d = i / m;
        const int64_t recv = Index(peers[d].aux[3], idx_item, s * m + i % m);
        const bool ok = sl.rows >= 0 && sl.src_row >= 0 && sl.src_row <= src_rows - sl.rows &&
                        sl.dst_row >= 0 && sl.dst_row <= dst_rows - sl.rows && recv == sl.rows;
        if (ok) continue;
        std::ostringstream msg;
        if (sl.rows < 0) {
          msg << "send_sizes[" << i << "] = " << sl.rows << " on rank " << s << " is negative";
        } else if (sl.src_row < 0 || sl.src_row > src_rows - sl.rows) {
          msg << "rank " << s << " slice " << i << ": input_offsets = " << sl.src_row
              << ", send_sizes = " << sl.rows << " reach outside operand rows [0, " << src_rows
              << ")";
        } else if (sl.dst_row < 0 || sl.dst_row > dst_rows - sl.rows) {
          msg << "rank " << s << " slice " << i << ": output_offsets = " << sl.dst_row
              << ", send_sizes = " << sl.rows << " reach outside output rows [0, " << dst_rows
              << ") of rank " << d;
        } else {
          msg << "recv_sizes[" << s * m + i % m << "] = " << recv << " on rank " << d
              << " differs from send_sizes[" << i << "] = " << sl.rows << " on rank " << s;
        }
        return "ragged_all_to_all: " + msg.str();
      }
    }
    return "";
  }

  // The forward slices that land on rank d, in the order they are written.
  std::vector<Slice> Into(const std::vector<Peer>& peers, int64_t d) const {
    std::vector<Slice> out;
    for (int64_t s = 0; s < R; ++s) {
      for (int64_t q = 0; q < m; ++q) {
        Slice sl = Get(peers, s, d * m + q);
        if (sl.rows > 0) out.push_back(sl);
      }
    }
    return out;
  }
};

std::string RunForward(const Plan& p, const std::vector<Peer>& peers, int64_t d) {
  char* out = static_cast<char*>(peers[d].out);
  for (const Slice& sl : p.Into(peers, d)) {
    const char* in = static_cast<const char*>(peers[sl.src_rank].in);
    std::memcpy(out + sl.dst_row * p.row_bytes, in + sl.src_row * p.row_bytes,
                sl.rows * p.row_bytes);
  }
  return "";
}

std::string RunZeroReceived(const Plan& p, const std::vector<Peer>& peers, int64_t d) {
  char* out = static_cast<char*>(peers[d].out);
  for (const Slice& sl : p.Into(peers, d)) {
    std::memset(out + sl.dst_row * p.row_bytes, 0, sl.rows * p.row_bytes);
  }
  return "";
}

// Rank s's part of the operand cotangent: out_s[src rows] += t_d[dst rows], over the rows
// of each slice that no later slice into d overwrote in the forward op.
std::string RunTransposeOperand(const Plan& p, const std::vector<Peer>& peers, int64_t s) {
  char* out = static_cast<char*>(peers[s].out);
  std::vector<std::vector<Slice>> into(p.R);
  std::vector<std::pair<int64_t, int64_t>> later;
  for (int64_t i = 0; i < p.N; ++i) {
    const Slice sl = p.Get(peers, s, i);
    if (sl.rows == 0) continue;
    const int64_t d = i / p.m, q = i % p.m;
    // Later writers into d: slices (s', q') > (s, q) in (source, slice) order.
    later.clear();
    for (int64_t s2 = s; s2 < p.R; ++s2) {
      for (int64_t q2 = (s2 == s ? q + 1 : 0); q2 < p.m; ++q2) {
        const Slice o = p.Get(peers, s2, d * p.m + q2);
        const int64_t a = std::max(o.dst_row, sl.dst_row);
        const int64_t b = std::min(o.dst_row + o.rows, sl.dst_row + sl.rows);
        if (a < b) later.emplace_back(a, b);
      }
    }
    std::sort(later.begin(), later.end());
    const char* t = static_cast<const char*>(peers[d].in);
    auto add = [&](int64_t a, int64_t b) -> std::string {  // visible dst rows [a, b)
      if (a >= b) return "";
      const char* src = t + a * p.row_bytes;
      char* dst = out + (sl.src_row + (a - sl.dst_row)) * p.row_bytes;
      return Reduce(p.dtype, ReduceOp::kSum, {dst, src}, {dst}, 0, (b - a) * p.row_elems);
    };
    int64_t cursor = sl.dst_row;
    for (const auto& [a, b] : later) {
      if (a > cursor) {
        std::string err = add(cursor, a);
        if (!err.empty()) return err;
      }
      cursor = std::max(cursor, b);
    }
    std::string err = add(cursor, sl.dst_row + sl.rows);
    if (!err.empty()) return err;
  }
  return "";
}

int64_t Rows(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return d.size() == 0 ? 1 : d[0];
}

ffi::Future RaggedAllToAll(InstructionState* st, ffi::RunId run, int32_t ordinal,
                          ffi::AnyBuffer operand,
                          ffi::AnyBuffer output, ffi::AnyBuffer input_offsets,
                          ffi::AnyBuffer send_sizes, ffi::AnyBuffer output_offsets,
                          ffi::AnyBuffer recv_sizes, ffi::Result<ffi::AnyBuffer> result, std::string_view call_site,
                          std::string_view axis, int64_t timeout_ms, ffi::Span<const int64_t>,
                          int64_t group_size, ffi::Span<const int64_t>, int64_t mode, int64_t src_rows, int64_t dst_rows) {
  Common c{st, run, ordinal, "ragged_all_to_all", call_site, axis, timeout_ms};
  Plan p;
  p.R = group_size;
  if (std::string why = CheckRaggedMode(mode); !why.empty()) return Reject(c, why);
  p.mode = static_cast<RaggedMode>(mode);
  p.N = static_cast<int64_t>(input_offsets.element_count());
  const ffi::AnyBuffer* idx[4] = {&input_offsets, &send_sizes, &output_offsets, &recv_sizes};
  const auto idx_type = input_offsets.element_type();
  if (idx_type != ffi::DataType::S32 && idx_type != ffi::DataType::S64) {
    return Reject(c, "offsets and sizes must be int32 or int64");
  }
  for (const ffi::AnyBuffer* b : idx) {
    if (b->element_type() != idx_type || static_cast<int64_t>(b->element_count()) != p.N) {
      return Reject(c, "offsets and sizes must share one dtype and length");
    }
  }
  if (p.N == 0 || p.N % p.R != 0) {
    return Reject(c, "the number of slices must be a positive multiple of the group size");
  }
  p.m = p.N / p.R;
  p.idx_item = idx_type == ffi::DataType::S64 ? 8 : 4;
  p.src_rows = src_rows;
  p.dst_rows = dst_rows;
  p.dtype = result->element_type();
  const int64_t rows = Rows(*result);
  p.row_elems = rows ? static_cast<int64_t>(result->element_count()) / rows : 0;
  p.row_bytes = rows ? static_cast<int64_t>(result->size_bytes()) / rows : 0;
  // The buffers must be what the attributes say, or the bounds checks would be void.
  const int64_t expect_in = p.mode == RaggedMode::kTransposeOperand ? dst_rows : src_rows;
  const int64_t expect_out = p.mode == RaggedMode::kTransposeOperand ? src_rows : dst_rows;
  if ((p.mode != RaggedMode::kZeroReceived && Rows(operand) != expect_in) || Rows(*result) != expect_out ||
      Rows(output) != expect_out) {
    return Reject(c, "buffer shapes disagree with the call");
  }
  if (p.mode == RaggedMode::kTransposeOperand && !ReduceSupported(p.dtype, ReduceOp::kSum)) {
    return Reject(c, "the transpose needs a dtype that supports addition");
  }
  // Aliasing normally makes result == output; if XLA gave a fresh buffer, start from output.
  if (result->untyped_data() != output.untyped_data() && result->size_bytes() > 0) {
    std::memcpy(result->untyped_data(), output.untyped_data(), result->size_bytes());
  }
  const Peer mine = Buffers(operand, *result, {idx[0], idx[1], idx[2], idx[3]});
  const WorkFn work = [p](const std::vector<Peer>& peers, int part, int parts) -> std::string {
    // Every part checks everything first: all parts then agree, and nothing is written
    // unless the whole call is in bounds.
    std::string err = p.Validate(peers);
    if (!err.empty() || p.row_bytes == 0) return err;
    ForEachOwnedRank(peers, part, parts, [&](int r) {
      if (!err.empty()) return;
      switch (p.mode) {
        case RaggedMode::kForward: err = RunForward(p, peers, r); break;
        case RaggedMode::kTransposeOperand: err = RunTransposeOperand(p, peers, r); break;
        case RaggedMode::kZeroReceived: err = RunZeroReceived(p, peers, r); break;
      }
    });
    return err;
  };
  const size_t bytes = 2 * static_cast<size_t>(std::max<int64_t>(operand.size_bytes(), 0)) * p.R;
  return Launch(c, mine, bytes, std::move(work));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cpu_RaggedAllToAll, RaggedAllToAll,
                              BindCommon(ffi::Ffi::Bind(),
                                         [](auto b) { return BindBuffers<6>(std::move(b)); })
                                  JAXCOMM_BIND_ATTRS(ragged_all_to_all));

XLA_FFI_Handler* const kRaggedAllToAll = jaxcomm_cpu_RaggedAllToAll;

}  // namespace jaxcomm::cpu
