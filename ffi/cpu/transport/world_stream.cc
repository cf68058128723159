// Streaming a round through shared memory (core/cross_process.h, StreamSpec).
//
// Each process owns a ring of kRingChunks entries per (instruction, group); an entry
// holds one chunk (the same element range) of every one of its ranks' inputs. The
// process copies chunk after chunk of its inputs into its ring while it consumes the
// chunks its peers already put in theirs, in the same order, so a chunk is read by the
// peers while it is still in the shared cache. Two counters in the ring's slot entry
// carry the protocol, both Mark(round, chunks) and only ever growing:
//   published: the chunks of the round in place in this process's ring (a chunk that no
//              peer reads, StreamSpec::published, counts without being copied);
//   done:      the chunks of the round this process consumed from every peer.
// A chunk may overwrite a ring entry once every peer consumed the chunk it held; a
// process marks done = Mark(round, 0) when it starts a round, after it consumed all of
// the previous one, so the first chunks of a round never overwrite unread ones.
//
// Single copy (StreamSpec::pull, where every process of the round may read the others'
// memory): no ring. Each process reads the chunks of the peers' inputs with
// process_vm_readv into a buffer that stays in its cache, consumes them, and then
// publishes done = Mark(round, chunks) in a slot of its own and waits for the peers'
// before it returns (XLA may reuse its inputs once the call completes). Each byte then
// crosses once, from the peer's memory, instead of into the ring and out of it through
// the other core's cache (16 MiB each way between 2 processes: 3.5-4.1 ms against
// 4.4-4.9 ms in a C model of both; an in-process copy of the same bytes took 1.6-2.2).
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <thread>

#include "core/registry.h"
#include "cpu/transport/world.h"
#include "cpu/transport/world_internal.h"

namespace jaxcomm::cpu {
namespace {

using Clock = std::chrono::steady_clock;

// One rank's share of a chunk. A ring of 8 such chunks per process stays in the shared
// cache along with the chunks being read (256 KiB through a 2 MiB ring was the fastest of
// 0.25-2 MiB chunks in a two-thread model of 2 processes exchanging 4 and 16 MiB).
constexpr size_t kChunkBytes = 256 * 1024;
constexpr size_t kRingChunks = 8;
constexpr int kChunkBits = 24;
constexpr auto kStallPoll = std::chrono::microseconds(50);

int64_t Mark(int64_t seq, size_t chunks) { return (seq << kChunkBits) + static_cast<int64_t>(chunks); }

uint64_t RingKey(uint64_t key) {
  const uint64_t k = key ^ 0x72696e6773747265ull;  // "ringstre"
  return k == 0 ? 1 : k;
}

uint64_t PullKey(uint64_t key) {
  const uint64_t k = key ^ 0x70756c6c73747265ull;  // "pullstre"
  return k == 0 ? 1 : k;
}

// What a process says of a peer whose slot for the call does not match its own.
std::string RunsAnotherProgram(const std::string& desc) {
  return desc + " runs a different collective at this call (op, dtype or shape differ); "
                "the processes run different programs";
}

// One step of a wait for peers that have been quiet since `since`: spinning while they
// keep up; a peer that stalls (descheduled, paging) is then polled with short sleeps
// instead of burning this core.
void WaitStep(PeerSpin& spin, Clock::time_point since) {
  if (Clock::now() - since < Registry::Get().spin()) {
    spin.Step();
  } else {
    std::this_thread::sleep_for(kStallPoll);
  }
}

// Chunks of a round: per_chunk elements each (at most 2^24 chunks, one Mark field).
size_t PerChunk(size_t elements, size_t item) {
  return std::max({size_t{1}, kChunkBytes / item, (elements >> kChunkBits) + 1});
}

}  // namespace

bool World::CanStream(const std::vector<int64_t>& peers) const {
  // A stream waits by spinning, as its peers are in the round: with more processes of
  // the group than cores they would take turns on the cores instead (4 processes on 2
  // cores streamed 16 MiB all_gathers 2x slower than copying whole).
  static const size_t cores = std::max(1u, std::thread::hardware_concurrency());
  if (!shm_ || peers.empty() || peers.size() + 1 > cores) return false;
  for (int64_t q : peers) {
    auto link = Peer(q);
    if (!link || !link->shared_memory()) return false;
  }
  return true;
}

bool World::CanReadDirectly(const std::vector<int64_t>& peers) const {
  return Registry::Get().single_copy() &&
         std::all_of(peers.begin(), peers.end(), [this](int64_t q) { return ReadsDirectly(q); });
}

std::string World::StreamPeers(const StreamSpec& s, std::vector<StreamPeer>* peers) const {
  const ExchangePlan& plan = *s.plan;
  peers->assign(plan.peers.size(), StreamPeer{});
  size_t first = 0;
  for (size_t i = 0; i < plan.peers.size(); ++i) {
    StreamPeer& p = (*peers)[i];
    p.link = Peer(plan.peers[i]);
    p.shm = p.link ? p.link->shared_memory() : nullptr;
    if (!p.shm) return "process " + std::to_string(plan.peers[i]) + " is not linked through shared memory";
    p.first = first;
    p.ranks = s.peer_ranks[i];
    p.desc = p.link->Describe() + " with " + plan.peer_desc[i];
    first += p.ranks;
  }
  return "";
}

PeerSpin World::SpinFor(const std::vector<StreamPeer>& peers) const {
  return PeerSpin(Block(), [&peers](int cpu) {
    return std::any_of(peers.begin(), peers.end(), [cpu](const StreamPeer& p) { return p.shm->SpinsOn(cpu); });
  });
}

bool World::ReadsDirectly(int64_t p) const {
  auto link = Peer(p);
  ShmPeerTransport* shm = link ? link->shared_memory() : nullptr;
  return shm && shm->reads_directly();
}

World::Held World::held() const {
  Held h;
  if (shm_) {
    const ShmOwner::Held s = shm_->owner().held();
    h.shm_control = s.control;
    h.shm_data = s.data;
    h.shm_data_used = s.data_used;
    h.calls = static_cast<int64_t>(s.slots);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [_, link] : peers_) h.link_buffers += link->HeldBytes();
  }
  std::lock_guard<std::mutex> lock(bounce_mu_);
  for (const auto& b : bounces_) h.staging += b.capacity();
  return h;
}

