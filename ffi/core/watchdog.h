// One thread that fires deadlines. Collectives complete asynchronously (the last rank to
// arrive does the work and completes everyone's ffi::Future), so no thread is left waiting
// that could notice a rank that never comes: the watchdog does, and fails the round.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

namespace jaxcomm {

using Clock = std::chrono::steady_clock;

class Watchdog {
 public:
  using Callback = std::function<void()>;

  Watchdog();
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Runs `fire` on the watchdog thread at `deadline` unless cancelled first.
  // `fire` must not call back into the watchdog.
  uint64_t Schedule(Clock::time_point deadline, Callback fire);
  // Returns true when the entry was still pending (its callback will never run).
  bool Cancel(uint64_t id);

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  uint64_t next_id_ = 1;
  // When the thread next wakes up by itself (max before it first sleeps).
  Clock::time_point wake_at_ = Clock::time_point::max();
  std::set<std::pair<Clock::time_point, uint64_t>> by_deadline_;
  std::map<uint64_t, std::pair<Clock::time_point, Callback>> entries_;
  std::thread thread_;  // last: starts after the members it uses exist
};

}  // namespace jaxcomm
