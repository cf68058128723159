#include "core/fault_injection.h"

#include <unistd.h>

#include <cstdio>
#include <sstream>
#include <thread>

#include "core/registry.h"

namespace jaxcomm {

namespace {

std::string Trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") + 1 - b);
}

bool ParseInt(const std::string& s, int64_t* v) {
  try {
    size_t used = 0;
    *v = std::stoll(s, &used);
    return used == s.size();
  } catch (...) {
    return false;
  }
}

// What a fault's `call=` counts, in words: calls, not steps (a step that runs two
// all_reduces counts two).
std::string Counted(const std::string& op, const std::string& site, int64_t partition) {
  std::string s = "rank " + std::to_string(partition) + "'s calls of " + (op.empty() ? "any op" : op);
  s += site.empty() ? " at any call site" : " at call sites containing '" + site + "'";
  return s + " since the process started, calls not steps";
}

}  // namespace

std::string FaultInjector::Parse(const std::string& one, Fault* f) {
  f->text = one;
  bool has_action = false;
  std::stringstream items(one);
  std::string item;
  while (std::getline(items, item, ',')) {
    item = Trim(item);
    if (item.empty()) continue;
    const auto eq = item.find('=');
    if (eq == std::string::npos) return "'" + item + "' is not key=value";
    const std::string key = Trim(item.substr(0, eq)), value = Trim(item.substr(eq + 1));
    if (key == "rank" || key == "partition") {
      if (!ParseInt(value, &f->partition) || f->partition < 0) return "rank must be a partition id >= 0";
    } else if (key == "process") {
      if (!ParseInt(value, &f->process) || f->process < 0) return "process must be an index >= 0";
    } else if (key == "op") {
      f->op = value;
    } else if (key == "site") {
      f->site = value;
    } else if (key == "call") {
      if (!ParseInt(value, &f->call) || f->call < 1) return "call must be a count >= 1";
    } else if (key == "action") {
      has_action = true;
      const auto colon = value.find(':');
      const std::string name = value.substr(0, colon);
      const std::string arg = colon == std::string::npos ? "" : value.substr(colon + 1);
      if (name == "hang" && arg.empty()) {
        f->action = Action::kHang;
      } else if (name == "exit") {
        f->action = Action::kExit;
        int64_t code = 17;
        if (!arg.empty() && (!ParseInt(arg, &code) || code < 0 || code > 255)) {
          return "exit takes a code in [0, 255]";
        }
        f->exit_code = static_cast<int>(code);
      } else if (name == "delay") {
        f->action = Action::kDelay;
        try {
          size_t used = 0;
          f->delay_s = std::stod(arg, &used);
          if (used != arg.size() || !(f->delay_s >= 0)) throw std::invalid_argument(arg);
        } catch (...) {
          return "delay takes seconds, e.g. delay:2.0";
        }
      } else {
        return "unknown action '" + value + "' (hang, exit[:code], delay:seconds)";
      }
    } else {
      return "unknown key '" + key + "' (rank, process, op, site, call, action)";
    }
  }
  if (!has_action) return "no action= given";
  return "";
}

FaultInjector::FaultInjector(const char* spec) {
  if (spec == nullptr) return;
  std::stringstream all(spec);
  std::string one;
  std::vector<Fault> faults;
  while (std::getline(all, one, ';')) {
    if (Trim(one).empty()) continue;
    Fault f;
    std::string err = Parse(one, &f);
    if (!err.empty()) {
      error_ = "JAXCOMM_FAULT: in '" + Trim(one) + "': " + err;
      return;
    }
    faults.push_back(std::move(f));
  }
  faults_ = std::move(faults);
}

std::optional<std::string> FaultInjector::Fire(const CallContext& call, int64_t process) {
  const Fault* fire = nullptr;
  int64_t count = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < faults_.size() && fire == nullptr; ++i) {
      const Fault& f = faults_[i];
      if (f.partition >= 0 && f.partition != call.partition) continue;
      if (f.process >= 0 && f.process != process) continue;
      if (!f.op.empty() && f.op != call.op) continue;
      if (!f.site.empty() && call.call_site.find(f.site) == std::string_view::npos) continue;
      count = ++counts_[{i, call.partition}];
      if (f.call == 0 || f.call == count) fire = &f;
    }
  }
  if (fire == nullptr) return std::nullopt;
  // The call has no execution number yet: the rendezvous assigns it when ranks meet.
  std::string where = call.Describe();
  where = where.substr(0, where.rfind(", execution #"));
  // The wall-clock time lets a reader line the fault up with its peers' flight records
  // (jaxcomm/bench/faults.py measures from it).
  const auto now_us = std::chrono::duration_cast<std::chrono::microseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  std::string what = "jaxcomm: JAXCOMM_FAULT '" + fire->text + "' fired at " + where + " (call " +
                     std::to_string(count) + " counting " + Counted(fire->op, fire->site, call.partition) +
                     ", at " + std::to_string(now_us) + " us)";
  switch (fire->action) {
    case Action::kDelay:
      std::fprintf(stderr, "%s: this rank joins the call %g s late\n", what.c_str(), fire->delay_s);
      std::fflush(stderr);
      std::this_thread::sleep_for(std::chrono::duration<double>(fire->delay_s));
      return std::nullopt;
    case Action::kExit:
      std::fprintf(stderr, "%s: exiting with code %d\n", what.c_str(), fire->exit_code);
      std::fflush(stderr);
      _exit(fire->exit_code);
    case Action::kHang:
      std::fprintf(stderr, "%s: this rank does not join the call\n", what.c_str());
      return what;
  }
  return std::nullopt;
}

std::optional<xla::ffi::Future> FaultInjector::Apply(const CallContext& call, int64_t process,
                                                     std::chrono::milliseconds timeout) {
  std::optional<std::string> hang = Fire(call, process);
  if (!hang) return std::nullopt;
  xla::ffi::Promise promise;
  xla::ffi::Future future(promise);
  // The rank's own call fails after its peers' deadline, so that their errors (which
  // name this rank) come first, and this device's program ends instead of hanging.
  Registry::Get().watchdog().Schedule(
      Clock::now() + timeout + std::chrono::seconds(1), [promise, what = *hang]() mutable {
        // Never continue a rank's program on the watchdog thread.
        Registry::Get().pool().Post([promise, what]() mutable {
          promise.SetError(xla::ffi::Error(xla::ffi::ErrorCode::kAborted,
                                           what + ": injected hang (never joined the call)"));
        });
      });
  return future;
}

std::optional<xla::ffi::Error> FaultInjector::ApplyBlocking(const CallContext& call, int64_t process,
                                                            std::chrono::milliseconds timeout) {
  std::optional<std::string> hang = Fire(call, process);
  if (!hang) return std::nullopt;
  // As Apply's future: the peers' errors, which name this rank, come first.
  std::this_thread::sleep_for(timeout + std::chrono::seconds(1));
  return xla::ffi::Error(xla::ffi::ErrorCode::kAborted, *hang + ": injected hang (never joined the call)");
}

}  // namespace jaxcomm
