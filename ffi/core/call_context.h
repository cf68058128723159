// What identifies one collective call in error messages: the op, the group, the call site
// and execution count, and which rank is speaking. Every error jaxcomm raises is built
// from one of these, so that a failure in a job of many ranks names its place.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace jaxcomm {

struct CallContext {
  std::string_view op;         // e.g. "all_reduce"
  std::string_view call_site;  // "file.py:12 (fn)", from the Python API
  std::string_view axis;       // axis names as the user wrote them, e.g. "('dp', 'ep')"
  const std::vector<int64_t>* group = nullptr;  // partition ids of the group members
  int64_t group_index = 0;
  int rank = -1;               // rank within the group
  int64_t partition = -1;      // global partition id (SPMD device index)
  int64_t execution = 0;       // how many times this instruction ran for this group

  std::string Describe() const {
    std::ostringstream s;
    s << "jaxcomm." << op << " over axis " << axis << " (group " << group_index << " = partitions [";
    if (group != nullptr) {
      for (size_t i = 0; i < group->size(); ++i) s << (i ? " " : "") << (*group)[i];
    }
    s << "]), rank " << rank << " (partition " << partition << "), call site " << call_site
      << ", execution #" << execution;
    return s.str();
  }
};

}  // namespace jaxcomm
