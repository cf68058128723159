// Shared memory between processes of one host.
//
// Each process owns anonymous segments (memfd): one control block and data segments that
// grow by generations. Peers map them through /proc/<pid>/fd/<fd>, so no segment ever
// has a name in /dev/shm and nothing outlives the processes, however they exit.
//
// The control block holds a table of slots, one per (instruction, group) the process
// ran across processes. The owner copies its inputs for a round into the slot's data
// and publishes the round's sequence number; readers find the slot by key, wait for the
// number, read, and then publish in their own slot for that key that they are done, so
// the owner may overwrite that buffer two rounds later (each slot has two buffers).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/mismatch.h"

namespace jaxcomm::cpu {

// An owned mapping of a memfd, this process's or a peer's.
class Segment {
 public:
  // A new segment of `bytes` (zero-filled), or nullptr with `error` set.
  static std::unique_ptr<Segment> Create(const std::string& name, size_t bytes, std::string* error);
  // Maps a peer's segment, open as file descriptor `fd` in process `pid`.
  static std::unique_ptr<Segment> Open(int pid, int fd, size_t bytes, std::string* error);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }

 private:
  Segment(int fd, char* data, size_t size) : fd_(fd), data_(data), size_(size) {}
  // Maps `bytes` of open file `fd` (taking it; closed on failure); `what` names it in errors.
  static std::unique_ptr<Segment> Map(int fd, size_t bytes, const std::string& what, std::string* error);
  int fd_;
  char* data_;
  size_t size_;
};

constexpr int kMaxSlots = 4096;
constexpr int kMaxGenerations = 64;
constexpr int kMaxJoinProcesses = 1024;

struct SlotEntry {
  std::atomic<uint64_t> key;  // 0 while free; stored last, with release
  uint64_t fingerprint;
  uint64_t offset;
  uint64_t bytes;
  uint32_t generation;
  std::atomic<int64_t> published;  // the last round whose data is in place
  std::atomic<int64_t> done;       // the last round whose peers' data this process read
};

struct GenerationEntry {
  std::atomic<int32_t> fd_plus_one;  // 0 until the segment exists
  uint64_t bytes;
};

// A restarted process asking to rejoin (jaxcomm.ft.rejoin): written by it into each
// survivor's control block, at its process index; `generation` is stored last.
struct JoinRequest {
  std::atomic<uint64_t> generation;  // 0: none
  int32_t pid;
  int32_t control_fd;
  uint64_t control_bytes;
};

// How a waiting process is woken by its peers: each process sleeps (its progress thread,
// on a futex) on the doorbell of its own control block, and a peer that publishes a
// round or releases one rings the doorbell of every shared-memory peer of that round.
// `sleeping` spares the ringer the system call while nobody sleeps, and `awaiting_peers`
// spares the sleeper a wake-up by a peer while none of its exchanges waits on one (it
// would otherwise wake for every round its device threads finish themselves, and take
// turns on their core with them).
struct Doorbell {
  alignas(64) std::atomic<uint32_t> rings;
  std::atomic<uint32_t> sleeping;
  std::atomic<uint32_t> awaiting_peers;
};

// Rings `bell`: wakes its owner if it sleeps on it (`from_peer`: only if it awaits peers,
// which it must say before its last look for work: see World::Progress).
void Ring(Doorbell& bell, bool from_peer = true);
// Sleeps until `bell` rings after `seen` (its `rings` read before checking for work; a
// ring since then returns at once) or `timeout` passes. Only the bell's owner sleeps;
// `awaiting_peers`: whether the peers' rings should wake it.
void SleepOnBell(Doorbell& bell, uint32_t seen, std::chrono::microseconds timeout, bool awaiting_peers);

// This process's waits that outlasted the mismatch grace period (core/mismatch.h), for
// its peers to read. Written by its progress thread only, under a sequence lock.
struct WaitBoard {
  std::atomic<uint64_t> version;  // odd while being rewritten
  uint32_t count;
  uint32_t reserved;
  WaitNotice notices[kMaxWaitNotices];
};

