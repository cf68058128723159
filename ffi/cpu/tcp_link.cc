#include "cpu/tcp_link.h"

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
#include <climits>
#include <iterator>
#include <cerrno>
#include <cstring>

namespace jaxcomm::cpu {
namespace {

using Clock = std::chrono::steady_clock;

struct Header {
  uint64_t key;
  int64_t seq;
  uint64_t fingerprint;
  uint64_t bytes;
};

constexpr uint64_t kHello = 0x6a63686c6c6f0001ull;

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

// Reads exactly `n` bytes unless the deadline passes or the peer closes.
std::string ReadAll(int fd, void* buf, size_t n, Clock::time_point deadline, const std::atomic<bool>* stop) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = recv(fd, p, n, 0);
    if (r > 0) {
      p += r;
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

}  // namespace

std::unique_ptr<TcpListener> TcpListener::Create(std::string* error) {
  auto l = std::make_unique<TcpListener>();
  l->fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (l->fd_ < 0) {
    *error = Errno("socket");
    return nullptr;
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;  // ephemeral: published through the job's key-value store
  socklen_t len = sizeof(addr);
  if (bind(l->fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(l->fd_, 128) != 0 ||
      getsockname(l->fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    *error = Errno("bind/listen");
    return nullptr;
  }
  l->port_ = ntohs(addr.sin_port);
  // Two threads may accept (a Link() waiting for its peer, the progress thread taking a
  // rejoining process): the one that finds nothing must not block.
  fcntl(l->fd_, F_SETFL, fcntl(l->fd_, F_GETFL, 0) | O_NONBLOCK);
  return l;
}

TcpListener::~TcpListener() {
  if (fd_ >= 0) close(fd_);
}

int TcpListener::Accept(Clock::time_point deadline, std::string* error) {
  if (!WaitFd(fd_, POLLIN, deadline)) {
    *error = "no peer connected before the deadline";
    return -1;
  }
  int fd = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) *error = errno == EAGAIN || errno == EWOULDBLOCK ? "taken by another thread" : Errno("accept");
  return fd;
}

int TcpLink::Connect(const std::string& host, int port, int64_t me, Clock::time_point deadline,
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
  while (true) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      *error = Errno("socket");
      return -1;
    }
    if (connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
      Tune(fd);
      Header hello{kHello, me, 0, 0};
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

int64_t TcpLink::ReadHello(int fd, Clock::time_point deadline, std::string* error) {
  Tune(fd);
  Header hello{};
  *error = ReadAll(fd, &hello, sizeof(hello), deadline, nullptr);
  if (!error->empty()) return -1;
  if (hello.key != kHello) {
    *error = "a connection that is not a jaxcomm peer";
    return -1;
  }
  return hello.seq;
}

TcpLink::TcpLink(int fd, std::function<void()> on_frame)
    : fd_(fd), on_frame_(std::move(on_frame)), receiver_([this] { Receive(); }) {}

TcpLink::~TcpLink() {
  stop_.store(true);
  shutdown(fd_, SHUT_RDWR);
  if (receiver_.joinable()) receiver_.join();
  close(fd_);
}

void TcpLink::Fail(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.empty()) failure_ = why;
  }
  on_frame_();
}

std::string TcpLink::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void TcpLink::Receive() {
  // Waits are bounded: each read re-checks `stop_` at least every 200 ms.
  const auto forever = Clock::time_point::max();
  while (!stop_.load()) {
    Header h{};
    std::string err = ReadAll(fd_, &h, sizeof(h), forever, &stop_);
    auto frame = std::make_unique<Frame>();
    if (err.empty()) {
      frame->fingerprint = h.fingerprint;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = std::find_if(spare_.begin(), spare_.end(),
                               [&h](const std::vector<char>& b) { return b.size() == h.bytes; });
        if (it != spare_.end()) {
          spare_bytes_ -= it->size();
          frame->bytes = std::move(*it);
          spare_.erase(it);
        }
      }
      frame->bytes.resize(h.bytes);
      err = ReadAll(fd_, frame->bytes.data(), h.bytes, forever, &stop_);
    }
    if (!err.empty()) {
      if (!stop_.load()) Fail(err);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      inbox_[{h.key, h.seq}] = std::move(frame);
    }
    on_frame_();
  }
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
      if (Clock::now() >= deadline) return "timed out sending (the peer does not read)";
      WaitFd(fd_, POLLOUT, std::min(deadline, Clock::now() + std::chrono::milliseconds(200)));
      continue;
    }
    size_t left = static_cast<size_t>(w);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left > 0) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return "";
}

const TcpLink::Frame* TcpLink::Find(uint64_t key, int64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
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
  inbox_.erase(first, newest);
  return out;
}

void TcpLink::Drop(uint64_t key, int64_t seq) {
  // At most this many bytes of spare buffers per link.
  constexpr size_t kMaxSpareBytes = size_t{256} << 20;
  constexpr size_t kMaxSpares = 8;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = inbox_.find({key, seq});
  if (it == inbox_.end()) return;
  std::vector<char> bytes = std::move(it->second->bytes);
  inbox_.erase(it);
  if (bytes.empty() || bytes.size() > kMaxSpareBytes) return;
  while (!spare_.empty() && (spare_.size() >= kMaxSpares || spare_bytes_ + bytes.size() > kMaxSpareBytes)) {
    spare_bytes_ -= spare_.front().size();
    spare_.erase(spare_.begin());
  }
  spare_bytes_ += bytes.size();
  spare_.push_back(std::move(bytes));
}

}  // namespace jaxcomm::cpu
