// Mismatched collectives: the ranks of a group waiting in different calls (another op,
// call site or instruction, or programs dispatched in different orders), each side
// waiting for the other. Without a check they would wait until the deadline; with it,
// every side fails within the grace period with a MISMATCH error naming both.
//
// Nothing is added to a round that completes: a wait is only looked at once it has
// lasted the grace period (JAXCOMM_MISMATCH_GRACE_S, at most a tenth of the call's
// timeout), on the thread that already watches it: the watchdog for ranks of one
// process (RoundTable), the progress thread for other processes (cpu/world.cc).
//
// * Within a process, the watchdog looks at every round still waiting for local ranks
//   (RoundTable::Waiting): when the ranks this round waits for wait in another round
//   that waits for ranks of this one, and both waited the grace period, it fails all
//   the rounds of that cycle at once (FindCycle).
// * Across processes, a process whose exchange waited the grace period publishes a
//   WaitNotice (which call, which execution, which processes it still waits for) where
//   its peers already look: its shared-memory control block, or a notice frame on each
//   TCP link. A waiting process then reads its missing peers' notices: a peer that
//   waits in another call for this process, in a call this process has not published,
//   is the other side of a mismatch. The first process to see it fails its call, keeps
//   its notice up for a while (marked failed, naming the peers' calls: no evidence
//   against any other), and refuses the call the peer waits in when it gets there, so
//   that the peer fails too instead of completing with it.
//
// A false alarm needs a cycle of waits that outlasts the grace period and resolves
// after it: ranks that reach independent collectives seconds apart, in different
// orders, each blocked meanwhile. Raise the grace period for such programs, or turn
// the check off (0).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace jaxcomm {

// The grace period of a call with deadline `timeout`: the configured one
// (Registry::mismatch_grace), at most a tenth of the timeout; zero: no check.
std::chrono::milliseconds MismatchGrace(std::chrono::milliseconds timeout);

// One side of a mismatch: who waits, and in which call.
struct MismatchSide {
  std::string who;  // "process 1 (host h, pid 7) with ranks [1] (partitions [1])", or "ranks [..] (..)"
  std::string op, call_site;
  int64_t execution = 0;
  bool here = false;  // the call the error is raised in
};

// The error of a mismatch between `sides` (the call it is raised in among them):
// "MISMATCH: <who> waits in <op> at <call site> (execution #N, this call); <who> waits
// in ...; each side waits for the other ...". Parsed by jaxcomm/trace/causes.py.
std::string MismatchMessage(const std::vector<MismatchSide>& sides, std::chrono::milliseconds grace,
                            bool processes);

// What a process publishes of one cross-process wait that lasted the grace period: a
// plain record, the same in shared memory and on the wire.
struct WaitNotice {
  static constexpr int kProcessWords = 16;  // processes 0..1023 (beyond: never matched)
  static constexpr uint32_t kFailed = 1;    // the wait failed as a mismatch

  uint64_t key = 0;  // the exchange plan's key (ExchangePlan::key)
  int64_t seq = 0;   // its round
  uint32_t flags = 0;
  uint32_t reserved = 0;
  char op[32] = {};
  char call_site[160] = {};
  char ranks[96] = {};  // the publisher's ranks in the call, "ranks [0] (partitions [0])"
  uint64_t missing[kProcessWords] = {};  // the processes it still waits for
  // A failed notice: the calls of the other sides, (key, seq). A peer counts it only
  // while it waits in one of them: it is no evidence against any later call.
  static constexpr int kAgainst = 4;
  uint64_t against_key[kAgainst] = {};
  int64_t against_seq[kAgainst] = {};

  void Miss(int64_t process) {
    if (process >= 0 && process < 64 * kProcessWords) missing[process / 64] |= uint64_t{1} << (process % 64);
  }
  bool Against(uint64_t k, int64_t s) const {
    for (int i = 0; i < kAgainst; ++i) {
      if (against_key[i] == k && against_seq[i] == s) return true;
    }
    return false;
  }
  bool Misses(int64_t process) const {
    return process >= 0 && process < 64 * kProcessWords && (missing[process / 64] >> (process % 64) & 1) != 0;
  }
  // Copies `s` into `field`, cut to fit, always terminated.
  template <size_t N>
  static void Put(char (&field)[N], const std::string& s) {
    const size_t n = s.size() < N - 1 ? s.size() : N - 1;
    std::memcpy(field, s.data(), n);
    field[n] = '\0';
  }
  // A notice read from a peer may lack its terminators: cut them in.
  void Terminate() {
    op[sizeof(op) - 1] = call_site[sizeof(call_site) - 1] = ranks[sizeof(ranks) - 1] = '\0';
  }
};

// Notices a process shows at most (its waits past the grace period, then its recent
// failed ones).
constexpr int kMaxWaitNotices = 16;

// A round of one process waiting for some of its local ranks, as the watchdog's
// check sees it (RoundTable::Waiting).
struct LocalWait {
  const void* table = nullptr;  // the RoundTable
  const void* round = nullptr;  // the Round
  std::pair<int64_t, int64_t> key;  // (run id, group index)
  std::string who;  // its arrived ranks, "ranks [0 1] (partitions [0 1])"
  std::string op, call_site;
  int64_t execution = 0;
  std::vector<int64_t> arrived, missing;  // partitions
  std::chrono::steady_clock::time_point since;
  std::chrono::milliseconds grace{0};
};

// The rounds of `waits` in a cycle with waits[self] (each waits for partitions arrived
// in the next), self first, when such a cycle exists among the waits past their grace
// period at `now` (then the rounds of the cycle that began later are in it too); empty
// when none.
std::vector<size_t> FindCycle(const std::vector<LocalWait>& waits, size_t self,
                              std::chrono::steady_clock::time_point now);

}  // namespace jaxcomm