std::vector<char> World::TakeBounce(size_t bytes) {
  std::vector<char> b;
  {
    std::lock_guard<std::mutex> lock(bounce_mu_);
    if (!bounces_.empty()) {
      b = std::move(bounces_.back());
      bounces_.pop_back();
    }
  }
  b.resize(bytes);
  return b;
}

void World::GiveBounce(std::vector<char> buffer) {
  std::lock_guard<std::mutex> lock(bounce_mu_);
  bounces_.push_back(std::move(buffer));
}

std::string World::Stream(const StreamSpec& s, const StreamConsume& consume, bool* timed_out) {
  *timed_out = false;
  if (s.pull) return Pull(s, consume, timed_out);
  const ExchangePlan& plan = *s.plan;
  const size_t item = s.item_bytes;
  if (s.elements == 0 || item == 0) return "";
  const size_t per_chunk = PerChunk(s.elements, item);
  const size_t chunks = (s.elements + per_chunk - 1) / per_chunk;
  const size_t rank_chunk = per_chunk * item;  // bytes of one rank in an entry
  const uint64_t key = RingKey(plan.key);

  // The slot's two buffers together hold the ring.
  std::string error;
  const size_t my_entry = s.mine.size() * rank_chunk;
  SlotEntry* slot = shm_->owner().Slot(key, plan.fingerprint, kRingChunks / 2 * my_entry, &error);
  if (!slot) return error;
  char* const ring = shm_->owner().Data(*slot);

  using Source = StreamPeer;  // its slot: its ring, once it created it
  std::vector<Source> sources;
  if (std::string e = StreamPeers(s, &sources); !e.empty()) return e;
  const size_t remote_ranks = sources.empty() ? 0 : sources.back().first + sources.back().ranks;
  // Finds a peer's ring (it makes it when its first round starts); false while absent.
  auto resolve = [&](Source& src) -> bool {
    if (src.slot) return true;
    const SlotEntry* e = src.shm->Slot(key);
    if (!e) return false;
    if (e->fingerprint != plan.fingerprint || e->bytes != kRingChunks / 2 * src.ranks * rank_chunk) {
      error = RunsAnotherProgram(src.desc);
      return false;
    }
    src.data = src.shm->Data(*e, &error);
    if (!src.data) {
      error = "reading the shared memory of " + src.desc + ": " + error;
      return false;
    }
    src.slot = e;
    return true;
  };

  slot->done.store(Mark(s.seq, 0), std::memory_order_release);
  std::vector<const char*> remote(remote_ranks), local(s.mine.size());
  std::vector<bool> copied(chunks, false);
  std::string consume_error;
  size_t sent = 0, got = 0;
  PeerSpin spin = SpinFor(sources);
  auto next_check = Clock::now() + kFirstLivenessCheck;
  auto last_moved = Clock::now();
  while (sent < chunks || got < chunks) {
    bool moved = false;
    // Fill: chunk `sent` goes to entry sent % kRingChunks once every peer consumed the
    // chunk that entry held.
    while (sent < chunks) {
      const int64_t need = sent < kRingChunks ? Mark(s.seq, 0) : Mark(s.seq, sent - kRingChunks + 1);
      bool free = true;
      for (Source& src : sources) {
        if (!resolve(src) || src.slot->done.load(std::memory_order_acquire) < need) {
          free = false;
          break;
        }
      }
      if (!error.empty()) return error;
      if (!free) break;
      const size_t lo = sent * per_chunk, n = std::min(per_chunk, s.elements - lo);
      if (!s.published || s.published(lo, lo + n)) {
        char* entry = ring + (sent % kRingChunks) * my_entry;
        for (size_t r = 0; r < s.mine.size(); ++r) std::memcpy(entry + r * rank_chunk, s.mine[r] + lo * item, n * item);
        copied[sent] = true;
      }
      slot->published.store(Mark(s.seq, ++sent), std::memory_order_release);
      moved = true;
    }
    // Consume chunk `got` once every peer published it, and once this process did: an
    // all_reduce may write its result over its input (aliased), which must be in the
    // ring before that. (The ring then never blocks: every process can fill past the
    // slowest consumer.)
    if (got < sent) {
      bool ready = true;
      for (Source& src : sources) {
        if (!resolve(src) || src.slot->published.load(std::memory_order_acquire) < Mark(s.seq, got + 1)) {
          ready = false;
          break;
        }
      }
      if (!error.empty()) return error;
      if (ready) {
        size_t k = 0;
        for (const Source& src : sources) {
          const char* entry = src.data + (got % kRingChunks) * src.ranks * rank_chunk;
          for (size_t r = 0; r < src.ranks; ++r) remote[k++] = entry + r * rank_chunk;
        }
        const size_t lo = got * per_chunk;
        // This process's own chunk is read from its ring entry, in the cache, unless it
        // was never copied there or the entry already holds a later chunk.
        const char* own = copied[got] && sent <= got + kRingChunks ? ring + (got % kRingChunks) * my_entry : nullptr;
        for (size_t r = 0; r < s.mine.size(); ++r) local[r] = own ? own + r * rank_chunk : s.mine[r] + lo * item;
        // A kernel error still consumes the chunk: the peers must not wait for it.
        std::string e = consume(local, remote, lo, std::min(s.elements, lo + per_chunk));
        if (consume_error.empty()) consume_error = std::move(e);
        slot->done.store(Mark(s.seq, ++got), std::memory_order_release);
        moved = true;
      }
    }
    if (moved) {
      last_moved = Clock::now();
      continue;
    }
    // The peers are in this round (its arrival handshake is over) and stream it too, so
    // a wait here is short unless one of them died or stopped.
    const auto now = Clock::now();
    if (now >= next_check || now >= s.deadline) {
      next_check = now + kLivenessPeriod;
      std::ostringstream behind;
      for (const Source& src : sources) {
        const bool lagging = !src.slot || src.slot->published.load() < Mark(s.seq, std::min(chunks, got + 1)) ||
                             src.slot->done.load() < Mark(s.seq, sent < kRingChunks ? 0 : sent - kRingChunks + 1);
        if (!lagging) continue;
        if (std::string gone = src.shm->Failure(); !gone.empty()) {
          return src.desc + " failed: " + gone + " while this call streamed through shared memory (chunk " +
                 std::to_string(got) + " of " + std::to_string(chunks) + ")";
        }
        behind << (behind.tellp() > 0 ? "; " : "") << src.desc;
      }
      if (now >= s.deadline) {
        *timed_out = true;
        return "timed out (timeout_s / JAXCOMM_TIMEOUT_S) streaming this call through shared memory "
               "at chunk " + std::to_string(got) + " of " + std::to_string(chunks) + ", waiting for " +
               behind.str();
      }
    }
    WaitStep(spin, last_moved);
  }
  return consume_error;
}

