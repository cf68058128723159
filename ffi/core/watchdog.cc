#include "core/watchdog.h"

#include <vector>

#include "core/thread_name.h"

namespace jaxcomm {

Watchdog::Watchdog()
    : thread_([this] {
        NameThisThread("jaxcomm-watch");
        Loop();
      }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

uint64_t Watchdog::Schedule(Clock::time_point deadline, Callback fire) {
  bool earliest;
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_id_++;
    // Wake the thread only if it would otherwise sleep past this deadline: a round
    // scheduled and cancelled per call must not cost a context switch per call.
    earliest = deadline < wake_at_;
    by_deadline_.emplace(deadline, id);
    entries_.emplace(id, std::make_pair(deadline, std::move(fire)));
  }
  if (earliest) cv_.notify_one();
  return id;
}

bool Watchdog::Cancel(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return false;
  by_deadline_.erase({it->second.first, id});
  entries_.erase(it);
  return true;
}

void Watchdog::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (by_deadline_.empty()) {
      wake_at_ = Clock::now() + std::chrono::seconds(1);  // idle: nothing is due
      cv_.wait_until(lock, wake_at_);
      continue;
    }
    auto [deadline, id] = *by_deadline_.begin();
    if (Clock::now() < deadline) {
      wake_at_ = deadline;
      cv_.wait_until(lock, deadline);
      continue;
    }
    wake_at_ = Clock::time_point::min();  // busy: firing
    by_deadline_.erase(by_deadline_.begin());
    auto it = entries_.find(id);
    Callback fire = std::move(it->second.second);
    entries_.erase(it);
    lock.unlock();
    fire();  // outside the lock: it takes the round table's lock and completes futures
    lock.lock();
  }
}

}  // namespace jaxcomm
