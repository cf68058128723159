// The parts of World (world.h) that its source files share: an exchange in progress, a
// peer of a streamed round, and how threads wait for peers. world.cc moves data;
// world_ft.cc holds what only fault-tolerant exchanges do (agreeing on survivors,
// readmitting a restarted process); world_mismatch.cc the mismatch check;
// world_stream.cc streaming.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cpu/transport/world.h"

namespace jaxcomm::cpu {

// A peer of a streamed round (world_stream.cc) as this process sees it.
struct World::StreamPeer {
  std::shared_ptr<PeerTransport> link;  // keeps `shm` alive
  ShmPeerTransport* shm = nullptr;      // link->shared_memory()
  const SlotEntry* slot = nullptr;  // its slot for the round, once it made it
  const char* data = nullptr;       // that slot's data (the ring), once mapped
  size_t first = 0;                 // its first rank among the round's remote ranks
  size_t ranks = 0;
  std::string desc;                 // the process, with its ranks
};

struct World::Pending {
  ExchangeSpec spec;
  ExchangeDone done;
  Links links;
  std::vector<const char*> blobs;
  std::vector<bool> left_out;  // tolerant exchanges: peers given up on
  bool awaiting_admission = false;  // a restarted process before the survivors readmit it
  bool join_posted = false;
  size_t settled = 0;          // peers gathered or left out
  bool published = false;
  std::chrono::steady_clock::time_point next_check{};
  std::chrono::steady_clock::time_point start{};
  std::chrono::milliseconds grace{0};  // the mismatch check's (core/mismatch.h); 0: none
};

// Waits for peer processes, which are likely running on other cores, by spinning: a
// couple of pause instructions per step, the caller checking in between, and every
// 128th step a yield, so that with more runnable threads than cores the peer gets the
// core. Two processes that spin for each other can still end up on one core while
// another idles: the scheduler does not move a thread that never stops running, and
// they then take turns at every yield (a 4 B all_reduce between 2 processes on 2 cores
// took 20-35 us instead of 3, a 1 KiB one 30-90 us). So at its yields a waiting thread
// shows its core in its process's control block, and when a peer it waits for spins on
// that same core, it moves to another core it may run on (its affinity is unchanged
// after). Only where each process of the host can have a core of its own.
class PeerSpin {
 public:
  // Whether a peer process waited for shows that it spins on core `cpu`.
  using SharesCore = std::function<bool(int cpu)>;
  // `mine`: this process's control block (null without shared memory: plain spinning).
  PeerSpin(ControlBlock* mine, SharesCore shares_core);
  ~PeerSpin() { Stop(); }
  PeerSpin(const PeerSpin&) = delete;
  PeerSpin& operator=(const PeerSpin&) = delete;
  void Step();
  // The wait is over (for now): no longer shows this thread's core.
  void Stop();

 private:
  ControlBlock* mine_;
  SharesCore shares_core_;
  int step_ = 0;
  bool shown_ = false;
};

// How often a waiting exchange checks that its peers still live, and when first.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(100);
constexpr auto kFirstLivenessCheck = std::chrono::milliseconds(5);

}  // namespace jaxcomm::cpu
