// What World (world.h) needs of the links that carry a round between processes, so that
// it never asks which kind of link a peer has: shared memory (shm_transport.h), TCP
// (tcp_transport.h) and MPI (mpi_transport.h) implement it. Each reports what it can do
// (Capabilities); World and the algorithms above it choose by that, never by its name.
// World opens its transports through one factory (factory.h): adding a transport is its
// own files and one line there.
//
// Two sides. A Transport is this process's side of one kind of link (World holds one per
// kind it opened); a PeerTransport is the link to one peer process through it. A round
// is published in two steps, so that each kind moves it the way it moves data best:
//   1. Transport::Publish, once per round and transport: shared memory copies this
//      process's contribution into its own slot of the call, which all its peers read;
//      TCP does nothing here.
//   2. PeerTransport::Send, per peer of that transport: TCP writes the peer's frame;
//      shared memory rings the peer's doorbell (the data is already in place).
// The peer's contribution is then looked for with PeerTransport::Find, and the round let
// go with Transport::Release then PeerTransport::Release. What is not a round (a peer's
// health, the mismatch check's notices, a restarted process rejoining) goes through the
// same two classes.
//
// Threads: World calls one PeerTransport from its device threads and its progress thread
// at once; implementations lock what they cache.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/cross_process.h"
#include "core/mismatch.h"

namespace jaxcomm::cpu {

// A transport's settings (from the bootstrap) or its endpoint (what a peer needs to link
// to this process through it, published by the bootstrap): named fields, as text.
using Params = std::map<std::string, std::string>;

// Field `name` of `params` ("" when absent).
inline std::string Field(const Params& params, const std::string& name) {
  auto it = params.find(name);
  return it == params.end() ? "" : it->second;
}

// Field `name` of `params` as an integer: false and `error` when absent or not one. A
// value above INT64_MAX (a 64-bit handle written unsigned) keeps its bits.
inline bool IntField(const Params& params, const std::string& name, int64_t* value, std::string* error) {
  const std::string text = Field(params, name);
  try {
    size_t used = 0;
    *value = std::stoll(text, &used, 0);
    if (used == text.size()) return true;
  } catch (const std::out_of_range&) {
    try {
      size_t used = 0;
      *value = static_cast<int64_t>(std::stoull(text, &used, 0));
      if (used == text.size() && text.find('-') == std::string::npos) return true;
    } catch (const std::exception&) {
    }
  } catch (const std::exception&) {
  }
  *error = "the transport's field '" + name + "' is not an integer: '" + text + "'";
  return false;
}

// What a transport's links can do (core/cross_process.h has what the algorithms read).
struct Capabilities : LinkCapabilities {
  // A send may still read the caller's buffers after PeerTransport::Send returned: an
  // exchange does not finish before Delivered says the round left them.
  bool sends_complete_later = false;
};

// A contribution: byte ranges, sent in order as one.
using Parts = std::vector<std::pair<const void*, size_t>>;

// Round `seq` of call `key`, as this process publishes it.
struct Outgoing {
  uint64_t key = 0;
  uint64_t fingerprint = 0;  // the call's (ExchangePlan::fingerprint)
  int64_t seq = 0;
  std::chrono::steady_clock::time_point deadline;  // for a send that blocks
};

// A peer's contribution to a round, as it arrived: its fingerprint and length as the peer
// published them (the caller checks them against its plan) and where its bytes are
// (non-null, valid until the round is released).
struct Arrival {
  uint64_t fingerprint = 0;
  uint64_t bytes = 0;
  const char* data = nullptr;
};

// Who a peer is, as the bootstrap told this process: messages name it so.
struct PeerIdentity {
  int64_t process = -1;
  std::string host;      // a label of its host, for messages
  std::string host_key;  // processes with the same key share a host (Endpoint::host)
  int pid = 0;           // 0 until the bootstrap said (a peer that connected first)

  std::string Describe() const {
    return "process " + std::to_string(process) + " (host " + host + ", pid " + std::to_string(pid) + ")";
  }
};

class PeerTransport;
class ShmTransport;      // shm_transport.h
class ShmPeerTransport;  // shm_transport.h

// A restarted process (jaxcomm.ft.rejoin) asking to be readmitted, as a transport received
// its request: a new link to it (process and pid filled in) and the request's generation.
struct Rejoiner {
  std::shared_ptr<PeerTransport> link;
  uint64_t generation = 0;
};

// How World::Link asks a transport for a link.
struct LinkRequest {
  PeerIdentity who;  // the peer, as the bootstrap told it
  Params endpoint;   // the peer's endpoint of this transport
  std::chrono::steady_clock::time_point deadline;
  // A restarted process (jaxcomm.ft.rejoin) links every peer itself.
  bool rejoining = false;
};

// This process's side of one kind of link.
class Transport {
 public:
  virtual ~Transport() = default;

