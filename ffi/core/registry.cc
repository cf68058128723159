#include "core/registry.h"

#include <cstdlib>
#include <string>

namespace jaxcomm {

namespace {
// Yield-spinning this long took a 4-byte all_reduce over 8 threads on 2 cores from
// ~110 us (sleep at once) to ~17 us; a rank still waiting after it sleeps.
constexpr int64_t kDefaultSpinUs = 200;
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
