// This process's links to the other processes of a jax.distributed job, and the
// cross-process exchange of a round's inputs over them (core/cross_process.h).
//
// Bootstrap (driven by jaxcomm/_src/transport.py through the job's key-value store): Open
// creates this process's endpoint (a shared-memory control block and a TCP listener on an
// ephemeral port); Link connects one peer, through shared memory when it runs on the same
// host, else TCP. Links are made lazily, for the processes of the groups a program uses.
//
// An exchange first tries to finish on the calling thread, spinning for up to the spin
// budget (JAXCOMM_SPIN_US) while the peers catch up; otherwise a progress thread takes it
// over and the caller returns, so no device thread ever waits on another process (XLA
// may run independent collectives in different orders in different processes). Every
// exchange has the call's deadline; a peer that dies is noticed directly (its process is
// gone, or its TCP connection closed) and named in the error.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/cross_process.h"
#include "cpu/shm_link.h"
#include "cpu/tcp_link.h"

namespace jaxcomm::cpu {

struct Endpoint {
  int pid = 0;
  int control_fd = -1;  // -1: no shared memory (TCP only)
  size_t control_bytes = 0;
  int port = 0;
};

class World : public CrossProcess {
 public:
  World();
  ~World() override;

  // Creates this process's endpoint (once; later calls return the same one).
  Endpoint Open(int64_t process, bool shared_memory, std::string* error);
  // Links peer `process`: through its shared memory when `peer.control_fd >= 0` and both
  // ends agreed on it, else TCP to host:port (the lower process index connects).
  std::string Link(int64_t process, const std::string& host, const Endpoint& peer, bool shared_memory,
                   std::chrono::milliseconds timeout);

  void Exchange(ExchangeSpec spec, ExchangeDone done) override;
  void Release(uint64_t key, int64_t seq, const std::vector<int64_t>& peers) override;
  bool Linked(int64_t p) const override;
  std::string LinkKind(int64_t p) const override;  // [trace]

 private:
  struct PeerLink;
  struct Pending;

  std::shared_ptr<PeerLink> Peer(int64_t process) const;
  // Advances `p` as far as it goes now; true when finished (done called or to be called).
  bool Advance(Pending& p);
  std::string Failure(Pending& p);
  void Progress();
  void Wake();

  mutable std::mutex mu_;  // peers_, pending_, the endpoint
  std::condition_variable cv_;
  int64_t process_ = -1;
  std::unique_ptr<ShmOwner> shm_;
  std::unique_ptr<TcpListener> listener_;
  std::map<int64_t, std::shared_ptr<PeerLink>> peers_;
  std::vector<std::unique_ptr<Pending>> pending_;
  std::atomic<int> wakes_{0};
  std::atomic<bool> stop_{false};
  std::thread progress_;
};

}  // namespace jaxcomm::cpu
