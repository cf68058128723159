#include "core/env.h"

#include <cstdlib>

namespace jaxcomm {
namespace env {
namespace {

std::string Strip(const char* s) {
  std::string v = s == nullptr ? std::string() : std::string(s);
  const auto first = v.find_first_not_of(" \t\n\r\f\v");
  if (first == std::string::npos) return "";
  return v.substr(first, v.find_last_not_of(" \t\n\r\f\v") - first + 1);
}

// Python's int() of the text, for the digits jaxcomm accepts: an optional sign, then
// decimal digits only.
bool ParseInt(const std::string& text, int64_t* out) {
  size_t i = text[0] == '-' || text[0] == '+' ? 1 : 0;
  if (i == text.size() || text.size() > 19) return false;
  int64_t v = 0;
  for (size_t j = i; j < text.size(); ++j) {
    if (text[j] < '0' || text[j] > '9') return false;
    v = v * 10 + (text[j] - '0');
  }
  *out = text[0] == '-' ? -v : v;
  return true;
}

}  // namespace

std::string Text(const char* name) { return Strip(std::getenv(name)); }

int64_t Count(const char* name, const char* unit, int64_t fallback, std::vector<std::string>* errors) {
  const std::string text = Text(name);
  if (text.empty()) return fallback;
  int64_t v = 0;
  if (!ParseInt(text, &v)) {
    errors->push_back(std::string(name) + " must be a whole number of " + unit + ", got '" + text + "'");
    return fallback;
  }
  if (v < 0) {
    errors->push_back(std::string(name) + " must be >= 0, got " + std::to_string(v));
    return fallback;
  }
  return v;
}

bool Flag(const char* name, bool fallback, std::vector<std::string>* errors) {
  const std::string text = Text(name);
  if (text.empty()) return fallback;
  if (text != "0" && text != "1") {
    errors->push_back(std::string(name) + " must be 0 or 1, got '" + text + "'");
    return fallback;
  }
  return text == "1";
}

std::string Choice(const char* name, std::initializer_list<const char*> choices, std::string* error) {
  const std::string text = Text(name);
  if (text.empty()) return "";
  std::string listed;
  for (const char* c : choices) {
    if (text == c) return text;
    listed += std::string(listed.empty() ? "" : ", ") + "'" + c + "'";
  }
  // As Python prints a tuple: ('nccl',) or ('auto', 'tcp').
  *error = std::string(name) + " must be one of (" + listed + (choices.size() == 1 ? ",)" : ")") +
           ", got '" + text + "'";
  return "";
}

}  // namespace env

Settings Settings::FromEnvironment() {
  Settings s;
  // Spinning 200 us before sleeping took a 4-byte all_reduce over 8 devices on 2 cores
  // from ~110 us (sleep at once) to ~17 us.
  s.spin_us = env::Count("JAXCOMM_SPIN_US", "microseconds", 200, &s.errors);
  s.nontemporal_bytes = env::Count("JAXCOMM_NONTEMPORAL_BYTES", "bytes", 4 << 20, &s.errors);
  s.trace_entries = env::Count("JAXCOMM_TRACE_ENTRIES", "calls", 2048, &s.errors);
  s.single_copy = env::Flag("JAXCOMM_SINGLE_COPY", true, &s.errors);
  s.inline_rounds = env::Flag("JAXCOMM_INLINE", true, &s.errors);
  s.cpu_f16c = env::Flag("JAXCOMM_CPU_F16C", true, &s.errors);
  s.comm_memory_mb = env::Count("JAXCOMM_COMM_MEMORY_MB", "MiB", 1024, &s.errors);
  s.trace_dir = env::Text("JAXCOMM_TRACE_DIR");
  const char* fault = std::getenv("JAXCOMM_FAULT");
  s.fault_set = fault != nullptr;
  s.fault = s.fault_set ? fault : "";
  return s;
}

}  // namespace jaxcomm
