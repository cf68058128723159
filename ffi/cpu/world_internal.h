// The parts of World (world.h) that its two source files share: a peer as this process
// sees it, and an exchange in progress. world.cc moves data; world_ft.cc holds what only
// fault-tolerant exchanges do (agreeing on survivors, readmitting a restarted process).
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cpu/world.h"

namespace jaxcomm::cpu {

struct World::PeerLink {
  int64_t process = -1;
  std::string host;
  std::string host_key;  // Endpoint::host
  int pid = 0;
  std::mutex mu;  // the ShmPeer's lookup cache
  std::unique_ptr<ShmPeer> shm;
  std::unique_ptr<TcpLink> tcp;

  std::string Describe() const {
    return "process " + std::to_string(process) + " (host " + host + ", pid " + std::to_string(pid) + ")";
  }
};

struct World::Pending {
  ExchangeSpec spec;
  ExchangeDone done;
  std::vector<std::shared_ptr<PeerLink>> links;
  std::vector<const char*> blobs;
  std::vector<bool> left_out;  // tolerant exchanges: peers given up on
  bool awaiting_admission = false;  // a restarted process before the survivors readmit it
  bool join_posted = false;
  size_t settled = 0;          // peers gathered or left out
  bool published = false;
  std::chrono::steady_clock::time_point next_check{};
};

// Why process `pid` on this host is gone, or "" while it runs.
std::string ProcessGone(int pid);
// One step of waiting for a peer process that is likely running on another core.
void SpinStep(int& step);

// How often a waiting exchange checks that its peers still live, and when first.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(100);
constexpr auto kFirstLivenessCheck = std::chrono::milliseconds(5);

}  // namespace jaxcomm::cpu
