// TCP between two processes (on different hosts, or anywhere with JAXCOMM_TRANSPORT=tcp).
//
// One connection per pair of processes. A round's contribution travels as one frame:
// a header (key, seq, fingerprint, length) and the bytes, written straight from the
// ranks' buffers. A receiver thread per connection reads frames into an inbox keyed by
// (key, seq): rounds of independent collectives may arrive in any order.
//
// What the TCP path guarantees (docs/multiprocess.md, "Security"):
// * A listener listens on one address only: the interface the job reaches its peers by
//   (TcpJob::listen_address), never on every interface unless told to.
// * A connection first proves it belongs to the job: its first 64 bytes (the hello)
//   carry the job's secret (32 random bytes drawn at the job's start), which is checked,
//   in constant time, before anything else is read from it; then the process index it
//   claims must be another process of the job. Any other connection is closed (logged
//   once per address and reason); a thread of its own reads hellos without blocking, so
//   slow or many strangers delay no one (at most kMaxPendingHellos wait, each at most
//   kHelloTimeout).
// * Every frame header is checked before anything is allocated or copied: a sequence
//   number must be positive, not a round of the call already finished nor one already
//   in the inbox; a length must fit this machine's memory; a frame of a call this
//   process already runs must have that call's length and fingerprint (else it is kept
//   without its bytes, which are read and dropped, and the call fails naming the peer:
//   the processes run different programs) and be at most kMaxAhead rounds ahead (else
//   it waits unread); a frame of a call this process has not
//   reached yet must fit the early-frame budget (kEarlyBytes per link, kMaxFrames
//   frames) or wait, unread, until this process reaches that call, at most the
//   collective timeout. A notice frame (TcpLink::kNoticeKey: the mismatch check's) must
//   hold whole records, at most kMaxWaitNotices of them. A violation fails that link with
//   an error naming the peer, never the process.
// * No exception escapes a transport thread.
// Not guaranteed: confidentiality or integrity against someone who can read or alter
// the job's traffic (no encryption; the secret crosses the network in the clear).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/mismatch.h"

namespace jaxcomm::cpu {

// What every TCP connection of this process's job must show, and where it listens.
struct TcpJob {
  // The address of the interface to listen on ("0.0.0.0": every interface, only when a
  // setting asks for it).
  std::string listen_address = "127.0.0.1";
  std::array<uint8_t, 32> secret{};
  int64_t processes = 0;  // a hello's process index must be below it
  int64_t me = -1;        // ... and not this one
  // How long a frame of a call this process has not reached may wait unread when it
  // does not fit the early-frame budget.
  std::chrono::milliseconds early_wait{std::chrono::seconds(300)};
};

// A connection that proved it belongs to the job, and the process it says it is.
struct TcpHello {
  int fd = -1;
  int64_t process = -1;
};

// A listening socket on an ephemeral port of one address, with a thread that accepts
// connections and checks their hellos.
class TcpListener {
 public:
  static constexpr size_t kMaxPendingHellos = 64;
  static constexpr std::chrono::seconds kHelloTimeout{5};

  static std::unique_ptr<TcpListener> Create(const TcpJob& job, std::string* error);
  ~TcpListener();
  TcpListener(const TcpListener&) = delete;
  TcpListener& operator=(const TcpListener&) = delete;
  int port() const { return port_; }
  // The next connection that passed its hello, waiting until `deadline` (now: only one
  // already there); fd -1 when none.
  TcpHello Accept(std::chrono::steady_clock::time_point deadline);
  // Connections refused so far (no hello in time, wrong secret, bad process index, ...).
  int64_t refused() const { return refused_.load(); }

 private:
  struct Pending;
  TcpListener() = default;
  void Run();
  // Reads what `p` sent so far; true when it is settled (passed: queued; or refused).
  bool Advance(Pending& p);
  void Refuse(Pending& p, const std::string& why);

  TcpJob job_;
  int fd_ = -1;
  int wake_[2] = {-1, -1};  // self-pipe: stops the acceptor thread
  int port_ = 0;
  std::mutex mu_;
  std::condition_variable ready_cv_;
  std::deque<TcpHello> ready_;
  std::map<std::string, int> logged_;  // "address: reason" already logged
  std::atomic<int64_t> refused_{0};
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
};

class TcpLink {
 public:
  struct Frame {
    uint64_t fingerprint = 0;
    std::vector<char> bytes;  // empty when the frame did not match its call (see wire_bytes)
    uint64_t wire_bytes = 0;  // the length the peer sent
  };
  // At most this many bytes of frames of calls this process has not reached yet, and
  // this many frames in the inbox, per link.
  static constexpr uint64_t kEarlyBytes = uint64_t{256} << 20;
  static constexpr size_t kMaxFrames = 4096;
  // At most this many unread frames of one call this process runs (a peer is at most a
  // couple of rounds ahead).
  static constexpr size_t kMaxAhead = 16;

