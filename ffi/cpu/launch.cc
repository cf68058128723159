#include "cpu/launch.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <string>

#include "core/registry.h"

namespace jaxcomm::cpu {

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

CallResult Launch(const Common& c, Peer mine, size_t work_bytes, WorkFn work, LaunchOptions options) {
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
  call.range = std::move(options.range);
  call.combine = std::move(options.combine);
  call.combine_partials = options.combine_partials;
  call.needs = std::move(options.needs);
  call.reads = std::move(options.reads);
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
  return c.state->table->Arrive(call, std::move(work));
}

}  // namespace jaxcomm::cpu
