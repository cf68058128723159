#include "cuda_emu/nccl/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace jaxcomm::nccl_mock {
namespace {

std::string Errno(const std::string& what, const std::string& name) {
  return what + " " + name + ": " + std::strerror(errno);
}

// Closes a descriptor when it goes out of scope (the mapping outlives it).
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

}  // namespace

ShmSegment::~ShmSegment() { Reset(); }

ShmSegment::ShmSegment(ShmSegment&& other) noexcept { *this = std::move(other); }

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    Reset();
    addr_ = std::exchange(other.addr_, nullptr);
    size_ = std::exchange(other.size_, 0);
    name_ = std::move(other.name_);
    owner_ = std::exchange(other.owner_, false);
  }
  return *this;
}

void ShmSegment::Reset() {
  if (addr_ != nullptr) munmap(addr_, size_);
  if (owner_) Unlink();
  name_.clear();
  addr_ = nullptr;
  size_ = 0;
}

void ShmSegment::Unlink() {
  if (!name_.empty()) shm_unlink(name_.c_str());
  owner_ = false;
}

std::string ShmSegment::Create(const std::string& name, size_t bytes, bool exclusive) {
  Reset();
  Fd f{shm_open(name.c_str(), O_RDWR | O_CREAT | (exclusive ? O_EXCL : 0), 0600)};
  if (f.fd < 0) return Errno("shm_open", name);
  name_ = name;
  owner_ = exclusive;
  // A mapping of 0 bytes is invalid: even an empty message has its header.
  const size_t mapped = bytes == 0 ? 1 : bytes;
  struct stat st {};
  if (fstat(f.fd, &st) != 0) return Errno("fstat", name);
  // A shared segment is sized by whoever comes first; sizing it again to the same size
  // leaves the contents alone.
  if (static_cast<size_t>(st.st_size) != mapped && ftruncate(f.fd, static_cast<off_t>(mapped)) != 0) {
    return Errno("ftruncate", name);
  }
  void* a = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, f.fd, 0);
  if (a == MAP_FAILED) return Errno("mmap", name);
  addr_ = a;
  size_ = mapped;
  return "";
}

bool ShmSegment::TryOpen(const std::string& name, std::string* error) {
  Reset();
  Fd f{shm_open(name.c_str(), O_RDWR, 0600)};
  if (f.fd < 0) {
    if (errno != ENOENT) *error = Errno("shm_open", name);
    return false;
  }
  struct stat st {};
  if (fstat(f.fd, &st) != 0) {
    *error = Errno("fstat", name);
    return false;
  }
  if (st.st_size == 0) return false;  // created, not sized yet
  void* a = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, f.fd, 0);
  if (a == MAP_FAILED) {
    *error = Errno("mmap", name);
    return false;
  }
  addr_ = a;
  size_ = static_cast<size_t>(st.st_size);
  name_ = name;
  return true;
}

}  // namespace jaxcomm::nccl_mock