  // Connects to `host:port` and introduces this process with the job's hello; -1 and
  // `error` on failure.
  static int Connect(const std::string& host, int port, const TcpJob& job,
                     std::chrono::steady_clock::time_point deadline, std::string* error);

  // Takes ownership of connected socket `fd`; `on_frame` runs (on the receiver thread)
  // after each frame arrives or the connection fails.
  TcpLink(int fd, const TcpJob& job, std::function<void()> on_frame);
  ~TcpLink();
  TcpLink(const TcpLink&) = delete;
  TcpLink& operator=(const TcpLink&) = delete;

  // Sends one frame made of `parts`, before `deadline`. Thread-safe.
  std::string Send(uint64_t key, int64_t seq, uint64_t fingerprint,
                   const std::vector<std::pair<const void*, size_t>>& parts,
                   std::chrono::steady_clock::time_point deadline);
  // The newest round of `key` this process sent whole (0: none).
  int64_t Sent(uint64_t key) const;

  // The mismatch check (core/mismatch.h): this process's waits past the grace period
  // travel as a notice frame (key kNoticeKey, never a call's: plan keys are not 0), which
  // replaces what the peer showed before.
  static constexpr uint64_t kNoticeKey = 0;
  std::string SendNotices(const std::vector<WaitNotice>& notices, std::chrono::steady_clock::time_point deadline);
  // What the peer's last notice frame showed (kept after the link fails).
  std::vector<WaitNotice> Notices() const;
  // The frame of (key, seq) if it arrived (stays valid until Drop), else nullptr. States
  // what this process expects of the call's frames from this peer (its fingerprint and
  // length), which the receiver checks every later frame of `key` against.
  const Frame* Find(uint64_t key, int64_t seq, uint64_t fingerprint, uint64_t bytes);
  void Drop(uint64_t key, int64_t seq);
  // The newest frame of `key` (seq, bytes copy), dropping older ones; seq 0 if none.
  std::pair<int64_t, std::vector<char>> Newest(uint64_t key);
  // Why the connection is unusable ("" while it works).
  std::string failure() const;
  // Bytes it holds: frames in the inbox and spare buffers (jaxcomm.memory()).
  size_t held_bytes() const;
  // Whether it is (a relaxed load: waiting exchanges look at it often).
  bool failed() const { return failed_.load(std::memory_order_relaxed); }

 private:
  struct Expected {
    uint64_t fingerprint = 0;
    uint64_t bytes = 0;
    int64_t done = 0;  // the newest round of the call dropped (finished)
  };
  void Receive();
  // Reads one frame; "" or why the link fails.
  std::string ReceiveOne();
  // Checks a header before anything is allocated: "" (then `*matches` says whether it
  // is the call's expected frame, `*early` whether its call is unknown yet), or why the
  // link fails. Waits (unlocking `lock`) while an early frame does not fit the budget.
  std::string Admit(uint64_t key, int64_t seq, uint64_t fingerprint, uint64_t bytes,
                    std::unique_lock<std::mutex>& lock, bool* matches, bool* early);
  void Fail(const std::string& why);

  int fd_;
  const TcpJob job_;
  std::function<void()> on_frame_;
  mutable std::mutex send_mu_;
  std::unordered_map<uint64_t, int64_t> sent_;  // by key: the newest round sent (under send_mu_)
  uint64_t notices_sent_ = 0;                   // numbers the notice frames (under send_mu_)
  std::vector<WaitNotice> notices_;             // the peer's (under mu_)
  mutable std::mutex mu_;
  std::condition_variable admit_cv_;  // an early frame waits for its call, or for room
  std::map<std::pair<uint64_t, int64_t>, std::unique_ptr<Frame>> inbox_;
  std::map<uint64_t, Expected> expected_;  // calls this process has reached, by key
  uint64_t early_bytes_ = 0;  // bytes of inbox frames whose call was unknown on arrival
  std::map<std::pair<uint64_t, int64_t>, uint64_t> early_;  // those frames, by (key, seq)
  // Buffers of dropped frames, reused by frames of the same size (the next rounds of the
  // same call): a fresh 16 MiB buffer costs its zero-fill and a page fault per 4 KiB,
  // which took longer than receiving it.
  std::vector<std::vector<char>> spare_;
  size_t spare_bytes_ = 0;
  std::string failure_;
  std::atomic<bool> failed_{false};  // failure_ is set
  std::atomic<bool> stop_{false};
  std::thread receiver_;
};

}  // namespace jaxcomm::cpu
