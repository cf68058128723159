#include "cpu/launch.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>

#include "core/registry.h"

namespace jaxcomm::cpu {

std::vector<int64_t> Dims(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return std::vector<int64_t>(d.begin(), d.end());
}

int64_t Product(const std::vector<int64_t>& v, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t i = from; i < to && i < v.size(); ++i) p *= v[i];
  return p;
}

Peer Buffers(const ffi::AnyBuffer& in, void* out, std::initializer_list<const ffi::AnyBuffer*> aux) {
  Peer p;
  p.in = in.untyped_data();
  p.in_bytes = in.size_bytes();
  p.dtype = static_cast<uint8_t>(in.element_type());  // [trace]
  p.elements = static_cast<int64_t>(in.element_count());
  p.out = out;
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

namespace {

// [trace] The flight recorder's description of this call's instruction and group, made
// once per instruction and group (then found lock-free).
const TraceSite* Site(const Common& c, const CallContext& ctx) {
  FlightRecorder& recorder = Registry::Get().recorder();
  const RoundTable& table = *c.state->table;
  const int g = static_cast<int>(ctx.group_index);
  if (const TraceSite* s = recorder.FindSite(&table, table.instruction_key(), g)) return s;
  auto site = std::make_unique<TraceSite>();
  site->table = &table;
  site->instruction = table.instruction_key();
  site->group_index = g;
  site->op = std::string(ctx.op);
  site->axis = std::string(ctx.axis);
  site->call_site = std::string(ctx.call_site);
  site->group = table.group(g);
  const std::vector<int64_t>& remote = table.remote_processes(g);
  site->processes = remote;
  site->processes.push_back(Registry::Get().process_index());
  std::sort(site->processes.begin(), site->processes.end());
  bool shm = false, tcp = false;
  if (const CrossProcess* world = Registry::Get().cross_process()) {
    for (int64_t p : remote) {
      const std::string kind = world->LinkKind(p);
      shm |= kind == "shm";
      tcp |= kind == "tcp";
    }
  }
  site->algorithm = remote.empty() ? "in-process zero-copy"
                    : shm && tcp   ? "shm+tcp"
                    : shm          ? "shm"
                    : tcp          ? "tcp"
                                   : "cross-process (not linked)";
  return recorder.AddSite(std::move(site));
}

}  // namespace

ffi::Future Launch(const Common& c, Peer mine, size_t work_bytes, WorkFn work) {
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
  // [trace] Injected faults first (a delayed rank arrives late, a hung one never joins),
  // then this call's flight recorder entry.
  Registry& registry = Registry::Get();
  if (registry.faults().any()) {
    if (auto hung = registry.faults().Apply(call.ctx, registry.process_index(), call.timeout)) {
      return std::move(*hung);
    }
  }
  if (registry.recorder().enabled()) {
    call.mine.trace = registry.recorder().Enqueue(call.ctx.partition, Site(c, call.ctx), call.ctx.rank,
                                                  call.run_id, mine.dtype, mine.elements,
                                                  static_cast<int64_t>(mine.in_bytes));
  }
  return c.state->table->Arrive(call, std::make_shared<const WorkFn>(std::move(work)));
}

}  // namespace jaxcomm::cpu
