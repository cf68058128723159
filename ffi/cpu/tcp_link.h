// TCP between two processes (on different hosts, or anywhere with JAXCOMM_TRANSPORT=tcp).
//
// One connection per pair of processes. A round's contribution travels as one frame:
// a header (key, seq, fingerprint, length) and the bytes, written straight from the
// ranks' buffers. A receiver thread per connection reads frames into an inbox keyed by
// (key, seq): rounds of independent collectives may arrive in any order.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace jaxcomm::cpu {

// A listening socket on an ephemeral port of all interfaces.
class TcpListener {
 public:
  static std::unique_ptr<TcpListener> Create(std::string* error);
  ~TcpListener();
  int port() const { return port_; }
  // Accepts one connection before `deadline`; -1 and `error` otherwise.
  int Accept(std::chrono::steady_clock::time_point deadline, std::string* error);

 private:
  int fd_ = -1;
  int port_ = 0;
};

class TcpLink {
 public:
  struct Frame {
    uint64_t fingerprint = 0;
    std::vector<char> bytes;
  };

  // Connects to `host:port` and introduces this process; -1 and `error` on failure.
  static int Connect(const std::string& host, int port, int64_t me,
                     std::chrono::steady_clock::time_point deadline, std::string* error);
  // Reads the introduction of an accepted connection: the peer's process index.
  static int64_t ReadHello(int fd, std::chrono::steady_clock::time_point deadline, std::string* error);

  // Takes ownership of connected socket `fd`; `on_frame` runs (on the receiver thread)
  // after each frame arrives or the connection fails.
  TcpLink(int fd, std::function<void()> on_frame);
  ~TcpLink();
  TcpLink(const TcpLink&) = delete;
  TcpLink& operator=(const TcpLink&) = delete;

  // Sends one frame made of `parts`, before `deadline`. Thread-safe.
  std::string Send(uint64_t key, int64_t seq, uint64_t fingerprint,
                   const std::vector<std::pair<const void*, size_t>>& parts,
                   std::chrono::steady_clock::time_point deadline);
  // The frame of (key, seq) if it arrived (stays valid until Drop), else nullptr.
  const Frame* Find(uint64_t key, int64_t seq);
  void Drop(uint64_t key, int64_t seq);
  // The newest frame of `key` (seq, bytes copy), dropping older ones; seq 0 if none.
  std::pair<int64_t, std::vector<char>> Newest(uint64_t key);
  // Why the connection is unusable ("" while it works).
  std::string failure() const;

 private:
  void Receive();
  void Fail(const std::string& why);

  int fd_;
  std::function<void()> on_frame_;
  std::mutex send_mu_;
  mutable std::mutex mu_;
  std::map<std::pair<uint64_t, int64_t>, std::unique_ptr<Frame>> inbox_;
  // Buffers of dropped frames, reused by frames of the same size (the next rounds of the
  // same call): a fresh 16 MiB buffer costs its zero-fill and a page fault per 4 KiB,
  // which took longer than receiving it.
  std::vector<std::vector<char>> spare_;
  size_t spare_bytes_ = 0;
  std::string failure_;
  std::atomic<bool> stop_{false};
  std::thread receiver_;
};

}  // namespace jaxcomm::cpu
