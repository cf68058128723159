// Moving a round's inputs between processes, for groups whose ranks live in several
// processes of a job (jax.distributed).
//
// Within a process the ranks of a group meet in the rendezvous and read each other's
// buffers in place (core/rendezvous.h). Across processes, the last local rank to arrive
// hands this process's inputs (every local rank's operands, in rank order) to an
// Exchange; once every other process's inputs are visible here (in shared memory, or
// received over TCP), the same data movement runs with the remote ranks' inputs in place
// of their buffers, and each process writes only its own ranks' results. Release then
// tells the peers that this process has finished reading their inputs.
//
// Implemented by the host transports (cpu/world.h); the rendezvous only sees this
// interface, so the core stays free of sockets and shared memory.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace jaxcomm {

// What stays the same across the executions of one instruction by one group.
// What a link between two processes can do, as the transport that carries it reports it.
// The algorithms choose by these, never by a transport's name (which is only shown).
struct LinkCapabilities {
  // What jaxcomm.stats() and the flight recorder call the transport ("shm", "tcp", "mpi").
  std::string name;
  // The peers read one copy of a round in this host's memory (so the link reaches only
  // processes of this host); streaming and the inline exchange work on it.
  bool shared_memory = false;
  // Each peer is sent a copy of its own: sending a peer only what its ranks read saves
  // bytes (ExchangeSpec::per_peer), and a reduction over three or more such processes
  // runs as a reduce-scatter then an all-gather (scatter_gather.cc).
  bool per_peer_sends = false;
};

struct ExchangePlan {
  uint64_t key = 0;          // (instruction, group): the same in every process of the job
  uint64_t fingerprint = 0;  // op and per-rank operand layout: every process must agree
  std::vector<int64_t> peers;          // the other processes of the group
  std::vector<size_t> peer_bytes;      // the size of each peer's contribution
  std::vector<std::string> peer_desc;  // each peer's ranks, for messages ("ranks [1] ...")
  // The call, for a mismatch's message (core/mismatch.h): its op, its call site, and
  // this process's ranks in it ("ranks [0] (partitions [0])"). Sub-plans copy them.
  std::string op, call_site, ranks;
  // Other processes of the call that this exchange does not hear from (a phase of a
  // hierarchical round): their death fails it too, named, instead of the phase waiting
  // for a peer that waits for them.
  std::vector<int64_t> watched;
  std::vector<std::string> watched_desc;
  // Fault-tolerant calls: the plan of the second phase, in which the survivors agree on
  // whose contributions count (each sends one byte per process of the group).
  std::shared_ptr<const ExchangePlan> agreement;
  // Rounds that stream (Streamable and CanStream): the plan of their arrival handshake,
  // an exchange of nothing that tells every process that all the others are in the call.
  std::shared_ptr<const ExchangePlan> arrival;
};

struct ExchangeSpec {
  std::shared_ptr<const ExchangePlan> plan;
  int64_t seq = 0;  // which execution of the instruction by the group (from 1)
  // This process's contribution, in order: what the peers read.
  std::vector<std::pair<const void*, size_t>> mine;
  // When not empty: what goes to each peer (plan order) linked with per-peer sends
  // (LinkCapabilities::per_peer_sends) instead of `mine`.
  std::vector<std::vector<std::pair<const void*, size_t>>> per_peer;
  std::chrono::steady_clock::time_point deadline;
  // Fault tolerant: a peer that dies or misses the deadline is left out (its blob is
  // nullptr) instead of failing the exchange, the survivors agree on who is left out,
  // and those stay out of every later exchange (the group shrinks).
  bool tolerant = false;
  // This process's contribution is already in place for the peers (an InlineExchange
  // published it, then handed the wait over): Exchange only gathers.
  bool published = false;
};

// The exchange of one call's operands with peers that all share this host, done on the
// calling thread without allocating or taking a lock: for groups with one rank in this
// process, whose device thread may then complete the call itself (RoundTable's inline
// path). It uses the same shared-memory slot and round numbers as Exchange, so a round
// it does not finish within its spin budget continues there.
class InlineExchange {
 public:
  enum class Status {
    kDone,       // every peer's contribution is in `theirs`; call Release(seq) after reading
    kPublished,  // this process's contribution is published, the peers are not all there
    kNotYet,     // nothing done (a peer has not read this slot's older round, or was left out)
  };
  virtual ~InlineExchange() = default;
  // Publishes `mine` (this rank's operands, in order) as round `seq` and spins until
  // every peer published theirs or `until` passes. `theirs` gets one pointer per peer
  // (plan order). Errors (mismatch, dead peer, deadline) are left to Exchange, which
  // takes over any round not kDone.
  virtual Status Run(int64_t seq, const std::vector<std::pair<const void*, size_t>>& mine,
                     std::chrono::steady_clock::time_point until, std::vector<const char*>& theirs) = 0;
  // This process no longer reads the peers' contributions to round `seq`.
  virtual void Release(int64_t seq) = 0;
};