  virtual const Capabilities& caps() const = 0;
  // What a peer needs to link to this process through this transport.
  virtual Params Endpoint() const = 0;
  // Links the peer of `request`; nullptr and `error` on failure (the caller names the peer).
  virtual std::shared_ptr<PeerTransport> Link(const LinkRequest& request, std::string* error) = 0;
  // Called by World's progress thread about every 50 ms, and on nothing else's behalf:
  // whatever the transport does in the background that needs no thread of its own
  // (TCP: takes the connections of restarted processes).
  virtual void Poll() {}
  // Connections from strangers this transport refused (one that listens: tcp_link.h).
  virtual int64_t refused() const { return 0; }
  // The shared-memory transport as such (streaming and the inline exchange work on its
  // control block and slots), or null: what World asks of no other transport.
  virtual ShmTransport* shared_memory() { return nullptr; }
  // Stops what the transport runs in the background before its library goes away (MPI:
  // before MPI_Finalize); its links fail from then on. Idempotent.
  virtual void Close() {}
  // Step 1 of publishing `round` (above): for a transport whose peers read one shared copy,
  // copies `mine` there. Called once per round when some peer of the round is linked
  // through this transport (left out or not: a restarted process reads the copy of a
  // round it does not take part in), after every peer said MayPublish. "" or the error.
  virtual std::string Publish(const Outgoing& round, const Parts& mine) = 0;
  // This process has read its peers' contributions to round `seq` of `key`; before the
  // peers' PeerTransport::Release.
  virtual void Release(uint64_t key, int64_t seq) = 0;
  // The mismatch check (core/mismatch.h): shows this process's waits where all its peers
  // read them (a board in shared memory); peers that cannot read it are sent them
  // (PeerTransport::ShowWaits).
  virtual void ShowWaits(const std::vector<WaitNotice>& notices) = 0;
  // A restarted process readmitted at round `last` + 1 of `key`: marks the rounds up to
  // `last` as published and read, so that no peer waits for them. "" or the error.
  virtual std::string SkipRounds(uint64_t key, uint64_t fingerprint, size_t bytes, int64_t last) = 0;
  // Survivors: the requests to rejoin that reached this transport from `candidates` (the
  // processes left out) and that `wanted` (process, generation) accepts.
  virtual std::vector<Rejoiner> Joins(const std::vector<int64_t>& candidates,
                                      const std::function<bool(int64_t, uint64_t)>& wanted) = 0;
};

// The link to one peer process through a Transport.
class PeerTransport {
 public:
  virtual ~PeerTransport() = default;
  PeerTransport() = default;
  PeerTransport(const PeerTransport&) = delete;
  PeerTransport& operator=(const PeerTransport&) = delete;

  // Who the peer is: World fills it in from the bootstrap (under its lock).
  PeerIdentity peer;
  std::string Describe() const { return peer.Describe(); }

  // This process's side of the same transport (local().caps(): what the link can do).
  virtual Transport& local() const = 0;
  // Streaming and the inline exchange work on the peer's shared memory itself: the link
  // as such, or null where it has none. The only question World asks about a link's kind.
  virtual ShmPeerTransport* shared_memory() { return nullptr; }

  // Sending.
  // Whether round `seq` of `key` may be published now: false while the peer may still read
  // what publishing it overwrites (shared memory: its buffer of round seq - 2).
  virtual bool MayPublish(uint64_t key, int64_t seq) = 0;
  // Step 2 of publishing `round` (above), after the transport's Publish: what this peer
  // gets is `parts` (a transport whose peers read the shared copy only tells the peer it
  // is there). "" or the error.
  virtual std::string Send(const Outgoing& round, const Parts& parts) = 0;
  // Whether round `seq` of `key` reached the peer (published or sent whole).
  virtual bool Delivered(uint64_t key, int64_t seq) = 0;

  // Receiving.
  // The peer's contribution to round `seq` of `key`: false while it has not arrived; true
  // once it has (`*arrival`), or once it cannot be read (`*error`, naming the peer).
  // `fingerprint` and `bytes`: what this process expects of the call's contributions from
  // this peer (TCP checks the frames it receives later against them).
  virtual bool Find(uint64_t key, int64_t seq, uint64_t fingerprint, uint64_t bytes, Arrival* arrival,
                    std::string* error) = 0;
  // This process no longer reads the peer's contribution to round `seq` of `key`; after
  // the transport's Release.
  virtual void Release(uint64_t key, int64_t seq) = 0;
  // A copy of the newest contribution of `key` the peer made: (seq, bytes), seq 0 if none.
  // Fault-tolerant calls: a restarted process reads the survivors' agreements so.
  virtual std::pair<int64_t, std::vector<char>> Newest(uint64_t key) = 0;

  // Health.
  // Why the peer cannot take part any more ("" while it can): its process is gone, its
  // connection closed. May cost system calls: World asks every kLivenessPeriod.
  virtual std::string Failure() = 0;
  // Whether the link is known to have failed, for the cost of a load (asked at every look).
  virtual bool Failed() const { return false; }

  // The mismatch check (core/mismatch.h).
  // What the peer shows of its waits past the grace period.
  virtual std::vector<WaitNotice> Notices() = 0;
  // Shows the peer this process's waits, if it cannot read them where the transport's
  // ShowWaits put them. "" or the error.
  virtual std::string ShowWaits(const std::vector<WaitNotice>& notices,
                                std::chrono::steady_clock::time_point deadline) = 0;

  // Bytes this link holds on this process's side, beyond its transport's (TCP: frames
  // received and spare buffers); jaxcomm.memory().
  virtual size_t HeldBytes() const { return 0; }

  // Waiting: whether the peer shows a thread spinning on core `cpu` (PeerSpin, world_internal.h).
  virtual bool SpinsOn(int /*cpu*/) const { return false; }

  // Rejoining (jaxcomm.ft.rejoin): asks the peer, a survivor, to readmit this process
  // (`process`, restarted) with request `generation`.
  virtual void RequestJoin(int64_t process, uint64_t generation, std::chrono::steady_clock::time_point deadline) = 0;
};

}  // namespace jaxcomm::cpu
