// This process's links to the other processes of a jax.distributed job, and the
// cross-process exchange of a round's inputs over them (core/cross_process.h).
//
// Bootstrap (driven by jaxcomm/_src/bootstrap.py through the job's key-value store): Open
// opens the transports the bootstrap names (through the factory, factory.h) and returns
// each one's endpoint; Link links one peer through the first of them, in the order
// opened, that both ends opened and that reaches it (a shared-memory transport only
// processes of this host). Links are made lazily, for the processes of the groups a
// program uses. Everything else goes through the transport interface (transport.h),
// whatever the peer's link, and chooses by what a link can do (Capabilities), except what
// works on shared memory itself (streaming, the inline exchange), which asks a link for it.
//
// An exchange first tries to finish on the calling thread, spinning for up to the spin
// budget (JAXCOMM_SPIN_US) while the peers catch up; otherwise a progress thread takes it
// over and the caller returns, so no device thread ever waits on another process (XLA
// may run independent collectives in different orders in different processes). Every
// exchange has the call's deadline; a peer that dies is noticed directly (its process is
// gone, its connection closed, its MPI requests failed) and named in the error.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/cross_process.h"
#include "cpu/transport/shm_transport.h"
#include "cpu/transport/transport.h"

namespace jaxcomm::cpu {

class PeerSpin;  // world_internal.h

// Each transport's endpoint, by the transport's name.
using Endpoints = std::map<std::string, Params>;

class World : public CrossProcess {
 public:
  World();
  ~World() override;

  // Opens this process's transports, `transports` (name and settings, in the order of
  // preference for a link), and returns their endpoints (once; later calls return the
  // same ones). `host`: this process's host key (processes with the same key share
  // memory); `label`: how messages name its host ("vm1 (10.0.0.2)").
  Endpoints Open(int64_t process, const std::string& host, const std::string& label,
                 const std::vector<std::pair<std::string, Params>>& transports, std::string* error);
  // Links process `who.process` (idempotent) through the first transport, in the order
  // opened, that both ends opened (`theirs`: the peer's endpoints) and that reaches it.
  // A restarted process (`rejoining`) links every peer itself.
  std::string Link(const PeerIdentity& who, const Endpoints& theirs, std::chrono::milliseconds timeout,
                   bool rejoining = false);
  // Stops every transport's background work (before the process's MPI is finalized).
  void Close();

  void Exchange(ExchangeSpec spec, ExchangeDone done) override;
  bool CanStream(const std::vector<int64_t>& peers) const override;
  bool CanReadDirectly(const std::vector<int64_t>& peers) const override;
  // Whether the link to `p` allows reading its memory directly (false if not linked).
  bool ReadsDirectly(int64_t p) const;
  std::string Stream(const StreamSpec& spec, const StreamConsume& consume,
                     bool* timed_out) override;  // world_stream.cc
  void Release(const ExchangePlan& plan, int64_t seq) override;
  bool Linked(int64_t p) const override;
  // Processes left out after they failed in a fault-tolerant exchange.
  std::vector<int64_t> excluded() const;
  // In a restarted process (jaxcomm.ft.rejoin): asks to be readmitted at its first
  // fault-tolerant call, then numbers that call's rounds as the survivors do.
  std::string Rejoin(uint64_t generation);
  const LinkCapabilities* LinkOf(int64_t p) const override;
  // What this process holds for its links (jaxcomm.memory()), in bytes.
  struct Held {
    size_t shm_control = 0, shm_data = 0, shm_data_used = 0, link_buffers = 0, staging = 0;
    int64_t calls = 0;  // cross-process calls holding shared-memory buffers
  };
  Held held() const;
  // Connections from strangers the transports refused (TCP's listener, tcp_link.h).
  int64_t refused_connections() const;
  std::string HostOf(int64_t p) const override;
  std::unique_ptr<InlineExchange> OpenInline(std::shared_ptr<const ExchangePlan> plan, size_t my_bytes) override;

 private:
  using Links = std::vector<std::shared_ptr<PeerTransport>>;
  struct Pending;
  class ShmInline;  // OpenInline's exchanges

  std::shared_ptr<PeerTransport> Peer(int64_t process) const;
  // The links of those of `processes` that are linked, in order.
  Links Peers(const std::vector<int64_t>& processes) const;
  // Whether any of `links` shows a thread spinning on core `cpu` (PeerSpin).
  static bool AnySpinsOn(const Links& links, int cpu);
  // Whether any of `links` goes through `transport`.
  static bool Uses(const Links& links, const Transport& transport);
  // This process's control block, or null without shared memory.
  ControlBlock* Block() const { return shm_ ? &shm_->block() : nullptr; }
  // Advances `p` as far as it goes now; true when finished (done called).
  bool Advance(Pending& p);
  // Advance on the progress thread: an exception fails `p` instead of the process.
  bool AdvanceSafely(Pending& p);
  // Checks the missing peers' health and the deadline (at most every 100 ms): true with
  // `error` when the exchange fails; a tolerant exchange leaves such peers out instead.
  bool Failure(Pending& p, std::string* error);

