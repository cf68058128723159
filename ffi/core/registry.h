// The one process-wide object jaxcomm keeps: services every communicator shares.
// Everything else lives in per-instruction state owned by XLA's executables.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>

#include "core/watchdog.h"

namespace jaxcomm {

class Registry {
 public:
  static Registry& Get();

  Watchdog& watchdog();

  // Counters for tests and stats: rounds completed and failed since start.
  std::atomic<int64_t> rounds_completed{0};
  std::atomic<int64_t> rounds_failed{0};

 private:
  Registry() = default;
  std::once_flag watchdog_once_;
  std::unique_ptr<Watchdog> watchdog_;  // started on first use, not at import
};

}  // namespace jaxcomm
