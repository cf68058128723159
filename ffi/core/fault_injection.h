// Fault injection (JAXCOMM_FAULT), for tests and for rehearsing failures: make one rank
// hang, die or run late at a chosen collective call, and see what the timeouts, the
// flight recorder and the analyzer report.
//
//   JAXCOMM_FAULT="rank=3,op=all_reduce,call=5,action=hang"
//   JAXCOMM_FAULT="process=1,op=all_gather,call=2,action=exit;rank=0,action=delay:0.5"
//
// Keys of one fault (faults are separated by ';'; every key is optional but `action`):
//   rank=P      partition id (the global SPMD device index, as in the flight recorder)
//   process=I   process index (jax.process_index()) in a multi-process job
//   op=NAME     the jaxcomm op (all_reduce, all_gather, reduce_scatter, all_to_all,
//               ppermute, broadcast, ragged_all_to_all, moe_transport)
//   site=TEXT   only calls whose call site ("file.py:12 (fn)") contains TEXT
//   call=N      the rank's N-th matching call (1-based, counted per rank over the calls
//               the other keys select, from the process's start: calls, not steps; a
//               step with two all_reduces counts two); without it, every matching call
//   action=     hang: the rank never joins the call; its peers time out naming it, and
//                     its own call fails one second after that deadline (nothing hangs
//                     forever);
//               exit[:CODE]: the process exits at once (_exit, default code 17);
//               delay:SECONDS: the rank sleeps that long before joining.
// The variable is read once, when the runtime starts.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/call_context.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

class FaultInjector {
 public:
  explicit FaultInjector(const char* spec);

  // Why the specification was rejected ("" when it parsed; then nothing is injected).
  const std::string& error() const { return error_; }
  bool any() const { return !faults_.empty(); }

  // Applies the faults that select this call, before it joins its peers: sleeps for a
  // delay, exits for an exit, and for a hang returns the future the call must return
  // instead of joining.
  std::optional<xla::ffi::Future> Apply(const CallContext& call, int64_t process,
                                        std::chrono::milliseconds timeout);
  // The same at the same point of a handler that returns its status instead of a future
  // (the CUDA backend's, which only enqueue): a hang blocks the calling thread until one
  // second after its peers' deadline and returns the error its call then fails with.
  std::optional<xla::ffi::Error> ApplyBlocking(const CallContext& call, int64_t process,
                                               std::chrono::milliseconds timeout);

 private:
  enum class Action { kHang, kExit, kDelay };
  struct Fault {
    int64_t partition = -1;
    int64_t process = -1;
    std::string op, site;
    int64_t call = 0;  // 0: every matching call
    Action action = Action::kHang;
    double delay_s = 0;
    int exit_code = 17;
    std::string text;  // as written, for messages
  };
  static std::string Parse(const std::string& one, Fault* f);
  // Finds the fault that selects this call and carries out a delay or an exit; for a hang,
  // returns what fired (for its messages), else nullopt.
  std::optional<std::string> Fire(const CallContext& call, int64_t process);

  std::string error_;
  std::vector<Fault> faults_;
  std::mutex mu_;
  std::map<std::pair<size_t, int64_t>, int64_t> counts_;  // (fault, partition) -> calls
};

}  // namespace jaxcomm
