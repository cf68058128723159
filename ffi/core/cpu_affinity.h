// Keeping a round's helper thread off the CPU its poster runs on.
//
// Linux wakes a sleeping thread on the waker's CPU when every CPU is busy at that
// moment, and the woken thread preempts the waker. When the other CPU goes idle a moment
// later, neither of the two just-run ("cache hot") threads is pulled over to it for
// several milliseconds. A round's poster wakes a pool thread to share its work, so both
// ended up taking turns on one CPU while the other idled: on the 2-core development VM,
// one CPU idled through 31% of a decode-size MoE combine loop (9% with this).
#pragma once

#include <sched.h>

namespace jaxcomm {

// While alive, keeps the calling thread off `cpu` if it runs there now (and other CPUs
// are allowed to it); restores the thread's CPU mask on destruction.
class AwayFromCpu {
 public:
  explicit AwayFromCpu(int cpu) {
    if (cpu < 0 || sched_getcpu() != cpu) return;
    if (sched_getaffinity(0, sizeof(saved_), &saved_) != 0) return;
    cpu_set_t others = saved_;
    CPU_CLR(cpu, &others);
    if (CPU_COUNT(&others) == 0) return;
    moved_ = sched_setaffinity(0, sizeof(others), &others) == 0;
  }
  ~AwayFromCpu() {
    if (moved_) sched_setaffinity(0, sizeof(saved_), &saved_);
  }
  AwayFromCpu(const AwayFromCpu&) = delete;
  AwayFromCpu& operator=(const AwayFromCpu&) = delete;

 private:
  cpu_set_t saved_{};
  bool moved_ = false;
};

}  // namespace jaxcomm
