// Split-phase MoE calls on the host backend (jaxcomm.moe.dispatch_send / dispatch_recv,
// combine_send / combine_recv): the send half publishes this rank's buffers and returns at
// once; the data movement runs when every rank has sent, on jaxcomm's threads, into the
// send's own results; the receive half completes when it is done. XLA runs the program's
// independent work in between.
//
// How the halves find each other without a shared key (Python-chosen ids are not unique
// after jit inlining): through the data. A send's second result (its "table") begins with
// a status block the send writes before returning; the receive half takes the send's
// results as operands (aliased to its own results, so nothing is copied) and reads the
// block: a one-shot handoff, lock-free like ffi::Future's own. The block records the
// addresses it was written at, so a receive that was handed a copy fails loudly instead
// of waiting on a block nobody completes.
//
// Lifetimes: the receive half also takes every operand the send published (x, ids, ...)
// as operands, so XLA keeps them alive until the data movement is over: a receive
// completes only when the whole round is done, i.e. when no peer reads this rank's
// buffers any more. Deadlines: the round's own (watchdog, cross-process exchange) bound
// the wait; the receive adds none.
#pragma once

#include <cstdint>

#include "cpu/launch.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {

// Size of the status block at the start of a split call's table, in int32 words (the
// Python side reserves as many: jaxcomm/_src/moe/split.py STATUS_WORDS).
constexpr int64_t kStatusWords = 128;

// Writes the status block (pending, and the addresses of the send's results) at `table`.
void OpenSend(void* table, const void* data);

// Launch() on a pool thread: returns at once, even on the last rank to arrive (whose
// thread would otherwise run the data movement). The round's outcome goes to the status
// block at `table`, completing the receive half waiting on it.
ffi::Future LaunchSend(const Common& c, Peer mine, size_t work_bytes, WorkFn work, void* table,
                       LaunchOptions options = {});

// The receive half's wait (moe_recv, and put_done of cpu/put.h): checks that the results
// alias the send's (`data`, `table`) and completes when the send's round is over.
ffi::Future AwaitSend(const Common& c, const ffi::AnyBuffer& data, const ffi::AnyBuffer& table,
                      const ffi::AnyBuffer& data_out, const ffi::AnyBuffer& table_out);

// The receive half: operands (data, table, keep-alive operands...), results (data, table)
// aliased to the first two operands.
extern XLA_FFI_Handler* const kMoeRecv;

}  // namespace jaxcomm::cpu
