// Moving a thread off a busy core.
//
// Linux wakes a sleeping thread on the waker's CPU when every CPU is busy at that moment,
// and the woken thread preempts its waker; when the other CPU goes idle a moment later,
// neither of the two just-run ("cache hot") threads is pulled over to it for several
// milliseconds. A round's poster wakes a pool thread to share its work, so the two took
// turns on one CPU while the other idled (on the 2-core development VM, one CPU idled
// through 31% of a decode-size MoE combine loop; 9% once the helper leaves), and a
// thread woken to wait for a peer process stayed on the core that peer spins on.
#pragma once

namespace jaxcomm {

// Moves the calling thread off core `cpu` now, to another core it may run on, and leaves
// it free to run wherever it could before (its affinity is restored at once); false when
// it may run nowhere else or the system refuses.
bool LeaveCore(int cpu);

// The core the calling thread runs on, or -1 when the system does not say.
int CurrentCore();

}  // namespace jaxcomm
