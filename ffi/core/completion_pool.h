// Threads that complete collectives' futures and run their data movement.
//
// Handlers return ffi::Futures and never block the device thread: XLA:CPU orders
// independent thunks differently on different devices, so a handler that blocked until
// its peers arrived deadlocked against a jax.lax collective that other devices had
// started first. Completing a Future runs that device's continuation (its following
// compute, possibly an XLA collective that blocks) inline on the completing thread, so
// each completion goes to its own pool thread: devices keep running in parallel and a
// blocked continuation never holds up another device's. The pool grows when all its
// threads are busy.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <vector>

namespace jaxcomm {

class CompletionPool {
 public:
  CompletionPool() = default;
  CompletionPool(const CompletionPool&) = delete;
  CompletionPool& operator=(const CompletionPool&) = delete;

  void Post(std::function<void()> task);
  // Posts several at once: one lock, so spinners woken by the first task do not contend
  // with the poster for the rest.
  void PostAll(std::vector<std::function<void()>> tasks);

  // How long an idle thread spins (yielding) before it sleeps.
  void set_spin(std::chrono::microseconds spin) { spin_us_.store(spin.count()); }
  int threads() const { return threads_.load(); }

 private:
  void Worker();

  static constexpr int kMaxThreads = 1024;
  // A round of R ranks hands R-1 completions to idle threads at once; spinning ones take
  // them without a futex wake (with at most 2 spinners a 4-byte all_reduce over 8 devices
  // on 2 cores took ~50 us, with 8 or more ~22 us), but a crowd of spinners left over
  // from a burst would starve the threads doing the work.
  static constexpr int kMaxSpinners = 16;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::atomic<int> queued_{0};
  int idle_ = 0;  // threads waiting for a task (spinning or sleeping)
  std::atomic<int> threads_{0};
  std::atomic<int64_t> spin_us_{200};
  std::atomic<int> spinners_{0};
  const int max_spinners_ = kMaxSpinners;
};

}  // namespace jaxcomm
