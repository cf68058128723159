#include "core/registry.h"

#include <mutex>

namespace jaxcomm {

Registry& Registry::Get() {
  // Leaked on purpose: XLA may still complete futures from its threads during interpreter
  // shutdown, after static destructors would have run.
  static Registry* registry = new Registry();
  return *registry;
}

Watchdog& Registry::watchdog() {
  std::call_once(watchdog_once_, [this] { watchdog_ = std::make_unique<Watchdog>(); });
  return *watchdog_;
}

}  // namespace jaxcomm
