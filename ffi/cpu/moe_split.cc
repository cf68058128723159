#include "cpu/moe_split.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "core/registry.h"

namespace jaxcomm::cpu {
namespace {

// The status block's states; any other value is a Waiter* (8-byte aligned, never 0-3).
constexpr uint64_t kPending = 0, kDone = 1, kFailed = 2;

struct StatusBlock {
  uint64_t state;  // accessed with __atomic builtins only
  uint64_t data_addr, table_addr;
  uint64_t code;  // ffi::ErrorCode of a failed round
  char message[kStatusWords * 4 - 32];
};
static_assert(sizeof(StatusBlock) == kStatusWords * 4, "status block size");

// A receive half waiting for its send's round.
struct Waiter {
  ffi::Promise promise;
};

StatusBlock* Block(void* table) { return static_cast<StatusBlock*>(table); }

// Settles the receive half's future with the round's outcome.
void Settle(ffi::Promise& promise, uint64_t state, const StatusBlock& b) {
  if (state == kDone) {
    promise.SetAvailable();
  } else {
    promise.SetError(ffi::Error(static_cast<ffi::ErrorCode>(b.code), b.message));
  }
}

void Complete(void* table, const std::optional<ffi::Error>& error) {
  StatusBlock* b = Block(table);
  if (error.has_value()) {
    const std::string& why = error->message();
    const size_t n = std::min(why.size(), sizeof(b->message) - 1);
    std::memcpy(b->message, why.data(), n);
    b->message[n] = '\0';
    b->code = static_cast<uint64_t>(error->errc().value_or(ffi::ErrorCode::kInternal));
  }
  const uint64_t done = error.has_value() ? kFailed : kDone;
  const uint64_t old = __atomic_exchange_n(&b->state, done, __ATOMIC_ACQ_REL);
  if (old > kFailed) {
    // The receive half got here first and handed over its waiter: this side owns it now.
    std::unique_ptr<Waiter> waiter(reinterpret_cast<Waiter*>(old));
    Settle(waiter->promise, done, *b);
  }
}

// Copies of a call's attribute strings: the send's Launch runs after its handler returned,
// when XLA's attribute storage may be gone.
struct OwnedCommon {
  InstructionState* state;
  ffi::RunId run;
  int64_t ordinal;
  std::string op, call_site, axis;
  int64_t timeout_ms;

  explicit OwnedCommon(const Common& c)
      : state(c.state), run(c.run), ordinal(c.ordinal), op(c.op), call_site(c.call_site),
        axis(c.axis), timeout_ms(c.timeout_ms) {}
  Common view() const { return Common{state, run, ordinal, op, call_site, axis, timeout_ms}; }
};

ffi::Future MoeRecv(InstructionState* st, ffi::RunId run, int32_t ordinal, ffi::AnyBuffer data,
                    ffi::AnyBuffer table, ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> data_out,
                    ffi::Result<ffi::AnyBuffer> table_out, std::string_view call_site, std::string_view axis,
                    int64_t timeout_ms, ffi::Span<const int64_t>, int64_t, ffi::Span<const int64_t>) {
  return AwaitSend(Common{st, run, ordinal, "moe_recv", call_site, axis, timeout_ms}, data, table, *data_out,
                   *table_out);
}

}  // namespace

ffi::Future AwaitSend(const Common& c, const ffi::AnyBuffer& data, const ffi::AnyBuffer& table,
                      const ffi::AnyBuffer& data_out, const ffi::AnyBuffer& table_out) {
  if (table.size_bytes() < sizeof(StatusBlock) || table_out.untyped_data() != table.untyped_data() ||
      data_out.untyped_data() != data.untyped_data()) {
    return Reject(c, "malformed split-phase receive (its results must alias the send's)");
  }
  StatusBlock* b = Block(table.untyped_data());
  if (b->table_addr != reinterpret_cast<uint64_t>(table.untyped_data()) ||
      b->data_addr != reinterpret_cast<uint64_t>(data.untyped_data())) {
    return Reject(c, "the send half's results reached the receive half as a copy (XLA copied them "
                     "between the two halves); call send and receive in one jitted program and "
                     "use the pending value only as the receive half's argument");
  }
  auto waiter = std::make_unique<Waiter>();
  ffi::Future future(waiter->promise);
  uint64_t expected = kPending;
  if (__atomic_compare_exchange_n(&b->state, &expected, reinterpret_cast<uint64_t>(waiter.get()), false,
                                  __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    waiter.release();  // Complete() takes it back
    return future;
  }
  // The round finished before this half arrived.
  Settle(waiter->promise, expected, *b);
  return future;
}

void OpenSend(void* table, const void* data) {
  StatusBlock* b = Block(table);
  std::memset(b, 0, sizeof(*b));
  b->data_addr = reinterpret_cast<uint64_t>(data);
  b->table_addr = reinterpret_cast<uint64_t>(table);
  __atomic_store_n(&b->state, kPending, __ATOMIC_RELEASE);
}

ffi::Future LaunchSend(const Common& c, Peer mine, size_t work_bytes, WorkFn work, void* table,
                       LaunchOptions options) {
  auto owned = std::make_shared<OwnedCommon>(c);
  Registry::Get().pool().Post([owned, mine, work_bytes, work = std::move(work), table,
                               options = std::move(options)]() mutable {
    ffi::Future round = Launch(owned->view(), mine, work_bytes, std::move(work), std::move(options));
    // The round may outlive this task (streamed across processes); it reads the call's
    // strings until it ends, so they stay alive until then.
    round.OnReady([table, owned](const std::optional<ffi::Error>& error) { Complete(table, error); });
  });
  return Done();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cpu_MoeRecv, MoeRecv,
                              BindCommon(ffi::Ffi::Bind(), [](auto b) { return BindReceiveHalf(std::move(b)); })
                                  JAXCOMM_BIND_ATTRS(moe_recv));

XLA_FFI_Handler* const kMoeRecv = jaxcomm_cpu_MoeRecv;

}  // namespace jaxcomm::cpu
