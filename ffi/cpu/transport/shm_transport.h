// The shared-memory transport (transport.h) between processes of one host, over the
// control blocks and slots of shm_link.h.
//
// A round is published once: this process copies its contribution into its own slot of
// the call (two buffers, by the round's parity) and raises the slot's `published`; every
// peer reads it there, then raises `done` in its own slot of the call, so this process
// may overwrite that buffer two rounds later. A peer that waits on its progress thread
// is woken by a ring of its doorbell.
//
// Streaming (world_stream.cc) and the inline exchange (world.cc) work on the slots
// themselves: they reach them through PeerTransport::shared_memory().
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cpu/transport/factory.h"
#include "cpu/transport/shm_link.h"
#include "cpu/transport/transport.h"

namespace jaxcomm::cpu {

// Why process `pid` on this host is gone, or "" while it runs.
std::string ProcessGone(int pid);

// Which of a slot's two buffers round `seq` uses.
inline size_t Parity(int64_t seq) { return static_cast<size_t>(seq & 1); }

class ShmPeerTransport;

// This process's side: its control block and data segments.
class ShmTransport final : public Transport {
 public:
  // Creates this process's (index `process`) control block; with single copy on, lets
  // its peers read its memory (PR_SET_PTRACER). nullptr and `error` on failure.
  static std::unique_ptr<ShmTransport> Create(int64_t process, std::string* error);
  // The factory's entry (factory.h): no settings.
  static std::unique_ptr<Transport> Make(const TransportContext& context, const Params& settings, std::string* error);

  ShmOwner& owner() const { return *owner_; }
  ControlBlock& block() const { return owner_->block(); }
  // Links process `pid` of this host, whose control block is open there as `control_fd`:
  // maps it, and (single copy on, `probe`) probes whether this process may read its
  // memory directly. nullptr and `error` on failure.
  std::shared_ptr<ShmPeerTransport> Link(int pid, int control_fd, size_t control_bytes, std::string* error,
                                         bool probe = true);
  // Copies `mine` into buffer Parity(seq) of `slot` (its data at `data`) and publishes round
  // `seq` there.
  static void PublishInto(SlotEntry& slot, char* data, int64_t seq, const Parts& mine) {
    char* dst = data + Parity(seq) * slot.bytes;
    for (const auto& [ptr, n] : mine) {
      if (n > 0) std::memcpy(dst, ptr, n);
      dst += n;
    }
    slot.published.store(seq, std::memory_order_release);
  }

  const Capabilities& caps() const override;
  // {control_fd, control_bytes}: its control block, which a peer of this host opens
  // through /proc/<pid>/fd (the pid comes with the peer's identity).
  Params Endpoint() const override;
  std::shared_ptr<PeerTransport> Link(const LinkRequest& request, std::string* error) override;
  ShmTransport* shared_memory() override { return this; }
  std::string Publish(const Outgoing& round, const Parts& mine) override;
  void Release(uint64_t key, int64_t seq) override;
  void ShowWaits(const std::vector<WaitNotice>& notices) override;
  std::string SkipRounds(uint64_t key, uint64_t fingerprint, size_t bytes, int64_t last) override;
  // The requests restarted processes of this host wrote into this process's control block.
  std::vector<Rejoiner> Joins(const std::vector<int64_t>& candidates,
                              const std::function<bool(int64_t, uint64_t)>& wanted) override;

 private:
  explicit ShmTransport(std::unique_ptr<ShmOwner> owner) : owner_(std::move(owner)) {}
  std::unique_ptr<ShmOwner> owner_;
};

// The link to a peer of this host: its control block and data segments, mapped here.
class ShmPeerTransport final : public PeerTransport {
 public:
  // `direct`: this process may read the peer's memory with process_vm_readv.
  ShmPeerTransport(ShmTransport& local, std::unique_ptr<ShmPeer> peer, bool direct)
      : local_(local), peer_(std::move(peer)), direct_(direct) {}

  // What streaming and the inline exchange use.
  // The peer's process id (process_vm_readv).
  int pid() const { return peer_->pid(); }
  // Whether this process may read the peer's memory directly (probed when linked).
  bool reads_directly() const { return direct_; }
  // The peer's slot of `key`, or nullptr while it has not made it (slots never move).
  const SlotEntry* Slot(uint64_t key);
  // Where `slot`'s data is mapped here (mapped on first use); nullptr and `error`.
  const char* Data(const SlotEntry& slot, std::string* error);
  // Wakes the peer's progress thread if it waits for its peers.
  void Ring() { cpu::Ring(peer_->block().bell); }

  Transport& local() const override { return local_; }
  ShmPeerTransport* shared_memory() override { return this; }
  bool MayPublish(uint64_t key, int64_t seq) override;
  std::string Send(const Outgoing& round, const Parts& parts) override;
  bool Delivered(uint64_t key, int64_t seq) override;
  bool Find(uint64_t key, int64_t seq, uint64_t fingerprint, uint64_t bytes, Arrival* arrival,
            std::string* error) override;
  void Release(uint64_t key, int64_t seq) override;
  std::pair<int64_t, std::vector<char>> Newest(uint64_t key) override;
  std::string Failure() override { return ProcessGone(pid()); }
  std::vector<WaitNotice> Notices() override { return peer_->Waits(); }
  std::string ShowWaits(const std::vector<WaitNotice>& notices,
                        std::chrono::steady_clock::time_point deadline) override;
  bool SpinsOn(int cpu) const override;
  void RequestJoin(int64_t process, uint64_t generation, std::chrono::steady_clock::time_point deadline) override;

 private:
  ShmTransport& local_;
  std::mutex mu_;  // peer_'s lookup cache and mappings
  const std::unique_ptr<ShmPeer> peer_;
  const bool direct_;
};

}  // namespace jaxcomm::cpu
