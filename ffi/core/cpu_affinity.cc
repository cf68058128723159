#include "core/cpu_affinity.h"

#include <sched.h>

namespace jaxcomm {

bool LeaveCore(int cpu) {
  cpu_set_t allowed;
  if (cpu < 0 || sched_getaffinity(0, sizeof(allowed), &allowed) != 0 || !CPU_ISSET(cpu, &allowed) ||
      CPU_COUNT(&allowed) < 2) {
    return false;
  }
  cpu_set_t others = allowed;
  CPU_CLR(cpu, &others);
  if (sched_setaffinity(0, sizeof(others), &others) != 0) return false;
  sched_setaffinity(0, sizeof(allowed), &allowed);  // back to what it was: no further move
  return true;
}

int CurrentCore() { return sched_getcpu(); }

}  // namespace jaxcomm
