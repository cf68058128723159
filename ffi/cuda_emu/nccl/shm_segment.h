// A POSIX shared memory segment, mapped (RAII): how the mock NCCL's ranks meet and move
// data between processes (and between threads of one process alike).
#pragma once

#include <cstddef>
#include <string>

namespace jaxcomm::nccl_mock {

class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment();
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // Creates `name` of `bytes`, zero-filled, and maps it. exclusive: fails if the name
  // exists, and the name is removed when this object goes; else opens it when another
  // rank created it first (all of them must ask for the same `bytes`). "" or why not.
  std::string Create(const std::string& name, size_t bytes, bool exclusive);
  // Opens an existing segment, mapping all of it. false: it does not exist yet, or is not
  // sized yet (its creator is between creating and sizing it); try again. `error` is set
  // on any other failure.
  bool TryOpen(const std::string& name, std::string* error);
  // Removes the name now (every mapping stays valid).
  void Unlink();

  char* data() const { return static_cast<char*>(addr_); }
  size_t size() const { return size_; }
  bool mapped() const { return addr_ != nullptr; }

 private:
  void Reset();

  void* addr_ = nullptr;
  size_t size_ = 0;
  std::string name_;
  bool owner_ = false;  // unlinks the name when done
};

}  // namespace jaxcomm::nccl_mock
