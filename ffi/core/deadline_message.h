// The words of a collective's deadline, shared by every backend: a call whose peers never
// arrived fails with the same message on the host backend (core/rendezvous.cc) and on the
// CUDA backend's routes (ffi/cuda/peers.cc, watcher.cc), so that tests, users and the
// flight recorder's analyzer (jaxcomm/trace/analyzer.py reads "timed out" and "arrived too
// late") see one text whichever code ran. The caller prefixes CallContext::Describe().
#pragma once

#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace jaxcomm {

// "timed out after 2 s (timeout_s / JAXCOMM_TIMEOUT_S) waiting for ranks [3] (partitions
// [11]), which never arrived at this call; 7 of 8 ranks did. Ranks that skip ..."
// `missing`: ranks (in the group) that did not arrive; `group`: the group's partitions in
// rank order; `arrived`: how many ranks did.
inline std::string NeverArrivedMessage(std::chrono::milliseconds timeout, const std::vector<int>& missing,
                                       const std::vector<int64_t>& group, size_t arrived) {
  std::ostringstream msg;
  msg << "timed out after " << timeout.count() / 1000.0 << " s (timeout_s / JAXCOMM_TIMEOUT_S) waiting for ranks [";
  for (size_t i = 0; i < missing.size(); ++i) msg << (i ? ", " : "") << missing[i];
  msg << "] (partitions [";
  for (size_t i = 0; i < missing.size(); ++i) {
    const int r = missing[i];
    msg << (i ? ", " : "");
    if (r >= 0 && static_cast<size_t>(r) < group.size()) {
      msg << group[r];
    } else {
      msg << "?";
    }
  }
  msg << "]), which never arrived at this call; " << arrived << " of " << group.size()
      << " ranks did. Ranks that skip a collective (e.g. under a lax.cond whose predicate "
         "differs by rank) or run different programs cause this.";
  return msg.str();
}

// What a rank that comes after its peers gave up on the call (timed out) is told.
inline constexpr std::string_view kArrivedTooLate =
    "the other ranks of this call already gave up on it (timed out); this rank arrived too late";

}  // namespace jaxcomm
