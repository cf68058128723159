#include "cpu/launch.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <string>

#include "core/registry.h"

namespace jaxcomm::cpu {

ffi::ErrorOr<GroupAttrs> ParseGroupAttrs(const ffi::Dictionary& attrs, const std::string& who) {
  auto flat = attrs.get<ffi::Span<const int64_t>>("groups");
  auto size = attrs.get<int64_t>("group_size");
  auto devices = attrs.get<ffi::Span<const int64_t>>("partition_devices");
  if (!flat.has_value() || !size.has_value() || *size <= 0 ||
      static_cast<int64_t>(flat->size()) % *size != 0 || !devices.has_value() ||
      devices->size() % 2 != 0) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        who + ": custom call lacks valid 'groups'/'group_size'/'partition_devices' attributes"));
  }
  GroupAttrs a;
  for (size_t i = 0; i < devices->size(); i += 2) {
    a.partition_devices.emplace_back((*devices)[i], (*devices)[i + 1]);
  }
  for (size_t i = 0; i < flat->size(); i += *size) {
    a.groups.emplace_back(flat->begin() + i, flat->begin() + i + *size);
    for (int64_t p : a.groups.back()) {
      if (p < 0 || p >= static_cast<int64_t>(a.partition_devices.size())) {
        return ffi::Unexpected(ffi::Error::InvalidArgument(
            who + ": replica group names partition " + std::to_string(p) + " outside the mesh"));
      }
    }
  }
  return a;
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

void AdviseHugePages(void* data, size_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 2 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

Peer Buffers(const ffi::AnyBuffer& in, ffi::AnyBuffer& out,
             std::initializer_list<const ffi::AnyBuffer*> aux, bool written_whole) {
  if (written_whole) AdviseHugePages(out.untyped_data(), out.size_bytes());
  Peer p;
  p.in = in.untyped_data();
  p.in_bytes = in.size_bytes();
  p.dtype = static_cast<uint8_t>(in.element_type());
  p.elements = static_cast<int64_t>(in.element_count());
  p.out = out.untyped_data();
  int k = 0;
  for (const ffi::AnyBuffer* a : aux) {
    p.aux[k] = a->untyped_data();
    p.aux_bytes[k] = a->size_bytes();
    ++k;
  }
  return p;
}

ffi::Future Done() {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetAvailable();
  return future;
}

ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(std::move(error));
  return future;
}

CallContext Describe(const Common& c) {
  CallContext ctx;
  ctx.op = c.op;
  ctx.call_site = c.call_site;
  ctx.axis = c.axis;
  ctx.partition = c.state->table->PartitionOfOrdinal(c.ordinal);
  if (auto where = c.state->table->Locate(ctx.partition)) {
    ctx.group_index = where->first;
    ctx.rank = where->second;
    ctx.group = &c.state->table->group(where->first);
  }
  return ctx;
}

ffi::Future Reject(const Common& c, const std::string& why) {
  return Failed(ffi::Error::InvalidArgument(Describe(c).Describe() + ": " + why));
}

ReadsFn ReadsOwnBlock(size_t block) {
  return [block](int d) { return ElementRange{static_cast<size_t>(d) * block, static_cast<size_t>(d + 1) * block}; };
}

ffi::Future Launch(const Common& c, Peer mine, size_t work_bytes, WorkFn work, LaunchOptions options) {
  CollectiveCall call;
  call.ctx = Describe(c);
  if (call.ctx.rank < 0) {
    return Failed(ffi::Error::Internal(call.ctx.Describe() + ": this device (ordinal " +
                                       std::to_string(c.ordinal) +
                                       ") is in none of the instruction's replica groups"));
  }
  call.run_id = c.run.run_id;
  call.mine = mine;
  call.timeout = std::chrono::milliseconds(std::max<int64_t>(c.timeout_ms, 1));
  call.work_bytes = work_bytes;
  call.split_by_rank = options.split_by_rank;
  call.tolerant = options.tolerant;
  if (options.range) call.range = std::make_shared<const RangeFn>(std::move(options.range));
  if (options.combine) call.combine = std::make_shared<const CombineFn>(std::move(options.combine));
  call.combine_partials = options.combine_partials;
  if (options.needs) call.needs = std::make_shared<const NeedsFn>(std::move(options.needs));
  if (options.reads) call.reads = std::make_shared<const ReadsFn>(std::move(options.reads));
  call.point_to_point = options.point_to_point;
  // Injected faults first (a delayed rank arrives late, a hung one never joins),
  // then this call's flight recorder entry.
  Registry& registry = Registry::Get();
  if (registry.faults().any()) {
    if (auto hung = registry.faults().Apply(call.ctx, registry.process_index(), call.timeout)) {
      return std::move(*hung);
    }
  }
  if (FlightRecorder& rec = registry.recorder(); rec.enabled()) {
    call.mine.trace = rec.Enqueue(call.ctx.partition, rec.SiteOf(*c.state->table, call.ctx, Streamable(mine, call.range != nullptr, call.tolerant),
                                  /*hierarchical=*/MayRunInPhases(call.tolerant, call.direct(), mine.in_bytes),
                                  /*scatters=*/MayScatterGather(call.tolerant, call.combine != nullptr, mine)),
                                  call.ctx.rank,
                                  call.run_id, mine.dtype, mine.elements, static_cast<int64_t>(mine.in_bytes));
  }
  return c.state->table->Arrive(call, std::make_shared<const WorkFn>(std::move(work)));
}

}  // namespace jaxcomm::cpu
