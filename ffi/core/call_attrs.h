// The attributes every jaxcomm custom call carries (set by jaxcomm/_src/primitive.py's
// lower_collective), and what both backends derive from them: the replica groups, where
// each partition runs, the instruction's identity across processes, and shape helpers.
// The host handlers (cpu/) and the CUDA handlers (cuda/) both parse them here.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/op_table.h"  // each op's own attributes (JAXCOMM_BIND_ATTRS)
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// Binds the attributes every jaxcomm custom call carries, in this order: call_site (str),
// axis (str), timeout_ms (int64), groups (int64 span), group_size (int64),
// partition_devices (int64 span). Both backends' handlers bind them through this.
template <typename B>
auto BindCallAttrs(B&& b) {
  return std::forward<B>(b)
      .template Attr<std::string_view>("call_site")
      .template Attr<std::string_view>("axis")
      .template Attr<int64_t>("timeout_ms")
      .template Attr<ffi::Span<const int64_t>>("groups")
      .template Attr<int64_t>("group_size")
      .template Attr<ffi::Span<const int64_t>>("partition_devices");
}

// The replica groups and (process, device ordinal) per partition of one instruction,
// checked: every group member names a partition of the mesh.
struct GroupAttrs {
  std::vector<std::vector<int64_t>> groups;
  std::vector<std::pair<int64_t, int64_t>> partition_devices;
};

// From the typed attributes `groups` (flattened, `group_size` per group) and
// `partition_devices` (flattened pairs); `who` prefixes errors.
ffi::ErrorOr<GroupAttrs> MakeGroupAttrs(ffi::Span<const int64_t> groups, int64_t group_size,
                                        ffi::Span<const int64_t> partition_devices,
                                        const std::string& who);
// The same from an attribute dictionary (the host backend's instantiate stage).
ffi::ErrorOr<GroupAttrs> ParseGroupAttrs(const ffi::Dictionary& attrs, const std::string& who);

// Identifies an instruction in every process of the job alike: its attributes that are
// the same everywhere (not partition_devices, whose local ordinals differ by process),
// and how many instructions with those attributes this process instantiated before
// (Registry::NextOccurrence). Every process instantiates shared programs in one order.
uint64_t InstructionKey(std::string_view call_site, std::string_view axis,
                        ffi::Span<const int64_t> groups);

std::vector<int64_t> Dims(const ffi::AnyBuffer& b);
int64_t Product(const std::vector<int64_t>& v, size_t from, size_t to);

}  // namespace jaxcomm
