#include "cpu/transport/tcp_link.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iterator>

#include "core/registry.h"

namespace jaxcomm::cpu {
namespace {

using Clock = std::chrono::steady_clock;

// Bytes of frames of calls this process has not reached that one link may hold: at most
// kEarlyBytes, and at most JAXCOMM_COMM_MEMORY_MB.
uint64_t EarlyBudget() {
  return std::min<uint64_t>(TcpLink::kEarlyBytes, static_cast<uint64_t>(Registry::Get().comm_memory_limit()));
}

// Marks notice frames (TcpLink::kNoticeKey).
constexpr uint64_t kNoticeFingerprint = 0x6a636e6f74696365ull;  // "jcnotice"

struct Header {
  uint64_t key;
  int64_t seq;
  uint64_t fingerprint;
  uint64_t bytes;
};

// The first bytes of every connection: who may talk to whom is settled before a frame.
struct Hello {
  uint64_t magic;
  uint32_t version;
  uint32_t flags;  // 0; room for later use
  uint8_t secret[32];
  int64_t process;
  int64_t processes;
};
static_assert(sizeof(Hello) == 64, "the hello is 64 bytes on the wire");

constexpr uint64_t kHelloMagic = 0x6a63686c6c6f0002ull;  // "jchllo", hello version 2
constexpr uint32_t kHelloVersion = 2;
// At most this many refusals are logged (one per address and reason); then counted.
constexpr int kMaxLoggedRefusals = 16;

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

int MillisLeft(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1000));
}

// Waits until `fd` is ready for `events`, at most until `deadline`.
bool WaitFd(int fd, short events, Clock::time_point deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    int r = poll(&p, 1, MillisLeft(deadline));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
    if (Clock::now() >= deadline) return false;
  }
}

