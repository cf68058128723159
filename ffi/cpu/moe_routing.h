// Where every assignment of a jaxcomm.moe dispatch goes, computed from every rank's expert
// ids alone: the fused host dispatch (moe_dispatch.cc) routes inside its one collective
// call, so no count exchange precedes it and shapes never depend on the routing. Plain
// arithmetic on host arrays (no XLA, no threads), for the CUDA port to repeat.
//
// Semantics (jaxcomm/_src/moe/dispatch.py's plan() computes the same in XLA): with E_local
// = E / R, expert e lives on rank e / E_local as its local expert e % E_local. Ids in
// [0, E) are assignments; -1 is none; anything else is invalid (counted, treated as -1).
// A receiver's rows of one expert are ordered by (source rank, token, slot). Layouts:
//   packed (slab == 0): experts one after another from row 0, rows past `rows` dropped;
//   padded (slab > 0):  expert e_local's rows from e_local * slab, at most `slab` of them.
// The low-latency layout is padded with slab = R * max_tokens, which never drops.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace jaxcomm::cpu {

struct RouteShape {
  int64_t R = 0, T = 0, K = 0, E = 0;  // ranks, tokens per rank, slots per token, experts
  int64_t rows = 0;                    // expert rows of one rank's result
  int64_t slab = 0;                    // rows per expert (padded layouts); 0: packed
  int64_t El() const { return E / R; }
};

// Checks a shape's consistency; returns "" or why it is malformed.
std::string CheckRouteShape(const RouteShape& s);

// The routing of one call, for every rank of the group.
class Routing {
 public:
  // ids[s]: source rank s's [T, K] expert ids. With `check`, an invalid id fails the
  // routing: returns a message naming it (rank, token, slot, value); else "".
  std::string Build(const RouteShape& shape, const std::vector<const int32_t*>& ids, bool check);

  // Source s's slots [T * K]: the destination rank and the row there, both -1 for a slot
  // with no expert, an invalid id, or an assignment dropped for capacity.
  const int32_t* dest(int s) const { return dest_.data() + s * shape_.T * shape_.K; }
  const int32_t* pos(int s) const { return pos_.data() + s * shape_.T * shape_.K; }
  // Source s's assignments dropped for capacity, and its invalid ids.
  int32_t dropped(int s) const { return dropped_[s]; }
  int32_t invalid(int s) const { return invalid_[s]; }
  // Receiver r: rows kept per local expert (sizes[E_local]); returns the assignments that
  // arrived for its experts past capacity.
  int32_t ReceiverSizes(int r, int32_t* sizes) const;
  // Receiver r's first row of local expert `el`.
  int64_t ExpertStart(int r, int64_t el) const;

 private:
  RouteShape shape_;
  std::vector<int64_t> total_;  // [E] assignments to each expert, all sources
  std::vector<int64_t> start_;  // [E] packed layout: first row of each expert on its rank
  std::vector<int32_t> dest_, pos_;  // [R][T * K]
  std::vector<int32_t> dropped_, invalid_;  // [R]
};

}  // namespace jaxcomm::cpu
