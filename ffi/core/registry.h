// The one process-wide object jaxcomm keeps: settings and counters every communicator
// shares. Everything else lives in per-instruction state owned by XLA's executables.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace jaxcomm {

class Registry {
 public:
  static Registry& Get();

  // How long a rank spins (yielding) before it sleeps while waiting for its peers.
  std::chrono::microseconds spin() const { return std::chrono::microseconds(spin_us_.load(std::memory_order_relaxed)); }
  void set_spin(std::chrono::microseconds us) { spin_us_.store(us.count(), std::memory_order_relaxed); }

  // This process's index in the job (jax.process_index()), set when handlers register.
  int64_t process_index() const { return process_index_.load(std::memory_order_relaxed); }
  void set_process_index(int64_t i) { process_index_.store(i, std::memory_order_relaxed); }

  // Rounds completed and failed since start (tests, stats).
  std::atomic<int64_t> rounds_completed{0};
  std::atomic<int64_t> rounds_failed{0};

 private:
  Registry();
  std::atomic<int64_t> spin_us_;
  std::atomic<int64_t> process_index_{0};
};

}  // namespace jaxcomm
