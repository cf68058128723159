#include "core/call_attrs.h"

#include "core/registry.h"

namespace jaxcomm {

ffi::ErrorOr<GroupAttrs> MakeGroupAttrs(ffi::Span<const int64_t> groups, int64_t group_size,
                                        ffi::Span<const int64_t> partition_devices,
                                        const std::string& who) {
  if (group_size <= 0 || static_cast<int64_t>(groups.size()) % group_size != 0 ||
      partition_devices.size() % 2 != 0) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        who + ": custom call lacks valid 'groups'/'group_size'/'partition_devices' attributes"));
  }
  GroupAttrs a;
  for (size_t i = 0; i < partition_devices.size(); i += 2) {
    a.partition_devices.emplace_back(partition_devices[i], partition_devices[i + 1]);
  }
  for (size_t i = 0; i < groups.size(); i += group_size) {
    a.groups.emplace_back(groups.begin() + i, groups.begin() + i + group_size);
    for (int64_t p : a.groups.back()) {
      if (p < 0 || p >= static_cast<int64_t>(a.partition_devices.size())) {
        return ffi::Unexpected(ffi::Error::InvalidArgument(
            who + ": replica group names partition " + std::to_string(p) + " outside the mesh"));
      }
    }
  }
  return a;
}

ffi::ErrorOr<GroupAttrs> ParseGroupAttrs(const ffi::Dictionary& attrs, const std::string& who) {
  auto flat = attrs.get<ffi::Span<const int64_t>>("groups");
  auto size = attrs.get<int64_t>("group_size");
  auto devices = attrs.get<ffi::Span<const int64_t>>("partition_devices");
  if (!flat.has_value() || !size.has_value() || !devices.has_value()) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        who + ": custom call lacks valid 'groups'/'group_size'/'partition_devices' attributes"));
  }
  return MakeGroupAttrs(*flat, *size, *devices, who);
}

uint64_t InstructionKey(std::string_view call_site, std::string_view axis,
                        ffi::Span<const int64_t> groups) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](std::string_view bytes) {
    for (unsigned char ch : bytes) h = (h ^ ch) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
  };
  mix(call_site);
  mix(axis);
  mix(std::string_view(reinterpret_cast<const char*>(groups.begin()), groups.size() * sizeof(int64_t)));
  return h ^ (Registry::Get().NextOccurrence(h) * 0x9e3779b97f4a7c15ull);
}

std::vector<int64_t> Dims(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return std::vector<int64_t>(d.begin(), d.end());
}

int64_t Product(const std::vector<int64_t>& v, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t i = from; i < to && i < v.size(); ++i) p *= v[i];
  return p;
}

}  // namespace jaxcomm
