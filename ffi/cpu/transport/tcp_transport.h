// The TCP transport (transport.h), over the connections of tcp_link.h: one per pair of
// processes, on different hosts or anywhere with JAXCOMM_TRANSPORT=tcp.
//
// Each peer gets its own frame of a round (PeerTransport::Send), so this process's side
// publishes nothing itself; its listener takes the peers' connections (tcp_link.h says
// what it checks of them). Of two processes, the lower index connects to the other
// (a restarted process connects to every peer itself).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cpu/transport/factory.h"
#include "cpu/transport/tcp_link.h"
#include "cpu/transport/transport.h"

namespace jaxcomm::cpu {

class TcpPeerTransport;

// This process's side: the job's secret and its listener.
class TcpTransport final : public Transport {
 public:
  // Listens on `job.listen_address` (job.me: this process). `wake` runs on a link's
  // receiver thread after each frame that arrives and when the link fails.
  static std::unique_ptr<TcpTransport> Create(const TcpJob& job, std::function<void()> wake, std::string* error);
  // The factory's entry (factory.h). Settings: listen_address, secret (64 hex digits),
  // processes (the job's count), early_wait_ms (TcpJob), address (what peers connect to:
  // listen_address unless that is every interface).
  static std::unique_ptr<Transport> Make(const TransportContext& context, const Params& settings, std::string* error);

  int port() const { return listener_->port(); }
  const Capabilities& caps() const override;
  // {address, port}: where this process listens.
  Params Endpoint() const override;
  std::shared_ptr<PeerTransport> Link(const LinkRequest& request, std::string* error) override;
  // Takes connections that arrived while no Link waited for one: restarted processes.
  void Poll() override;
  int64_t refused() const override { return listener_->refused(); }

  std::string Publish(const Outgoing& /*round*/, const Parts& /*mine*/) override { return ""; }
  void Release(uint64_t /*key*/, int64_t /*seq*/) override {}
  void ShowWaits(const std::vector<WaitNotice>& /*notices*/) override {}
  std::string SkipRounds(uint64_t /*key*/, uint64_t /*fingerprint*/, size_t /*bytes*/, int64_t /*last*/) override {
    return "";  // nothing of a round stays behind
  }
  // The held connections on which a request arrived.
  std::vector<Rejoiner> Joins(const std::vector<int64_t>& candidates,
                              const std::function<bool(int64_t, uint64_t)>& wanted) override;

 private:
  TcpTransport() = default;
  // The link over connected socket `fd` to process `process` (-1: told later).
  std::shared_ptr<TcpPeerTransport> Wrap(int fd, int64_t process);
  // Connects to the peer listening at `host:port` and introduces this process; nullptr
  // and `error` on failure.
  std::shared_ptr<TcpPeerTransport> Connect(const std::string& host, int port,
                                            std::chrono::steady_clock::time_point deadline, std::string* error);
  // Takes the next connection a peer made to this process (waiting until `deadline`; now:
  // only one already there) into accepted_, or held_ when its process was linked before
  // (restarted: it is kept until its request to rejoin arrives on it, Joins).
  void Accept(std::chrono::steady_clock::time_point deadline);

  TcpJob job_;
  std::string address_;  // what peers connect to
  std::function<void()> wake_;
  std::unique_ptr<TcpListener> listener_;
  std::mutex mu_;  // accepted_, held_, linked_
  std::map<int64_t, std::shared_ptr<TcpPeerTransport>> accepted_;  // connected first, not linked yet
  std::map<int64_t, std::shared_ptr<TcpPeerTransport>> held_;
  std::set<int64_t> linked_;
};

// The link to a peer over its TCP connection.
class TcpPeerTransport final : public PeerTransport {
 public:
  TcpPeerTransport(TcpTransport& local, int fd, const TcpJob& job, std::function<void()> on_frame)
      : local_(local), link_(fd, job, std::move(on_frame)) {}

  // The generation of the newest request to rejoin that arrived on this connection (0: none).
  uint64_t JoinRequest();

  Transport& local() const override { return local_; }
  bool MayPublish(uint64_t /*key*/, int64_t /*seq*/) override { return true; }  // a frame is a copy
  std::string Send(const Outgoing& round, const Parts& parts) override {
    return link_.Send(round.key, round.seq, round.fingerprint, parts, round.deadline);
  }
  bool Delivered(uint64_t key, int64_t seq) override { return link_.Sent(key) >= seq; }
  bool Find(uint64_t key, int64_t seq, uint64_t fingerprint, uint64_t bytes, Arrival* arrival,
            std::string* error) override;
  void Release(uint64_t key, int64_t seq) override { link_.Drop(key, seq); }
  std::pair<int64_t, std::vector<char>> Newest(uint64_t key) override { return link_.Newest(key); }
  std::string Failure() override { return link_.failure(); }
  bool Failed() const override { return link_.failed(); }
  size_t HeldBytes() const override { return link_.held_bytes(); }
  std::vector<WaitNotice> Notices() override { return link_.Notices(); }
  std::string ShowWaits(const std::vector<WaitNotice>& notices,
                        std::chrono::steady_clock::time_point deadline) override {
    return link_.SendNotices(notices, deadline);
  }
  void RequestJoin(int64_t process, uint64_t generation, std::chrono::steady_clock::time_point deadline) override;

 private:
  TcpTransport& local_;
  TcpLink link_;
};

}  // namespace jaxcomm::cpu
