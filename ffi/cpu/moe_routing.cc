#include "cpu/moe_routing.h"

#include <algorithm>

namespace jaxcomm::cpu {

std::string CheckRouteShape(const RouteShape& s) {
  if (s.R < 1 || s.T < 0 || s.K < 0 || s.E < 1 || s.E % s.R != 0) {
    return "num_experts must be a positive multiple of the group size";
  }
  if (s.slab < 0 || s.rows < 0 || (s.slab > 0 && s.rows != s.El() * s.slab)) {
    return "the expert rows disagree with the layout";
  }
  // Rows are int32 in the route tables.
  if (s.rows > INT32_MAX || s.R * s.T * s.K > INT32_MAX) return "more rows than int32 indexes";
  return "";
}

std::string Routing::Build(const RouteShape& shape, const std::vector<const int32_t*>& ids, bool check) {
  shape_ = shape;
  const int64_t R = shape.R, E = shape.E, El = shape.El(), TK = shape.T * shape.K;
  std::vector<int32_t> counts(static_cast<size_t>(R * E), 0);  // [source][expert]
  invalid_.assign(R, 0);
  for (int64_t s = 0; s < R; ++s) {
    int32_t* c = counts.data() + s * E;
    for (int64_t i = 0; i < TK; ++i) {
      const int32_t e = ids[s][i];
      if (e >= 0 && e < E) {
        ++c[e];
      } else if (e != -1) {
        if (check) {
          return "expert id " + std::to_string(e) + " of token " + std::to_string(i / shape.K) + ", slot " +
                 std::to_string(i % shape.K) + " on rank " + std::to_string(s) + " is outside [-1, " +
                 std::to_string(E) + ") (check_ids=True)";
        }
        ++invalid_[s];
      }
    }
  }
  total_.assign(E, 0);
  for (int64_t s = 0; s < R; ++s) {
    for (int64_t e = 0; e < E; ++e) total_[e] += counts[s * E + e];
  }
  start_.assign(E, 0);
  for (int64_t e = 0; e < E; ++e) {
    start_[e] = e % El == 0 ? 0 : start_[e - 1] + total_[e - 1];
  }
  dest_.assign(static_cast<size_t>(R * TK), -1);
  pos_.assign(static_cast<size_t>(R * TK), -1);
  dropped_.assign(R, 0);
  // before[e]: assignments to e from the sources already placed (ranks below s), plus,
  // while s is placed, its own earlier slots: the (source, token, slot) order.
  std::vector<int64_t> before(E, 0);
  for (int64_t s = 0; s < R; ++s) {
    int32_t* dest = dest_.data() + s * TK;
    int32_t* pos = pos_.data() + s * TK;
    for (int64_t i = 0; i < TK; ++i) {
      const int32_t e = ids[s][i];
      if (e < 0 || e >= E) continue;
      const int64_t slot = before[e]++;
      int64_t row;
      bool kept;
      if (shape.slab > 0) {
        row = (e % El) * shape.slab + slot;
        kept = slot < shape.slab;
      } else {
        row = start_[e] + slot;
        kept = row < shape.rows;
      }
      if (kept) {
        dest[i] = static_cast<int32_t>(e / El);
        pos[i] = static_cast<int32_t>(row);
      } else {
        ++dropped_[s];
      }
    }
  }
  return "";
}

int32_t Routing::ReceiverSizes(int r, int32_t* sizes) const {
  const int64_t El = shape_.El();
  int64_t arrived = 0, kept = 0;
  for (int64_t el = 0; el < El; ++el) {
    const int64_t e = r * El + el, total = total_[e];
    int64_t n;
    if (shape_.slab > 0) {
      n = std::min(total, shape_.slab);
    } else {
      n = std::clamp<int64_t>(start_[e] + total, 0, shape_.rows) - std::clamp<int64_t>(start_[e], 0, shape_.rows);
    }
    sizes[el] = static_cast<int32_t>(n);
    arrived += total;
    kept += n;
  }
  return static_cast<int32_t>(arrived - kept);
}

int64_t Routing::ExpertStart(int r, int64_t el) const {
  return shape_.slab > 0 ? el * shape_.slab : std::min(start_[r * shape_.El() + el], shape_.rows);
}

}  // namespace jaxcomm::cpu