std::string World::Pull(const StreamSpec& s, const StreamConsume& consume, bool* timed_out) {
  const ExchangePlan& plan = *s.plan;
  const size_t item = s.item_bytes;
  if (s.elements == 0 || item == 0) return "";
  const size_t per_chunk = PerChunk(s.elements, item);
  const size_t chunks = (s.elements + per_chunk - 1) / per_chunk;
  const size_t rank_chunk = per_chunk * item;
  const uint64_t key = PullKey(plan.key);
  const int64_t finished = Mark(s.seq, chunks);
  std::string error;
  SlotEntry* slot = shm_->owner().Slot(key, plan.fingerprint, sizeof(uint64_t), &error);
  if (!slot) return error;

  using Source = StreamPeer;  // its slot: where it says it finished reading, once it made it
  std::vector<Source> sources;
  if (std::string e = StreamPeers(s, &sources); !e.empty()) return e;
  const size_t remote_ranks = sources.empty() ? 0 : sources.back().first + sources.back().ranks;
  if (s.remote_inputs.size() != remote_ranks) return "the peers' operand addresses did not arrive";

  std::vector<char> bounce = TakeBounce(remote_ranks * rank_chunk);
  std::vector<const char*> remote(remote_ranks), local(s.mine.size());
  for (size_t k = 0; k < remote_ranks; ++k) remote[k] = bounce.data() + k * rank_chunk;
  std::vector<iovec> here, there;
  std::string consume_error;
  for (size_t c = 0; c < chunks && error.empty(); ++c) {
    const size_t lo = c * per_chunk, n = std::min(per_chunk, s.elements - lo);
    const bool wanted = !s.read_here || s.read_here(lo, lo + n);
    for (const Source& src : sources) {
      here.clear();
      there.clear();
      size_t bytes = 0;
      for (size_t k = src.first; wanted && k < src.first + src.ranks; ++k) {
        if (!s.remote_read.empty() && !s.remote_read[k]) continue;  // the chunk is not read
        here.push_back({bounce.data() + k * rank_chunk, n * item});
        there.push_back({reinterpret_cast<void*>(s.remote_inputs[k] + lo * item), n * item});
        bytes += n * item;
      }
      if (here.empty()) continue;
      const ssize_t got = process_vm_readv(src.shm->pid(), here.data(), here.size(), there.data(), there.size(), 0);
      if (got == static_cast<ssize_t>(bytes)) continue;
      const int err = errno;
      const std::string at = " (chunk " + std::to_string(c) + " of " + std::to_string(chunks) + ")";
      std::string gone = src.shm->Failure();
      // ESRCH while the pid still answers kill(): the process is exiting (its memory is
      // gone before it becomes a zombie), which ProcessGone cannot see yet.
      if (gone.empty() && got < 0 && err == ESRCH) gone = "it exited";
      if (!gone.empty()) {
        error = src.desc + " failed: " + gone + " while this call read its operands from its memory" + at;
      } else {
        error = "reading the operands of " + src.desc + " from its memory (process_vm_readv)" + at + ": " +
                (got < 0 ? std::strerror(err) : "short read");
      }
      break;
    }
    if (!error.empty()) break;
    for (size_t r = 0; r < s.mine.size(); ++r) local[r] = s.mine[r] + lo * item;
    // A kernel error still lets the round finish: the peers must not wait for it.
    std::string e = consume(local, remote, lo, lo + n);
    if (consume_error.empty()) consume_error = std::move(e);
  }
  GiveBounce(std::move(bounce));
  // This process reads no more of the peers' inputs (also after an error: they must not
  // wait for it); its own must stay as they are until every peer says the same.
  slot->done.store(finished, std::memory_order_release);
  PeerSpin spin = SpinFor(sources);
  const auto waiting_since = Clock::now();
  auto next_check = waiting_since + kFirstLivenessCheck;
  for (;;) {
    bool all = true;
    for (Source& src : sources) {
      if (!src.slot) {
        src.slot = src.shm->Slot(key);
        if (src.slot && src.slot->fingerprint != plan.fingerprint) {
          return RunsAnotherProgram(src.desc);
        }
      }
      all &= src.slot && src.slot->done.load(std::memory_order_acquire) >= finished;
    }
    if (all) break;
    const auto now = Clock::now();
    if (now >= next_check || now >= s.deadline) {
      next_check = now + kLivenessPeriod;
      std::ostringstream behind;
      for (const Source& src : sources) {
        if (src.slot && src.slot->done.load() >= finished) continue;
        if (std::string gone = src.shm->Failure(); !gone.empty()) {
          return !error.empty() ? error
                                : src.desc + " failed: " + gone +
                                      " while it read this call's operands from this process's memory";
        }
        behind << (behind.tellp() > 0 ? "; " : "") << src.desc;
      }
      if (now >= s.deadline) {
        *timed_out = true;
        return "timed out (timeout_s / JAXCOMM_TIMEOUT_S) waiting for " + behind.str() +
               " to finish reading this call's operands from this process's memory";
      }
    }
    WaitStep(spin, waiting_since);
  }
  if (!error.empty()) return error;
  Registry::Get().single_copy_rounds.fetch_add(1, std::memory_order_relaxed);
  return consume_error;
}

}  // namespace jaxcomm::cpu
