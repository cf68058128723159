#include "core/registry.h"

#include <algorithm>
#include <string>

namespace jaxcomm {

Registry::Registry()
    : settings_(Settings::FromEnvironment()),
      spin_us_(settings_.spin_us),
      nontemporal_bytes_(settings_.nontemporal_bytes),
      single_copy_(settings_.single_copy),
      cpu_f16c_(settings_.cpu_f16c),
      comm_memory_limit_(settings_.comm_memory_mb << 20),
      recorder_(static_cast<size_t>(settings_.trace_entries), settings_.trace_dir),
      faults_(settings_.fault_set ? settings_.fault.c_str() : nullptr) {
  set_spin(std::chrono::microseconds(settings_.spin_us));
}

void Registry::set_spin(std::chrono::microseconds us) {
  int64_t v = us.count() < 0 ? 0 : us.count();
  spin_us_.store(v);
  pool_.set_spin(std::chrono::microseconds(v));
}

Registry& Registry::Get() {
  // Leaked on purpose: XLA threads may still complete collectives during shutdown.
  static Registry* registry = new Registry();
  return *registry;
}

void Registry::AddTable(std::weak_ptr<RoundTable> table) {
  std::lock_guard<std::mutex> lock(tables_mu_);
  tables_.erase(std::remove_if(tables_.begin(), tables_.end(), [](const auto& t) { return t.expired(); }),
                tables_.end());
  tables_.push_back(std::move(table));
}

std::vector<std::shared_ptr<RoundTable>> Registry::Tables() {
  std::lock_guard<std::mutex> lock(tables_mu_);
  std::vector<std::shared_ptr<RoundTable>> out;
  for (const auto& weak : tables_) {
    if (auto t = weak.lock()) out.push_back(std::move(t));
  }
  return out;
}

uint64_t Registry::NextOccurrence(uint64_t attribute_hash) {
  std::lock_guard<std::mutex> lock(occurrences_mu_);
  return occurrences_[attribute_hash]++;
}

Watchdog& Registry::watchdog() {
  std::call_once(watchdog_once_, [this] { watchdog_ = std::make_unique<Watchdog>(); });
  return *watchdog_;
}

}  // namespace jaxcomm
