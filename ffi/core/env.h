// The C++ runtime's reading of JAXCOMM_* environment variables: the only place in ffi/
// that calls getenv. Every variable read here is in jaxcomm/_src/config.py's registry
// with the same default and the same message for a malformed value
// (tests/test_config.py reads the calls from the source and checks both). A malformed
// value is never taken silently: the readers report it, and Python raises it before any
// op runs (config_errors(), runtime.ensure_registered).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace jaxcomm {
namespace env {

// The variable's text, blanks stripped; "" when unset.
std::string Text(const char* name);

// A whole number >= 0 counted in `unit`, else `fallback` (unset, empty or malformed; the
// last also appends "<name> must be a whole number of <unit>, got '<text>'" to `errors`).
int64_t Count(const char* name, const char* unit, int64_t fallback, std::vector<std::string>* errors);

// 0 or 1, else `fallback` (unset, empty, or malformed: reported as by Count).
bool Flag(const char* name, bool fallback, std::vector<std::string>* errors);

// One of `choices`, or "" when unset; a malformed value gives "" and sets `error`.
std::string Choice(const char* name, std::initializer_list<const char*> choices, std::string* error);

}  // namespace env

// Everything the C++ runtime reads from the environment once, when it starts.
struct Settings {
  int64_t spin_us = 0;
  int64_t nontemporal_bytes = 0;
  int64_t trace_entries = 0;
  bool single_copy = true;
  bool inline_rounds = true;
  bool cpu_f16c = true;
  int64_t comm_memory_mb = 0;  // JAXCOMM_COMM_MEMORY_MB
  std::string trace_dir;
  bool fault_set = false;  // JAXCOMM_FAULT (parsed by FaultInjector, which reports its errors)
  std::string fault;
  // The malformed variables, one message each (naming the variable).
  std::vector<std::string> errors;

  static Settings FromEnvironment();
};

}  // namespace jaxcomm