  // The mismatch check (core/mismatch.h). Mismatch: true with `error` when a missing
  // peer waits in another call for this process (its notice says so), which this
  // process has not published; it then keeps its own notice up, failed, and refuses the
  // peers' calls (Refused) so that they fail too.
  bool Mismatch(Pending& p, std::string* error);
  // The notice of `p`'s wait.
  WaitNotice NoticeOf(const Pending& p) const;
  // Shows this process's waits past their grace period to its peers (shared memory
  // board, TCP notice frames) when they changed; at most every 100 ms. Progress thread.
  void ShowWaits(const std::vector<std::unique_ptr<Pending>>& mine, std::chrono::steady_clock::time_point now);
  // The error of an exchange of a call this process refused after a mismatch, or "".
  std::string Refused(uint64_t key, int64_t seq);
  // Phase 2 of a tolerant exchange: the survivors tell each other whom they heard from,
  // and keep the contributions that all of them received.
  void Agree(std::shared_ptr<const ExchangePlan> plan, int64_t seq,
             std::chrono::steady_clock::time_point deadline, std::vector<const char*> blobs,
             ExchangeDone then);
  bool Excluded(int64_t process) const;
  void Exclude(int64_t process);
  // Survivors: links the restarted processes whose request to rejoin arrived.
  void PollJoins();
  // Survivors: readmits processes whose request every survivor has seen (phase 2).
  void Admit(const std::vector<int64_t>& all, const std::vector<char>& mine,
             const std::vector<const char*>& views);
  // Restarted process: true once readmitted (p's rounds renumbered) or failed (`error`).
  bool TryAdmission(Pending& p, std::string* error);
  void ReleaseRound(const ExchangePlan& plan, int64_t seq);
  struct StreamPeer;
  // The peers of stream `s`, or an error naming one not linked through shared memory.
  std::string StreamPeers(const StreamSpec& s, std::vector<StreamPeer>* peers) const;
  // A wait for `peers` (kept alive by the caller) that moves off a core one of them spins on.
  PeerSpin SpinFor(const std::vector<StreamPeer>& peers) const;
  // Stream's single-copy form (StreamSpec::pull), world_stream.cc.
  std::string Pull(const StreamSpec& spec, const StreamConsume& consume, bool* timed_out);
  // A buffer of `bytes` for the chunks Pull reads, kept from one round to the next (a
  // fresh one costs a page fault per 4 KiB).
  std::vector<char> TakeBounce(size_t bytes);
  void GiveBounce(std::vector<char> buffer);
  // Whether every link of `p` whose sends complete later (Capabilities) has sent its
  // round whole: the caller's buffers are free.
  static bool SendsDone(const Pending& p);
  void Progress();
  // Progress's loop, until stop_ or an exception; `mine`: the exchanges it holds.
  void ProgressLoop(std::vector<std::unique_ptr<Pending>>& mine);
  void Wake();

  mutable std::mutex mu_;  // peers_, pending_, the endpoint
  std::condition_variable cv_;
  int64_t process_ = -1;
  std::string host_;
  // This process's side of each transport it opened, in the order of preference (and the
  // order a round publishes through them), and the shared-memory one among them (null if
  // none). Declared before the links, which refer to them, and outlive them.
  std::vector<std::unique_ptr<Transport>> owned_;
  std::vector<Transport*> transports_;
  ShmTransport* shm_ = nullptr;
  std::map<int64_t, std::shared_ptr<PeerTransport>> peers_;
  std::set<int64_t> excluded_;
  // Some process was ever left out (excluded_ not empty once): inline exchanges then
  // defer to Exchange, which knows what to do about it.
  std::atomic<bool> ever_excluded_{false};
  std::map<int64_t, uint64_t> seen_join_;      // survivors: newest request seen, per process
  std::map<int64_t, uint64_t> admitted_join_;  // survivors: request readmitted, per process
  uint64_t joining_ = 0;                       // restarted process: its request
  std::map<uint64_t, int64_t> seq_offset_;     // restarted process: per call, survivors' numbering
  std::vector<std::unique_ptr<Pending>> pending_;
  mutable std::mutex bounce_mu_;
  std::vector<std::vector<char>> bounces_;  // Pull's spare buffers
  // The mismatch check's state: notices of waits that failed as a mismatch, shown until
  // `until`; calls refused, by (key, seq), with their error; what the board shows now,
  // and the TCP peers last sent a non-empty one.
  struct FailedNotice {
    WaitNotice notice;
    std::chrono::steady_clock::time_point until;
  };
  std::mutex mismatch_mu_;
  std::vector<FailedNotice> failed_notices_;
  std::map<std::pair<uint64_t, int64_t>, std::string> refused_;
  std::atomic<bool> any_refused_{false};  // refused_ was ever not empty (a relaxed look per exchange)
  std::vector<WaitNotice> shown_;  // progress thread
  std::set<int64_t> told_;         // progress thread
  std::chrono::steady_clock::time_point next_show_{};  // progress thread
  std::atomic<bool> show_now_{false};  // a wait failed as a mismatch: show it before next_show_
  std::string self_;  // "process 0 (host h (10.0.0.1), pid 7)", as peers describe it
  std::atomic<int> wakes_{0};
  std::atomic<bool> stop_{false};
  std::thread progress_;
};

}  // namespace jaxcomm::cpu