// A round streamed through shared memory: every process copies its ranks' inputs into a
// small ring in cache-sized chunks while the peers consume the chunks already there, so
// the data crosses through the shared cache instead of a full copy in memory and back
// (16 MiB across 2 processes: 2.8 -> 1.5 ms in a two-thread model of it).
struct StreamSpec {
  std::shared_ptr<const ExchangePlan> plan;
  int64_t seq = 0;
  std::vector<const char*> mine;   // this process's ranks' inputs, in rank order
  std::vector<size_t> peer_ranks;  // how many ranks each peer (plan order) has
  size_t elements = 0;             // per rank
  size_t item_bytes = 0;
  // Whether a peer reads elements [lo, hi) of this process's inputs; the chunks nobody
  // reads are counted as published without being copied. Empty: every chunk is read.
  std::function<bool(size_t lo, size_t hi)> published;
  std::chrono::steady_clock::time_point deadline;
  // Single copy (every process of the round agreed, CrossProcess::CanReadDirectly): no
  // ring; each process reads the chunks of the peers' inputs itself, straight from their
  // memory, and waits at the end until the peers have read its own.
  bool pull = false;
  // pull: each remote rank's input, at its address in its own process (ranks in the
  // order of StreamConsume's `remote`).
  std::vector<uint64_t> remote_inputs;
  // pull: whether this process's ranks read each remote rank's input (NeedsFn), and
  // elements [lo, hi) of them (ReadsFn); empty: all of them.
  std::vector<bool> remote_read;
  std::function<bool(size_t lo, size_t hi)> read_here;
};

// Consumes elements [lo, hi) of every rank's input: remote[k] points at element lo of the
// k-th remote rank's (peers in plan order, each one's ranks ascending), local[i] at this
// process's i-th rank's (spec.mine order): the copy in its own ring while that is still
// there, which is in the cache, else its input.
using StreamConsume = std::function<std::string(const std::vector<const char*>& local,
                                                const std::vector<const char*>& remote, size_t lo, size_t hi)>;

// Called once: with the peers' contributions (same order as spec.peers) or an error.
// `timed_out` tells a deadline from a failure (dead peer, mismatch, transport error).
using ExchangeDone =
    std::function<void(const std::string& error, bool timed_out, const std::vector<const char*>& blobs)>;

class CrossProcess {
 public:
  virtual ~CrossProcess() = default;
  // Publishes spec.mine to the peers and gathers theirs. `done` may run on this thread
  // (when the peers were already there) or later on another.
  virtual void Exchange(ExchangeSpec spec, ExchangeDone done) = 0;
  // This process no longer reads the peers' contributions to round (key, seq).
  virtual void Release(const ExchangePlan& plan, int64_t seq) = 0;
  // Whether process `p` is reachable (connected); false until the bootstrap linked it.
  virtual bool Linked(int64_t p) const = 0;
  // Whether the rounds of a group whose other processes are `peers` can be streamed
  // (every peer on this host, no more processes than cores). The answer is the same in
  // every process of the group.
  virtual bool CanStream(const std::vector<int64_t>& /*peers*/) const { return false; }
  // Whether this process may read the memory of every one of `peers` directly (a
  // streamed round then copies once, StreamSpec::pull, if every process of it may).
  virtual bool CanReadDirectly(const std::vector<int64_t>& /*peers*/) const { return false; }
  // Streams round spec.seq, once every process of the group arrived at it (its arrival
  // handshake finished): returns once this process published all its chunks and
  // consumed every peer's (its inputs are no longer read); "" or the error, with
  // `timed_out` telling a deadline from a failure.
  virtual std::string Stream(const StreamSpec& /*spec*/, const StreamConsume& /*consume*/, bool* /*timed_out*/) {
    return "this transport cannot stream";
  }
  // The host key of process `p` (this one's too): processes with the same key share
  // memory. "" when unknown (not linked).
  virtual std::string HostOf(int64_t /*p*/) const { return ""; }
  // What the link to process `p` can do, or nullptr when it is not linked (links never
  // change once made, so the pointer stays valid as long as this object).
  virtual const LinkCapabilities* LinkOf(int64_t /*p*/) const { return nullptr; }
  // The inline form of the exchanges of `plan` (every peer linked through shared memory,
  // not fault tolerant), or nullptr.
  virtual std::unique_ptr<InlineExchange> OpenInline(std::shared_ptr<const ExchangePlan> /*plan*/,
                                                     size_t /*my_bytes*/) {
    return nullptr;
  }
};

}  // namespace jaxcomm