struct ControlBlock {
  uint64_t magic;
  int32_t pid;
  int32_t process;
  // Where the owner maps this block: a peer reads `magic` there with process_vm_readv to
  // learn whether it may read the owner's memory directly (World::Link).
  uint64_t self_address;
  Doorbell bell;
  // The core (plus one; 0: none) of a thread of this process that now spins waiting for
  // its peers: a peer that spins on the same core knows they take turns on it (PeerSpin).
  alignas(64) std::atomic<int32_t> spinning_cpu;
  alignas(64) WaitBoard waits;
  GenerationEntry generations[kMaxGenerations];
  SlotEntry slots[kMaxSlots];
  JoinRequest joins[kMaxJoinProcesses];
};

// This process's side: its control block and data segments.
class ShmOwner {
 public:
  static std::unique_ptr<ShmOwner> Create(int64_t process, std::string* error);
  int control_fd() const { return control_->fd(); }
  size_t control_bytes() const { return control_->size(); }
  ControlBlock& block() const { return *reinterpret_cast<ControlBlock*>(control_->data()); }

  // The slot of `key`, created with two buffers of `bytes` on first use (round n uses
  // buffer n % 2); nullptr and `error` when
  // it cannot be (full table, out of memory, or an existing slot of another size).
  SlotEntry* Slot(uint64_t key, uint64_t fingerprint, size_t bytes, std::string* error);
  // The slot of `key` if this process created it, else nullptr.
  SlotEntry* Find(uint64_t key);
  // Where a slot's data lives in this process.
  char* Data(const SlotEntry& slot) const;
  // Shows `notices` on this process's wait board (one writer: the progress thread).
  void ShowWaits(const std::vector<WaitNotice>& notices);

  // What it holds (jaxcomm.memory()): the control block, the data segments as mapped,
  // the part of them its slots take, and the slots.
  struct Held {
    size_t control = 0, data = 0, data_used = 0, slots = 0;
  };
  Held held() const;

 private:
  mutable std::mutex mu_;
  std::unique_ptr<Segment> control_;
  std::vector<std::unique_ptr<Segment>> generations_;
  size_t used_ = 0;  // bytes allocated in the newest generation
  size_t data_bytes_ = 0, data_used_ = 0;  // all generations' sizes, and their slots' share
  std::unordered_map<uint64_t, SlotEntry*> slots_;
};

// A peer's side, as this process sees it: its control block and the data segments
// mapped so far. Used by one thread at a time (the world's lock).
class ShmPeer {
 public:
  static std::unique_ptr<ShmPeer> Open(int pid, int fd, size_t bytes, std::string* error);
  int pid() const { return pid_; }
  ControlBlock& block() const { return *reinterpret_cast<ControlBlock*>(control_->data()); }
  // The peer's slot of `key`, or nullptr while the peer has not created it.
  const SlotEntry* Find(uint64_t key);
  // The slot's data, mapping its generation on first use; nullptr and `error` on failure.
  const char* Data(const SlotEntry& slot, std::string* error);
  // What the peer's wait board shows now.
  std::vector<WaitNotice> Waits() const;
  // A consistent copy of the newest round published in the slot of `key`: (seq, bytes),
  // or seq 0 when there is none (the owner may be writing the next rounds meanwhile).
  std::pair<int64_t, std::vector<char>> Snapshot(uint64_t key);
  // Asks the peer to readmit process `process` (this one, restarted).
  void RequestJoin(int64_t process, uint64_t generation, int pid, int control_fd, size_t control_bytes);

 private:
  int pid_ = 0;
  std::unique_ptr<Segment> control_;
  std::vector<std::unique_ptr<Segment>> generations_;
  std::unordered_map<uint64_t, const SlotEntry*> found_;
};

}  // namespace jaxcomm::cpu
