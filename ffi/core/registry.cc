#include "core/registry.h"

#include <cstdlib>
#include <string>

namespace jaxcomm {

namespace {
constexpr int64_t kDefaultSpinUs = 50;
}

Registry::Registry() {
  int64_t spin = kDefaultSpinUs;
  if (const char* env = std::getenv("JAXCOMM_SPIN_US")) {
    try {
      spin = std::stoll(env);
    } catch (...) {
      spin = kDefaultSpinUs;  // a malformed value must not break the program; Python validates
    }
  }
  spin_us_.store(spin < 0 ? 0 : spin);
}

Registry& Registry::Get() {
  // Leaked on purpose: XLA threads may still run handlers during interpreter shutdown.
  static Registry* registry = new Registry();
  return *registry;
}

}  // namespace jaxcomm