// Reads exactly `n` bytes into `buf` (or drops them when `buf` is null) unless the
// deadline passes, the peer closes, or `stop` is set.
std::string ReadAll(int fd, void* buf, size_t n, Clock::time_point deadline, const std::atomic<bool>* stop) {
  char* p = static_cast<char*>(buf);
  char sink[65536];
  while (n > 0) {
    ssize_t r = recv(fd, p != nullptr ? p : sink, p != nullptr ? n : std::min(n, sizeof(sink)), 0);
    if (r > 0) {
      if (p != nullptr) p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0 || (r < 0 && errno == ECONNRESET)) {
      return "connection closed by the peer (its process exited?)";
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return Errno("recv");
    if (stop && stop->load()) return "link closed";
    if (Clock::now() >= deadline) return "timed out reading";
    WaitFd(fd, POLLIN, std::min(deadline, Clock::now() + std::chrono::milliseconds(200)));
  }
  return "";
}

void Tune(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int buf = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

// Compares in time independent of where the first difference is.
bool SameSecret(const uint8_t* a, const uint8_t* b) {
  uint8_t diff = 0;
  for (size_t i = 0; i < 32; ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

// The most bytes one frame may have: this machine's memory (a longer one cannot be a
// peer's contribution, and allocating it would end the process).
uint64_t MaxFrameBytes() {
  static const uint64_t max = [] {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page)
                                 : uint64_t{1} << 40;
  }();
  return max;
}

std::string Address(const sockaddr_storage& a) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (a.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (a.ss_family == AF_INET6) {
    const auto* in = reinterpret_cast<const sockaddr_in6*>(&a);
    inet_ntop(AF_INET6, &in->sin6_addr, host, sizeof(host));
    port = ntohs(in->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

}  // namespace

// ------------------------------------------------------------------------- listener

struct TcpListener::Pending {
  int fd = -1;
  std::string from;  // "address:port"
  Clock::time_point deadline;
  Hello hello{};
  size_t got = 0;
};

std::unique_ptr<TcpListener> TcpListener::Create(const TcpJob& job, std::string* error) {
  std::unique_ptr<TcpListener> l(new TcpListener());
  l->job_ = job;
  l->fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (l->fd_ < 0) {
    *error = Errno("socket");
    return nullptr;
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (inet_pton(AF_INET, job.listen_address.c_str(), &addr.sin_addr) != 1) {
    *error = "cannot listen on '" + job.listen_address + "': not an IPv4 address";
    return nullptr;
  }
  addr.sin_port = 0;  // ephemeral: published through the job's key-value store
  socklen_t len = sizeof(addr);
  if (bind(l->fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(l->fd_, 128) != 0 ||
      getsockname(l->fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    *error = Errno("listening on " + job.listen_address);
    return nullptr;
  }
  l->port_ = ntohs(addr.sin_port);
  if (pipe2(l->wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    *error = Errno("pipe");
    return nullptr;
  }
  TcpListener* raw = l.get();
  l->acceptor_ = std::thread([raw] { raw->Run(); });
  return l;
}

TcpListener::~TcpListener() {
  stop_.store(true);
  if (wake_[1] >= 0) {
    const char c = 'q';
    ssize_t ignored = write(wake_[1], &c, 1);
    (void)ignored;
  }
  if (acceptor_.joinable()) acceptor_.join();
  for (const TcpHello& h : ready_) close(h.fd);
  for (int fd : {fd_, wake_[0], wake_[1]}) {
    if (fd >= 0) close(fd);
  }
}

TcpHello TcpListener::Accept(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  ready_cv_.wait_until(lock, deadline, [this] { return !ready_.empty(); });
  if (ready_.empty()) return {};
  TcpHello h = ready_.front();
  ready_.pop_front();
  return h;
}

void TcpListener::Refuse(Pending& p, const std::string& why) {
  refused_.fetch_add(1);
  const std::string host = p.from.substr(0, p.from.rfind(':'));
  {
    std::lock_guard<std::mutex> lock(mu_);
    const bool first = logged_.size() < kMaxLoggedRefusals && logged_.emplace(host + ": " + why, 1).second;
    if (first) {
      std::fprintf(stderr, "jaxcomm: refused a TCP connection from %s to this process's listener: %s%s\n",
                   p.from.c_str(), why.c_str(),
                   logged_.size() == kMaxLoggedRefusals ? " (further refusals are counted, not logged)" : "");
    }
  }
  close(p.fd);
  p.fd = -1;
}

bool TcpListener::Advance(Pending& p) {
  auto* buf = reinterpret_cast<char*>(&p.hello);
  while (p.got < sizeof(Hello)) {
    const ssize_t r = recv(p.fd, buf + p.got, sizeof(Hello) - p.got, 0);
    if (r > 0) {
      p.got += static_cast<size_t>(r);
      // The secret is checked as soon as it is in, before anything after it is read.
      if (p.got >= offsetof(Hello, process) && p.got - static_cast<size_t>(r) < offsetof(Hello, process)) {
        if (p.hello.magic != kHelloMagic) {
          Refuse(p, "it is not a jaxcomm peer (its first bytes are not a jaxcomm hello)");
          return true;
        }
        if (p.hello.version != kHelloVersion) {
          Refuse(p, "it speaks another version of jaxcomm's protocol");
          return true;
        }
        if (!SameSecret(p.hello.secret, job_.secret.data())) {
          Refuse(p, "wrong job secret (another job, or not a process of any)");
          return true;
        }
      }
      continue;
    }
    if (r == 0) {
      Refuse(p, "it closed the connection before it introduced itself");
      return true;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (Clock::now() < p.deadline) return false;
      Refuse(p, "it did not introduce itself within " + std::to_string(kHelloTimeout.count()) + " s");
      return true;
    }
    Refuse(p, Errno("recv"));
    return true;
  }
  const Hello& h = p.hello;
  if (h.processes != job_.processes) {
    Refuse(p, "it belongs to a job of " + std::to_string(h.processes) + " processes, not " +
                  std::to_string(job_.processes));
    return true;
  }
  if (h.process < 0 || h.process >= job_.processes || h.process == job_.me) {
    Refuse(p, "it claims to be process " + std::to_string(h.process) + ", not another process of the job");
    return true;
  }
  Tune(p.fd);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ready_.push_back({p.fd, h.process});
  }
  ready_cv_.notify_all();
  p.fd = -1;
  return true;
}

void TcpListener::Run() {
  std::deque<Pending> pending;
  try {
    while (!stop_.load()) {
      std::vector<pollfd> fds{{wake_[0], POLLIN, 0}, {fd_, POLLIN, 0}};
      for (const Pending& p : pending) fds.push_back({p.fd, POLLIN, 0});
      const int r = poll(fds.data(), fds.size(), 100);
      if (r < 0 && errno != EINTR) break;
      if (fds[0].revents != 0) break;
      if (fds[1].revents != 0) {
        while (true) {
          Pending p;
          sockaddr_storage from{};
          socklen_t len = sizeof(from);
          p.fd = accept4(fd_, reinterpret_cast<sockaddr*>(&from), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
          if (p.fd < 0) break;
          p.from = Address(from);
          p.deadline = Clock::now() + kHelloTimeout;
          // A peer's hello comes with its connection: settle it at once, so a flood of
          // connections that say nothing does not push it out of the queue.
          if (Advance(p)) continue;
          if (pending.size() >= kMaxPendingHellos) {
            Refuse(pending.front(), "too many connections waiting to introduce themselves");
            pending.pop_front();
          }
          pending.push_back(std::move(p));
        }
      }
      for (Pending& p : pending) {
        if (p.fd >= 0) Advance(p);
      }
      pending.erase(std::remove_if(pending.begin(), pending.end(), [](const Pending& p) { return p.fd < 0; }),
                    pending.end());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "jaxcomm: the TCP listener's thread stopped: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "jaxcomm: the TCP listener's thread stopped on an unknown exception\n");
  }
  for (Pending& p : pending) {
    if (p.fd >= 0) close(p.fd);
  }
}

// ----------------------------------------------------------------------------- link

int TcpLink::Connect(const std::string& host, int port, const TcpJob& job, Clock::time_point deadline,
                     std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res); rc != 0) {
    *error = "cannot resolve " + host + ": " + gai_strerror(rc);
    return -1;
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> guard(res, freeaddrinfo);
  Hello hello{};
  hello.magic = kHelloMagic;
  hello.version = kHelloVersion;
  std::memcpy(hello.secret, job.secret.data(), sizeof(hello.secret));
  hello.process = job.me;
  hello.processes = job.processes;
  while (true) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      *error = Errno("socket");
      return -1;
    }
    if (connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
      Tune(fd);
      const char* p = reinterpret_cast<const char*>(&hello);
      size_t n = sizeof(hello);
      while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w > 0) {
          p += w;
          n -= static_cast<size_t>(w);
        } else if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
          if (!WaitFd(fd, POLLOUT, deadline)) break;
        } else {
          break;
        }
      }
      if (n == 0) return fd;
      *error = Errno("sending the introduction to " + host + ":" + std::to_string(port));
      close(fd);
      return -1;
    }
    const std::string why = Errno("connect to " + host + ":" + std::to_string(port));
    close(fd);
    if (Clock::now() >= deadline) {
      *error = why;
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

TcpLink::TcpLink(int fd, const TcpJob& job, std::function<void()> on_frame)
    : fd_(fd), job_(job), on_frame_(std::move(on_frame)), receiver_([this] { Receive(); }) {}

TcpLink::~TcpLink() {
  stop_.store(true);
  admit_cv_.notify_all();
  shutdown(fd_, SHUT_RDWR);
  if (receiver_.joinable()) receiver_.join();
  close(fd_);
}

void TcpLink::Fail(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.empty()) failure_ = why;
  }
  failed_.store(true, std::memory_order_relaxed);
  // Nothing more is read from a failed link: the peer sees it closed.
  shutdown(fd_, SHUT_RDWR);
  on_frame_();
}

std::string TcpLink::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void TcpLink::Receive() {
  // An exception escaping this thread would end the process: it fails the link instead.
  try {
    while (!stop_.load()) {
      const std::string err = ReceiveOne();
      if (!err.empty()) {
        if (!stop_.load()) Fail(err);
        return;
      }
      on_frame_();
    }
  } catch (const std::exception& e) {
    Fail(std::string("receiving a frame failed: ") + e.what());
  } catch (...) {
    Fail("receiving a frame failed (unknown exception)");
  }
}

std::string TcpLink::Admit(uint64_t key, int64_t seq, uint64_t fingerprint, uint64_t bytes,
                           std::unique_lock<std::mutex>& lock, bool* matches, bool* early) {
  const std::string round = "round " + std::to_string(seq) + " of call " + std::to_string(key);
  if (seq <= 0) return "the peer sent a frame numbered " + std::to_string(seq) + " (rounds count from 1)";
  if (bytes > MaxFrameBytes()) {
    return "the peer announced a frame of " + std::to_string(bytes) + " bytes, more than this machine's memory";
  }
  if (inbox_.count({key, seq})) return "the peer sent " + round + " twice";
  const auto deadline = Clock::now() + job_.early_wait;
  while (true) {
    if (stop_.load()) return "link closed";
    if (auto it = expected_.find(key); it != expected_.end()) {
      if (seq <= it->second.done) return "the peer sent " + round + ", which this process already finished";
      *matches = it->second.fingerprint == fingerprint && it->second.bytes == bytes;
      *early = false;
      // A peer is at most a couple of rounds of one call ahead (it needs this process's
      // contribution to finish each): more unread ones wait.
      size_t unread = 0;
      for (auto f = inbox_.lower_bound({key, INT64_MIN}); f != inbox_.end() && f->first.first == key; ++f) {
        if (++unread >= kMaxAhead) break;
      }
      if (inbox_.size() < kMaxFrames && unread < kMaxAhead) return "";
    } else {
      *matches = true;
      *early = true;
      if (early_bytes_ + bytes <= EarlyBudget() && inbox_.size() < kMaxFrames) return "";
    }
    // No room: the frame stays unread (the peer's sends wait) until this process
    // reaches its call or consumes older frames.
    if (Clock::now() >= deadline) {
      return "the peer sent " + std::to_string(bytes) + " bytes for " + round +
             (*early ? ", a call this process did not reach within the timeout, beyond its budget for early frames (" +
                           std::to_string(EarlyBudget()) + " bytes, JAXCOMM_COMM_MEMORY_MB)"
                     : ", while " + std::to_string(inbox_.size()) + " frames are unread (too far ahead)");
    }
    admit_cv_.wait_for(lock, std::chrono::milliseconds(200));
  }
}

std::string TcpLink::ReceiveOne() {
  // Waits are bounded: each read re-checks `stop_` at least every 200 ms.
  const auto forever = Clock::time_point::max();
  Header h{};
  std::string err = ReadAll(fd_, &h, sizeof(h), forever, &stop_);
  if (!err.empty()) return err;
  if (h.key == kNoticeKey) {
    if (h.fingerprint != kNoticeFingerprint || h.bytes % sizeof(WaitNotice) != 0 ||
        h.bytes > kMaxWaitNotices * sizeof(WaitNotice)) {
      return "the peer sent a malformed notice frame (" + std::to_string(h.bytes) + " bytes)";
    }
    std::vector<WaitNotice> notices(h.bytes / sizeof(WaitNotice));
    err = ReadAll(fd_, notices.data(), h.bytes, forever, &stop_);
    if (!err.empty()) return err;
    for (WaitNotice& n : notices) n.Terminate();
    std::lock_guard<std::mutex> lock(mu_);
    notices_ = std::move(notices);
    return "";
  }
  auto frame = std::make_unique<Frame>();
  frame->fingerprint = h.fingerprint;
  frame->wire_bytes = h.bytes;
  bool matches = true, early = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    err = Admit(h.key, h.seq, h.fingerprint, h.bytes, lock, &matches, &early);
    if (!err.empty()) return err;
    if (matches) {
      auto it = std::find_if(spare_.begin(), spare_.end(),
                             [&h](const std::vector<char>& b) { return b.size() == h.bytes; });
      if (it != spare_.end()) {
        spare_bytes_ -= it->size();
        frame->bytes = std::move(*it);
        spare_.erase(it);
      }
    }
    if (early) {
      early_bytes_ += h.bytes;
      early_[{h.key, h.seq}] = h.bytes;
    }
  }
  if (matches) {
    frame->bytes.resize(h.bytes);
    err = ReadAll(fd_, frame->bytes.data(), h.bytes, forever, &stop_);
  } else {
    // Not what this process's call expects: its bytes are read and dropped, and the call
    // reports the mismatch (the length the peer sent is in wire_bytes).
    err = ReadAll(fd_, nullptr, h.bytes, forever, &stop_);
  }
  if (!err.empty()) return err;
  std::lock_guard<std::mutex> lock(mu_);
  inbox_[{h.key, h.seq}] = std::move(frame);
  return "";
}

std::string TcpLink::Send(uint64_t key, int64_t seq, uint64_t fingerprint,
                          const std::vector<std::pair<const void*, size_t>>& parts,
                          Clock::time_point deadline) {
  Header h{key, seq, fingerprint, 0};
  for (const auto& [p, n] : parts) h.bytes += n;
  std::vector<iovec> iov;
  iov.push_back({&h, sizeof(h)});
  for (const auto& [p, n] : parts) {
    if (n > 0) iov.push_back({const_cast<void*>(p), n});
  }
  std::lock_guard<std::mutex> lock(send_mu_);
  size_t first = 0;
  bool wrote = false;
  while (first < iov.size()) {
    msghdr msg{};
    msg.msg_iov = iov.data() + first;
    msg.msg_iovlen = std::min<size_t>(iov.size() - first, IOV_MAX);
    ssize_t w = sendmsg(fd_, &msg, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EPIPE || errno == ECONNRESET) {
        // The same as a receive that finds the stream closed: which one notices first is
        // a race, and the message should not depend on it.
        return "connection closed by the peer (its process exited?; " + Errno("send") + ")";
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) return Errno("send");
      if (Clock::now() >= deadline) {
        const std::string why = "timed out sending (the peer does not read)";
        // Part of a frame went out: the next one would be read from its middle.
        if (wrote) Fail(why + "; a frame was cut short");
        return why;
      }
      WaitFd(fd_, POLLOUT, std::min(deadline, Clock::now() + std::chrono::milliseconds(200)));
      continue;
    }
    wrote = true;
    size_t left = static_cast<size_t>(w);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left > 0) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  if (key != kNoticeKey) {
    int64_t& sent = sent_[key];
    sent = std::max(sent, seq);
  }
  return "";
}

int64_t TcpLink::Sent(uint64_t key) const {
  std::lock_guard<std::mutex> lock(send_mu_);
  auto it = sent_.find(key);
  return it == sent_.end() ? 0 : it->second;
}

std::string TcpLink::SendNotices(const std::vector<WaitNotice>& notices, Clock::time_point deadline) {
  int64_t number;
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    number = static_cast<int64_t>(++notices_sent_);
  }
  return Send(kNoticeKey, number, kNoticeFingerprint, {{notices.data(), notices.size() * sizeof(WaitNotice)}},
              deadline);
}

std::vector<WaitNotice> TcpLink::Notices() const {
  std::lock_guard<std::mutex> lock(mu_);
  return notices_;
}

const TcpLink::Frame* TcpLink::Find(uint64_t key, int64_t seq, uint64_t fingerprint, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [expected, added] = expected_.try_emplace(key);
  if (added) {
    expected->second.fingerprint = fingerprint;
    expected->second.bytes = bytes;
    admit_cv_.notify_all();  // an early frame of this call may wait for it
  }
  auto it = inbox_.find({key, seq});
  return it == inbox_.end() ? nullptr : it->second.get();
}

std::pair<int64_t, std::vector<char>> TcpLink::Newest(uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto first = inbox_.lower_bound({key, INT64_MIN});
  auto end = inbox_.lower_bound({key + 1, INT64_MIN});
  if (key == UINT64_MAX) end = inbox_.end();
  if (first == end) return {0, {}};
  auto newest = std::prev(end);
  std::pair<int64_t, std::vector<char>> out{newest->first.second, newest->second->bytes};
  for (auto it = first; it != newest; ++it) {
    if (auto e = early_.find(it->first); e != early_.end()) {
      early_bytes_ -= e->second;
      early_.erase(e);
    }
  }
  inbox_.erase(first, newest);
  admit_cv_.notify_all();
  return out;
}

size_t TcpLink::held_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t bytes = spare_bytes_;
  for (const auto& [_, frame] : inbox_) bytes += frame->bytes.capacity();
  return bytes;
}

void TcpLink::Drop(uint64_t key, int64_t seq) {
  // At most this many bytes of spare buffers per link (and at most JAXCOMM_COMM_MEMORY_MB).
  constexpr size_t kMaxSpareBytes = size_t{256} << 20;
  constexpr size_t kMaxSpares = 8;
  std::lock_guard<std::mutex> lock(mu_);
  if (auto e = expected_.find(key); e != expected_.end()) e->second.done = std::max(e->second.done, seq);
  auto it = inbox_.find({key, seq});
  if (it == inbox_.end()) return;
  if (auto e = early_.find(it->first); e != early_.end()) {
    early_bytes_ -= e->second;
    early_.erase(e);
  }
  std::vector<char> bytes = std::move(it->second->bytes);
  inbox_.erase(it);
  admit_cv_.notify_all();
  const size_t most = std::min<size_t>(kMaxSpareBytes, EarlyBudget());  // JAXCOMM_COMM_MEMORY_MB
  if (bytes.empty() || bytes.size() > most) return;
  while (!spare_.empty() && (spare_.size() >= kMaxSpares || spare_bytes_ + bytes.size() > most)) {
    spare_bytes_ -= spare_.front().size();
    spare_.erase(spare_.begin());
  }
  spare_bytes_ += bytes.size();
  spare_.push_back(std::move(bytes));
}

}  // namespace jaxcomm::cpu
